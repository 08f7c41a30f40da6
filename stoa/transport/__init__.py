"""Transport: object stores, int8 quantization, the PULSE codec, the version chain and the rollout exchange."""
