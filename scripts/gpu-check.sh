#!/usr/bin/env bash
# The GPU checks of issue #11, in one command for a session that is lent a GPU machine.
#
# HERE, first (a development machine that reaches the package registry):
#   make venv && scripts/gpu-kit.sh          # Python 3.12 wheels into .whl/ (git-ignored)
#   scripts/gpu-check.sh --dry-run           # everything below that needs no GPU, checked here
# THERE (the device tool runs it from the repository root, with .whl carried and $OUT set):
#   bash scripts/gpu-check.sh                # about 5 minutes: the device call's timeout_s 600
#
# It installs the wheels into /tmp/site (the machine reaches nothing outside itself), prints
# nvidia-smi and the versions, runs tests/gpu/ (the Checkpointer on CUDA tensors: restore onto
# the GPU bit-exact, pinned staging buffers kept, reused and released, the user's globals left
# alone), then `python3 -m bench.checkpoint --device cuda --sizes 0.1,1 --backends file --repeat 3`.
# Everything lands in $OUT (bench/out/gpu-check/ without it): gpu-check.log (all of the output),
# gpu-tests.xml (pytest's report), checkpoint-latest.json/.md and the stamped JSON (the bench, which
# writes them to bench/out/ first).
# spotjob comes from the repository itself (PYTHONPATH=.): the machine has no editable install.
#
# --dry-run (here, no GPU): installs the wheels into a temporary folder with a Python 3.12 if this
# machine has one and imports what needs no torch from there (the compiled wheels, agent.settings,
# agent.crc32c, the filesystem store); then, with .venv's Python and every module refused that is
# neither on the GPU machine (its package list) nor in .whl/, imports agent.checkpoint, saves and
# restores a small CPU model (sync and async), runs the bench at its smallest on CPU and runs
# tests/gpu/ (all skipped here), and checks that `--device cuda` stops with its message.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
repo=$PWD
dry=0
if [ "${1:-}" = "--dry-run" ]; then
    dry=1
elif [ $# -gt 0 ]; then
    echo "usage: scripts/gpu-check.sh [--dry-run]" >&2
    exit 2
fi
out=${OUT:-$repo/bench/out/gpu-check}
mkdir -p "$out" || exit 1
export PYTHONUNBUFFERED=1
# The bench's sizes in GB. 0.1 and 1: about 2 minutes by the 2-core CPU figures in bench/README.md (an
# estimate: not run with --device cuda yet); GPU_BENCH_SIZES=0.1,1,4 adds about 2 more, if the lease has them.
GPU_BENCH_SIZES=${GPU_BENCH_SIZES:-0.1,1}

# Modules of the GPU machine's image that spotjob, its tests or the bench may import (its package
# list, as module names), and those of the wheels in .whl/. --dry-run refuses every other one.
DEVICE_MODULES="torch torchgen functorch triton numpy psutil pytest py pluggy iniconfig pygments packaging
xdist execnet pytest_timeout hypothesis sortedcontainers attr attrs sympy mpmath typing_extensions filelock
fsspec jinja2 markupsafe networkx yaml requests urllib3 certifi idna charset_normalizer rich markdown_it mdurl
prometheus_client opt_einsum setuptools pkg_resources mypy_extensions six dateutil cpuinfo cuda pynvml tqdm"
WHEEL_MODULES="pydantic pydantic_core annotated_types typing_inspection pydantic_settings dotenv tenacity awscrt"

step() { printf '\n===== %s (%s) =====\n' "$1" "$(date -u +%H:%M:%S)"; }

install_wheels() { # $1: python, $2: target folder
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "gpu-check: no wheels in .whl/: run scripts/gpu-kit.sh here first and carry .whl" >&2
        return 1
    fi
    "$1" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" .whl/*.whl
}

real_run() {
    local site=/tmp/site status=0
    step "wheels into $site"
    install_wheels python3 "$site" || return 1
    export PYTHONPATH="$repo:$site"
    step "machine"
    nvidia-smi || status=1
    python3 - <<'EOF' || return 1
import importlib.metadata as m, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| built for CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available(), "| devices:", torch.cuda.device_count())
for n in ("pydantic", "pydantic-settings", "awscrt", "tenacity", "typing-extensions", "numpy", "pytest"):
    print(f"  {n} {m.version(n)}")
if not torch.cuda.is_available():
    raise SystemExit("gpu-check: torch sees no GPU: the checks below would only skip")
print("device 0:", torch.cuda.get_device_name(0))
import agent.checkpoint, bench.checkpoint  # noqa: E401,F401  (spotjob from the repository)
print("agent.checkpoint from", agent.checkpoint.__file__)
EOF
    step "tests/gpu (pytest)"
    timeout 240 python3 -m pytest -p no:cacheprovider -o addopts= -rA -v tests/gpu --junitxml "$out/gpu-tests.xml" ||
        status=1
    step "bench.checkpoint --device cuda (file, ${GPU_BENCH_SIZES} GB, 3 repetitions)"
    # Its results go to bench/out/ (the repository's copy there is fresh), then to $out.
    timeout 330 python3 -m bench.checkpoint --device cuda --sizes "$GPU_BENCH_SIZES" --backends file --repeat 3 ||
        status=1
    cp -v bench/out/checkpoint-*.json bench/out/checkpoint-latest.md "$out"/ || status=1
    step "done: status $status"
    return $status
}

dry_run() {
    local tmp status=0 py312=""
    tmp=$(mktemp -d) || return 1
    # shellcheck disable=SC2064
    trap "rm -rf '$tmp'" RETURN
    for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
            py312=$candidate
            break
        fi
    done
    if [ -n "$py312" ]; then
        step "wheels into a temporary folder with $py312 (what the GPU machine's install does)"
        install_wheels "$py312" "$tmp/site312" || return 1
        PYTHONPATH="$repo:$tmp/site312" "$py312" -s - <<'EOF' || status=1
import pydantic, pydantic_core, pydantic_settings, dotenv, tenacity  # noqa: E401,F401
from awscrt import checksums
from agent.crc32c import crc32c_bytes
import agent.settings, agent.storage  # noqa: E401,F401
assert crc32c_bytes(b"123456789") == checksums.crc32c(b"123456789")
with __import__("tempfile").TemporaryDirectory() as d:
    store = agent.storage.open_storage("file://" + d)
    store.close()
print("python3.12: the wheels import, CRC32C works, the filesystem store opens; pydantic", pydantic.VERSION)
EOF
    else
        echo "gpu-check: no Python 3.12 here: the wheels' own imports are not checked" >&2
    fi

    step "with .venv's Python, only the GPU machine's modules and .whl's"
    local venv_py=${PYTHON:-$repo/.venv/bin/python}
    mkdir -p "$tmp/guard"
    cat >"$tmp/guard/sitecustomize.py" <<EOF
import atexit, os, sys
_ALLOWED = set("""$DEVICE_MODULES $WHEEL_MODULES agent bench orchestrator tests conftest faults""".split())
_ALLOWED |= set(sys.stdlib_module_names)
_REFUSED = set()


class _OnlyTheGpuMachines:
    """One of the import system's finders, finding nothing outside the GPU machine's modules."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in _ALLOWED or top.startswith(("_", "test_")):
            return self.inner.find_spec(name, path, target)
        _REFUSED.add(top)
        return None

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


sys.meta_path[:] = [_OnlyTheGpuMachines(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]


@atexit.register
def _report():
    if _REFUSED:
        with open(os.path.join("$tmp", "refused"), "a") as f:
            f.write(" ".join(sorted(_REFUSED)) + "\n")
EOF
    local guard="$repo:$tmp/guard"
    PYTHONPATH="$guard" "$venv_py" - "$tmp/ckpt" <<'EOF' || status=1
import sys, torch
from torch import nn
from agent.checkpoint import Checkpointer
model = nn.Linear(8, 8)
optim = torch.optim.Adam(model.parameters())
model(torch.randn(2, 8)).sum().backward()
optim.step()
for async_save in (False, True):
    uri = f"file://{sys.argv[1]}/{'async' if async_save else 'sync'}"
    ck = Checkpointer(uri, every_steps=1, keep=1, async_save=async_save, release_staging=async_save)
    ck.step(1, {"model": model, "optim": optim})
    ck.wait()
    ck.close()
    reader = Checkpointer(uri, keep=1)
    assert reader.restore({"model": model, "optim": optim}) == 1
    reader.close()
print("agent.checkpoint imports, saves (sync and async) and restores with only those modules")
EOF
    # The bench at its smallest, its results in $tmp/bench (not the developer's bench/out/).
    PYTHONPATH="$guard" "$venv_py" - "$tmp" >"$tmp/bench.log" 2>&1 <<'EOF' || { status=1; tail -20 "$tmp/bench.log"; }
import sys
from pathlib import Path
import bench._common, bench.checkpoint
bench._common.OUT_DIR = bench.checkpoint.OUT_DIR = Path(sys.argv[1]) / "bench"
args = ["--sizes", "0.01", "--backends", "file", "--repeat", "1", "--no-warm-up", "--scratch", sys.argv[1] + "/scratch"]
sys.exit(bench.checkpoint.main(args))
EOF
    head -1 "$tmp/bench/checkpoint-latest.md" 2>/dev/null && echo "bench.checkpoint (cpu, smallest) ran"
    PYTHONPATH="$guard" "$venv_py" -m pytest -p no:cacheprovider -o addopts= -rs -q tests/gpu || status=1
    if PYTHONPATH="$guard" "$venv_py" -m bench.checkpoint --device cuda --backends file 2>"$tmp/err"; then
        echo "gpu-check: bench.checkpoint --device cuda ran without a GPU" >&2
        status=1
    else
        grep -- "--device cuda:" "$tmp/err" || status=1
    fi
    if [ -s "$tmp/refused" ]; then
        echo "modules refused on the way (their importers went on without them): $(tr ' ' '\n' <"$tmp/refused" | sort -u | tr '\n' ' ')"
    fi
    step "dry run done: status $status"
    return $status
}

if [ $dry = 1 ]; then
    dry_run 2>&1 | tee "$out/gpu-check-dry-run.log"
else
    real_run 2>&1 | tee "$out/gpu-check.log"
fi
