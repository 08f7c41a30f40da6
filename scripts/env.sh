# Sourced by the Makefile targets: preload OpenBLAS for MLX on Linux where it is installed.
for lib in /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0; do
  if [ -e "$lib" ]; then case ":${LD_PRELOAD:-}:" in *"$lib"*) ;; *) export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}";; esac; break; fi
done
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
