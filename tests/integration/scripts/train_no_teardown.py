"""examples/train.py, unchanged, left without the interpreter's teardown once it returned 0
(``ckpt_state.exit_without_teardown``): for the tests that only read what it logged and dumped,
and run it under torchrun many times. Its exit code, a failure's included, is otherwise its own.

    torchrun ... tests/integration/scripts/train_no_teardown.py --steps 24 --uri U ...
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from ckpt_state import exit_without_teardown

TRAIN = Path(__file__).resolve().parents[3] / "examples" / "train.py"

if __name__ == "__main__":
    sys.argv[0] = str(TRAIN)
    try:
        runpy.run_path(str(TRAIN), run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    exit_without_teardown()
