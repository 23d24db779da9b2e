#!/usr/bin/env bash
# One device call's GPU checks (about 8 minutes on an H100; run from the repository root with the machine's own
# torch and Lightning): the GPU tier, then bench/fidelity.py on the host-bound bf16 cases and one float32 case,
# measure mode with and without the spin kernels of [Note: host and device], and estimate mode.
# Usage: bash scripts/gpu_check.sh [OUT folder, default $OUT or out/gpu]
set -uo pipefail
out=${1:-${OUT:-out/gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs 2>&1 | tee "$out/gpu_tier.txt"
timeout 330 python3 bench/fidelity.py --steps 20 --warmup 5 --modes estimate measure measure-serial \
    --cases llama-tiny-b8-adamw-bf16mixed gpt-small-b8-adam-bf16mixed net5000x24-b512-sgd-32 \
    --json "$out/fidelity.json" 2>&1 | tee "$out/fidelity.txt"
