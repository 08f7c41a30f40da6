# Sourced by the Makefile targets: offline Hugging Face libraries (nothing is downloaded at run time).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
