#!/usr/bin/env bash
# Run spotjob's torch-facing tests and the demo under a torch other than the one `make test` pins.
#
#   scripts/check-torch.sh 2.14.1 [more pip install arguments]
#
# `make venv` keeps torch==2.13.0 (constraints/dev.txt); this script builds a second venv beside it,
# .venv-torch<VERSION>/ (with PYTHON=/path/to/python3.12: .venv-torch<VERSION>-py3.12.1/, so that
# two Pythons never share one venv), from a copy of constraints/dev.txt with only the torch line changed, installs
# spotjob into it (-e '.[torch,test]'), and runs, one chunk at a time (two pytest-xdist workers):
#   1. tests/integration/test_checkpoint_*.py   (the Checkpointer: save, restore, DCP, FSDP, DDP, async)
#   2. the rest of tests/integration            (agent and torchrun, prefetch, storage, ckpt commands)
#   3. tests/unit files that import torch or the Checkpointer
#   4. tests/e2e                                (spotjob run with real torchrun ranks)
#   5. examples/demo.py                         (what `make demo` runs)
# and prints each chunk's pytest summary line. It exits non-zero if any chunk failed.
# Each chunk gets CHUNK_TIMEOUT seconds (default 3600); a chunk that runs out (a crashed pytest-xdist
# worker can leave pytest waiting for ever) is killed, reported as "timed out" and the next one runs.
# CHUNKS="unit e2e" (names: checkpoint integration unit e2e demo) runs only those. PYTHON=... picks the
# interpreter the venv is made with (default python3); the script prints which Python it ran.
#
# More pip arguments pin what the machine has on disk, e.g. `-c my-local-wheels.txt`; a torch
# version that is not on this machine's disk downloads a multi-GB build. Run it from the repository
# root. It takes about as long as `make test` (the chunks are most of the suite's torch time).
set -uo pipefail

if [ $# -lt 1 ]; then
    echo "usage: scripts/check-torch.sh TORCH_VERSION [more pip install arguments]" >&2
    exit 2
fi
version=$1
shift
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
pyversion=$("$python" -c 'import platform; print(platform.python_version())') || {
    echo "check-torch: cannot run PYTHON=$python" >&2
    exit 1
}
# The default python3 keeps the name README gives; another Python gets its version in the name.
if [ -n "${PYTHON:-}" ]; then
    venv=".venv-torch${version}-py${pyversion}"
else
    venv=".venv-torch${version}"
fi

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv" || exit 1
fi
sed "s/^torch==.*/torch==${version}/" constraints/dev.txt >"$venv/constraints.txt"
if ! grep -qx "torch==${version}" "$venv/constraints.txt"; then
    echo "check-torch: constraints/dev.txt has no torch== line to replace" >&2
    exit 1
fi
"$venv/bin/python" -m pip install --quiet -c "$venv/constraints.txt" "$@" -e '.[torch,test]' || exit 1
found=$("$venv/bin/python" -c 'import torch; print(torch.__version__)') || exit 1
ran=$("$venv/bin/python" -c 'import platform; print(platform.python_version())') || exit 1
echo "check-torch: torch $found, Python $ran, in $venv"

unit=$(grep -l -E 'import torch|Checkpointer|from agent\.(checkpoint|_dcp|dcp_safe|export)' tests/unit/test_*.py)
rest=$(ls tests/integration/test_*.py | grep -v '/test_checkpoint_')
limit=${CHUNK_TIMEOUT:-3600}
status=0
summary=()
run_chunk() {
    local name=$1
    shift
    local log="$venv/chunk-${name}.log"
    timeout --kill-after=60 "$limit" \
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -rfE "$@" >"$log" 2>&1
    local rc=$?
    [ $rc -ne 0 ] && status=1
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        summary+=("$name: timed out after ${limit}s, killed (log: $log)")
    else
        summary+=("$name: $(tail -n 1 "$log") (log: $log)")
    fi
}
chunks=" ${CHUNKS:-checkpoint integration unit e2e demo} "
[[ $chunks == *" checkpoint "* ]] && run_chunk checkpoint tests/integration/test_checkpoint_*.py
# shellcheck disable=SC2086  # word splitting of the file lists is intended
[[ $chunks == *" integration "* ]] && run_chunk integration $rest
# shellcheck disable=SC2086
[[ $chunks == *" unit "* ]] && run_chunk unit $unit
[[ $chunks == *" e2e "* ]] && run_chunk e2e tests/e2e
if [[ $chunks == *" demo "* ]]; then
    if "$venv/bin/python" examples/demo.py >"$venv/demo.log" 2>&1; then
        summary+=("demo: passed (log: $venv/demo.log)")
    else
        status=1
        summary+=("demo: FAILED (log: $venv/demo.log)")
    fi
fi
echo "check-torch: torch $found, Python $ran ($python)"
printf '  %s\n' "${summary[@]}"
exit $status
