#!/usr/bin/env bash
# GPU check: one GPU, under 8 minutes (killed at 480 s), nothing downloaded. Prints one JSON summary
# (random-weight Qwen2.5 models from conf/model, FSDP2 over NCCL in bf16, the learner's tokens/s
# and MFU on a 1.5B shape, HF rollout on CUDA, a short train.py loop, and vLLM's tokens/s with a weight
# sync streamed from FSDP2 shards, skipped and said so where vLLM is absent); exits 1 if a check failed.
#   bash scripts/gpu_check.sh                          # on the GPU machine
#   bash scripts/gpu_check.sh --peak-tflops 989 --out gpu_check.json
#   python scripts/gpu_check.py --dry-run              # the same script on CPU with tiny shapes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
# a world of one process: NCCL and FSDP2 run for real, with nothing to shard across
exec timeout "${GPU_CHECK_TIMEOUT:-480}" "$PY" -m torch.distributed.run --standalone --nproc_per_node=1 \
    scripts/gpu_check.py "$@"
