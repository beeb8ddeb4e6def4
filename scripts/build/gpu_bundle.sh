#!/usr/bin/env bash
# A slim tree for the day-one GPU check on a machine without network, in one folder to copy there: what
# scripts/gpu_check.sh runs (bapo/, conf/, scripts/gpu/, scripts/build/, train.py, eval.py, pyproject.toml) with its
# manual (README.md, docs/gpu.md) and the wheelhouse; no studies, tests, assets or benchmarks (the full tree is about
# 33 MiB, most of it the studies' data). It must fit in half of the device tool's 64 MiB: the script says.
#   make gpu-bundle                                    # = bash scripts/build/gpu_bundle.sh gpu_bundle wheelhouse
#   bash scripts/build/gpu_bundle.sh OUT [WHEELHOUSE]  # then on the machine: cd OUT && bash scripts/gpu_check.sh ...
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-gpu_bundle}
WH=${2:-wheelhouse}
LIMIT_MIB=${LIMIT_MIB:-32}
if [ ! -f "$WH/requirements.txt" ]; then
    echo "error: no wheelhouse at $WH (its requirements.txt): make wheelhouse first" >&2
    exit 2
fi
rm -rf "$OUT" && mkdir -p "$OUT"
git ls-files -z --cached -- bapo conf scripts/gpu scripts/build scripts/gpu_check.sh train.py eval.py pyproject.toml \
    README.md docs/gpu.md | xargs -0 cp --parents -t "$OUT"
cp -r "$WH" "$OUT/wheelhouse"
mib() { du -sb "$@" | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
size=$(mib "$OUT")
echo "$OUT: $(git ls-files --cached -- bapo conf scripts/gpu scripts/build scripts/gpu_check.sh train.py eval.py \
pyproject.toml README.md docs/gpu.md | wc -l) files and the wheelhouse ($(mib "$WH") MiB): $size MiB of $LIMIT_MIB"
if awk "BEGIN {exit !($size > $LIMIT_MIB)}"; then
    echo "error: $OUT is $size MiB, over $LIMIT_MIB MiB" >&2
    exit 1
fi
