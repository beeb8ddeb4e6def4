#!/usr/bin/env bash
# Build wheelhouse/: the project's pure-Python dependencies as wheels, for the day-one GPU check's torch-only mode on
# a GPU machine that has torch and no network (scripts/gpu_check.sh installs them offline, into a venv over that
# machine's own torch: never another torch). Run it where there is network; carry the folder with the device
# tool's `carry: ["wheelhouse"]`. It must fit beside the working tree in the tool's 64 MiB: the script says.
#   bash scripts/build/build_wheelhouse.sh                              # for the H200 image's Python 3.12, x86_64
#   PYTHON_VERSION=3.11 bash scripts/build/build_wheelhouse.sh /tmp/wh   # another target Python, another folder
# Left out: torch and what torch itself requires (the machine has them), numpy (every torch stack has it, and its
# 16 MiB do not fit), datasets and wandb (no section imports them; pyarrow and wandb's binary are large), and what
# the check never imports though a dependency requires it (UNUSED below: about 9 MiB): hf-xet (hub downloads through
# Xet storage; the check downloads nothing), typer and click with what only they need (pydantic, rich, pygments, ...:
# transformers' and huggingface_hub's command lines; transformers' from_pretrained does import kernels). So the
# wheels are installed as the lock file lists them, with --no-deps (requirements.lock: every wheel kept, pinned), and
# scripts/gpu/gpu_check.py then imports every module the sections use before it runs one.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-wheelhouse}
PYV=${PYTHON_VERSION:-3.12}
PIP=(python3 -m pip --disable-pip-version-check)
LIMIT_MIB=${LIMIT_MIB:-64}
rm -rf "$OUT" && mkdir -p "$OUT"
python3 scripts/gpu/gpu_check.py --requirements >"$OUT/requirements.txt"
# omegaconf's parser runtime is published as a source distribution only: its pure-Python wheel is built here
"${PIP[@]}" wheel -q --no-deps -w "$OUT" antlr4-python3-runtime==4.9.3
cons=$(mktemp) && trap 'rm -f "$cons"' EXIT
if [ -x .venv/bin/python ]; then  # the versions the test suite runs with
    .venv/bin/python -m pip freeze --exclude-editable --disable-pip-version-check | grep -iv '^torch==' >"$cons" || true
fi
"${PIP[@]}" download -q --only-binary=:all: --python-version "$PYV" --implementation cp --abi "cp${PYV/./}" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --find-links "$OUT" -c "$cons" -d "$OUT" -r "$OUT/requirements.txt"
# torch's own requirements (as the project's .venv has them), numpy, and whatever only they need: on the machine
TORCH_NEEDS=$([ -x .venv/bin/python ] && .venv/bin/python -c \
    "import importlib.metadata as m; print(' '.join(r.split(';')[0] for r in m.requires('torch') if 'extra' not in r))" \
    || echo "filelock typing-extensions setuptools sympy networkx jinja2 fsspec")
UNUSED="hf-xet typer click"
python3 - "$OUT" "$PYV" "$UNUSED" numpy $TORCH_NEEDS <<'PY'
import re, sys, zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

out, pyv, unused, roots = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(), sys.argv[4:]
target = {"python_version": pyv, "python_full_version": f"{pyv}.0", "sys_platform": "linux", "os_name": "posix",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "extra": ""}  # the GPU machine's, for the markers
norm = lambda s: re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ ;\[(]", s.strip(), maxsplit=1)[0]).lower()
wheels, needs, versions = {}, {}, {}
for w in out.glob("*.whl"):
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(w).read(meta).decode()
    name = norm(re.search(r"^Name: (.+)$", text, re.M).group(1))
    wheels[name], versions[name] = w, re.search(r"^Version: (.+)$", text, re.M).group(1).strip()
    reqs = [Requirement(r) for r in re.findall(r"^Requires-Dist: (.+)$", text, re.M)]
    needs[name] = [norm(r.name) for r in reqs if r.marker is None or r.marker.evaluate(target)]
kept_roots = {norm(r) for r in (out / "requirements.txt").read_text().split()}
provided, todo = set(), [norm(r) for r in roots]  # torch's own requirements and theirs: on the machine
while todo:
    n = todo.pop()
    if n in provided or n in kept_roots:
        continue
    provided.add(n)
    todo += needs.get(n, [])
keep, todo = set(), sorted(kept_roots)  # what the project's requirements need, less the provided and the unused
while todo:
    n = todo.pop()
    if n in keep or n in provided or n in unused:
        continue
    keep.add(n)
    todo += needs.get(n, [])
gone = sorted(n for n in wheels if n not in keep)
for n in gone:
    wheels[n].unlink()
(out / "PROVIDED.txt").write_text("# on the GPU machine already (torch's own requirements, numpy): not carried\n"
                                  + "\n".join(sorted(provided)) + "\n")
(out / "requirements.lock").write_text("".join(f"{n}=={versions[n]}\n" for n in sorted(keep) if n in wheels))
print(f"left out (the machine has them with torch): {', '.join(n for n in gone if n in provided) or 'nothing'}")
print(f"left out (never imported by the check): {', '.join(n for n in gone if n not in provided) or 'nothing'}")
PY
mib() { du -sb "$@" | awk '{s += $1} END {printf "%.1f", s / 1048576}'; }
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk 'END {printf "%.1f", $1 / 1048576}')
size=$(mib "$OUT")
echo "$OUT: $(ls "$OUT"/*.whl | wc -l) wheels, $size MiB; with the working tree ($tree MiB): \
$(awk "BEGIN {print $size + $tree}") MiB of the device tool's $LIMIT_MIB MiB"
if awk "BEGIN {exit !($size + $tree > $LIMIT_MIB)}"; then
    echo "error: $OUT and the working tree exceed $LIMIT_MIB MiB: the device tool would not carry them" >&2
    exit 1
fi
