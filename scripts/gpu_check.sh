#!/usr/bin/env bash
# One device call's GPU checks (under 10 minutes on an H100 or H200; run from the repository root with the
# machine's own torch and Lightning): bench/fidelity.py in estimate and measure mode on the host-bound bf16
# cases (a Llama with grouped key/value heads among them) and the float32 Net, with autopart's own one-stage
# step beside plain Lightning's (measure-chained, [Note: chained runs], was compared on an H200 in the
# thirty-seventh session and stays opt-in: --modes measure-chained adds it); then the GPU tier (98 tests);
# then two float32 cases with their data made in each step (issue 9's protocol; GPT's batches cost 0.3 ms),
# and again with the progress bar off (nothing reads back: the fetch overlaps the device, [Note: reads back]);
# then the ResNet cases. Each part has its own time limit (575 s in all), so one slow part leaves the others
# their time; everything is written under the OUT folder as it goes.
# Usage: bash scripts/gpu_check.sh [OUT folder, default $OUT or out/gpu]
set -uo pipefail
out=${1:-${OUT:-out/gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c "import torch, lightning; print(torch.__version__, lightning.__version__, torch.cuda.get_device_name())"
timeout 235 python3 bench/fidelity.py --steps 20 --warmup 5 --modes estimate measure --autopart \
    --cases llama-tiny-b8-adamw-bf16mixed gpt-small-b8-adam-bf16mixed llama-gqa-b8-adamw-bf16mixed \
    net5000x24-b512-sgd-32 --json "$out/fidelity.json" 2>&1 | tee "$out/fidelity.txt"
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -rs --timeout 100 --durations 12 2>&1 \
    | tee "$out/gpu_tier.txt"
# issue 9's own protocol: the examples' data made in the step, the progress bar on ([Note: loader in the step])
timeout 45 python3 bench/fidelity.py --steps 10 --warmup 3 --modes estimate --own-data \
    --cases net5000x24-b512-sgd-32 resnet50x4-b32-sgd-32 \
    --json "$out/fidelity_own_data.json" 2>&1 | tee "$out/fidelity_own_data.txt"
timeout 45 python3 bench/fidelity.py --steps 10 --warmup 3 --modes estimate --own-data quiet \
    --cases net5000x24-b512-sgd-32 resnet50x4-b32-sgd-32 \
    --json "$out/fidelity_own_data_quiet.json" 2>&1 | tee "$out/fidelity_own_data_quiet.txt"
timeout 80 python3 bench/fidelity.py --steps 15 --warmup 5 --modes estimate measure \
    --cases resnet50x4-b32-sgd-32 resnet50x4-b32-sgd-bf16mixed-cl \
    --json "$out/fidelity_resnet.json" 2>&1 | tee "$out/fidelity_resnet.txt"

