#!/usr/bin/env bash
# The day-one GPU check, kept at this path (the README, docs/gpu.md and users run it by this name); the driver is
# scripts/gpu/gpu_check.py, which says what each section does. One JSON line per section on stdout
# and in --out (JSONL, written even when a section fails), and the elapsed seconds. Exit status 0: every section ok;
# 1: a check failed; 2: bad usage, or a machine that cannot run it (no GPU, no torch, a package missing and no
# wheelhouse, --mode full without vLLM): one `error:` line on stderr, no traceback.
#   bash scripts/gpu_check.sh --out gpu_check.jsonl              # full mode where vLLM imports, else torch only
#   bash scripts/gpu_check.sh --mode torch --out gpu_check.jsonl  # torch only, offline: wheelhouse/ fills a venv
#   bash scripts/gpu_check.sh --dry-run                          # every section at toy width on the CPU
# The torch-only mode on a machine with torch and no network: build the wheelhouse where there is network
# (bash scripts/build/build_wheelhouse.sh) and carry it along (the device tool: carry ["wheelhouse"]).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
# .venv where the project is installed, else the machine's own Python (the one that has torch); PY= overrides
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3 || command -v python)}
if [ -z "$PY" ]; then
    echo "error: no python3 on PATH: PY=<a python with torch> bash scripts/gpu_check.sh" >&2
    exit 2
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec "$PY" scripts/gpu/gpu_check.py "$@"
