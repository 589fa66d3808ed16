#!/usr/bin/env bash
# GPU readiness in one command, for anyone with a CUDA GPU (about 5 minutes on one GPU, no download):
# trains config/gpt2_small.py and config/grt_small.py for 50 iterations each (bf16, compiled) on random
# tokens it writes to a temporary directory, reports tokens/s, MFU, peak memory, the GRT/dense step
# ratio and any recompile, then runs `python bench.py --scale=large`; the last line is one JSON object.
# Without a CUDA GPU it stops with `error: needs a CUDA GPU ...`. Same as `python bench.py --gpu_check=True`.
#   bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}"
exec "$PYTHON" bench.py --gpu_check=True "$@"
