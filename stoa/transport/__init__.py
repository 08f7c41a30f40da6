"""Transport: object stores, run keys and signed documents, int8 quantization, the PULSE codec,
the version chain and the rollout exchange (see ``docs/transport.md``)."""
