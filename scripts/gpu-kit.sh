#!/usr/bin/env bash
# Before a GPU machine is lent (run it HERE, on a development machine that reaches the package
# registry): download into .whl/ the Python 3.12 wheels that scripts/gpu-check.sh installs THERE.
#
#   make venv && scripts/gpu-kit.sh
#
# The GPU machine (NVIDIA H100 or H200, Python 3.12 with a CUDA build of torch, numpy, psutil,
# pytest, pytest-timeout, pytest-xdist, typing-extensions ...) reaches nothing outside itself and has
# no pydantic. What importing agent.checkpoint and running tests/gpu/ and
# `python -m bench.checkpoint --backends file` needs beyond its packages (checked: every module
# those import, with the rest refused, by `scripts/gpu-check.sh --dry-run`):
#   pydantic, pydantic-core, annotated-types, typing-inspection   (agent.settings, agent.manifest)
#   pydantic-settings, python-dotenv                               (the SPOTJOB_* settings)
#   typing-extensions      (pydantic needs a newer one than the machine may have; it shadows it there)
#   tenacity               (the stores' retries)
#   awscrt                 (CRC32C of every file written and read)
# Not boto3, google-cloud-storage, moto, kubernetes: the filesystem store imports none of them.
#
# Versions are the ones this repository's .venv has (what `make test` runs with), for CPython 3.12
# on x86-64 Linux. .whl/ is git-ignored (.gitignore); the device tool sends it when its call names
# it in `carry`. The wheels plus the repository must stay under the tool's 64 MiB: printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
if [ ! -x "$python" ]; then
    echo "gpu-kit: no $python: run 'make venv' first (the wheels take its versions)" >&2
    exit 1
fi
packages=(pydantic pydantic-core annotated-types typing-inspection pydantic-settings python-dotenv
    typing-extensions tenacity awscrt)
pins=()
for name in "${packages[@]}"; do
    version=$("$python" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")
    pins+=("$name==$version")
done
if ! git check-ignore -q .whl/probe.whl; then
    echo "gpu-kit: .whl/ is not git-ignored: add /.whl/ to .gitignore or .git/info/exclude" >&2
    exit 1
fi
rm -rf .whl
mkdir .whl
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    platforms+=(--platform "$p")
done
echo "gpu-kit: downloading ${pins[*]}"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "${pins[@]}"

# The set is closed: each wheel's requirements (for Python 3.12 on Linux) are in .whl/ or on the
# GPU machine already. pip resolves them from .whl/ alone (no pip configuration, no other folder of
# wheels), the machine's packages left out.
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_CONSTRAINT= "$python" -m pip install --quiet --dry-run --ignore-installed --no-index --find-links .whl --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" --target "$(mktemp -d)" \
    "${pins[@]}"
echo "gpu-kit: the wheels resolve among themselves for CPython 3.12 (pip --dry-run --no-index)"

ls -1 .whl
count=$(find .whl -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#packages[@]}" ]; then
    echo "gpu-kit: expected ${#packages[@]} wheels, got $count" >&2
    exit 1
fi
wheels=$(du -cb .whl/*.whl | tail -1 | cut -f1)
repo=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024))
printf 'gpu-kit: wheels %.1f MiB + working tree %.1f MiB = %.1f MiB of the 64 MiB a device call sends\n' \
    "$(echo "$wheels / 1048576" | bc -l)" "$(echo "$repo / 1048576" | bc -l)" "$(echo "($wheels + $repo) / 1048576" | bc -l)"
if [ $((wheels + repo)) -gt $((limit * 3 / 4)) ]; then
    echo "gpu-kit: more than 48 MiB in all: too close to the limit" >&2
    exit 1
fi
echo "gpu-kit: ready. On the GPU machine: scripts/gpu-check.sh (the device call carries .whl)"
