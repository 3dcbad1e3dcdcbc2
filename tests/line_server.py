"""A helper process that answers one JSON line per JSON line it reads on stdin, for tests that pay
an expensive import once and fork a child per case from it (``tests/e2e/scripts/cli_fork.py``, the
object-memory probe of ``tests/integration/test_checkpoint_object_memory.py``)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def line_server(argv: list[str], **popen: Any) -> Iterator[subprocess.Popen[str]]:
    """``argv`` started with pipes to its stdin and stdout; at the end its stdin is closed, which
    ends it, and it is killed if it has not ended within 60 s."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)
    try:
        yield proc
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ask(proc: subprocess.Popen[str], request: Any, what: str) -> Any:
    """Send ``request`` as one JSON line and return the decoded answer line; fails naming ``what``
    and its exit status if it ended instead of answering."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    answer = proc.stdout.readline()
    assert answer, f"{what} exited {proc.wait()}"
    return json.loads(answer)
