#!/usr/bin/env bash
# GPU check: one GPU, under 8 minutes (killed at 480 s; each section is skipped, and says so, when it no longer
# fits), nothing downloaded. Prints one JSON summary opening with a headline (MFU, tokens/s, the memory plan
# against the measured peak, each section's outcome and seconds); exits 1 if a section failed, 2 when this
# machine cannot run it (no GPU, or a Python package missing: the summary names them). Sections: random-weight
# GPU model configs, the FSDP2 learner's MFU, HF and vLLM rollout, a 7B-wide stand-in under its hub id meta-loaded
# by the learner, the update at the placements' token budgets against bapo/plan.py, `python train.py algo=bapo
# model=qwen7b` at toy size on this GPU, and two processes under torchrun (NCCL on 2 GPUs, else gloo on the CPU).
#   bash scripts/gpu_check.sh                          # on the GPU machine
#   bash scripts/gpu_check.sh --peak-tflops 989 --out gpu_check.json
#   python scripts/gpu_check.py --dry-run              # the same script on CPU with tiny shapes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || command -v python || echo python3 )}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export GPU_CHECK_TIMEOUT=${GPU_CHECK_TIMEOUT:-480}   # gpu_check.py plans its sections to end before it
# a world of one process: NCCL and FSDP2 run for real, with nothing to shard across
exec timeout "$GPU_CHECK_TIMEOUT" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
    scripts/gpu_check.py "$@"
