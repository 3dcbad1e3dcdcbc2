"""``spotjob`` and ``spotjob-agent`` invocations, each a process of its own forked from this one,
which has imported what the two commands import and done nothing else: a table of bad invocations
pays for those imports once instead of once per row (about half a CPU-second each).

Reads one JSON request per line on stdin and answers one JSON line on stdout when the child has
exited: ``{"tool", "path", "argv", "cwd", "env", "out", "err", "timeout"}`` in, ``[exit status,
hung]`` out (a child still running after ``timeout`` seconds is killed, and ``hung`` is true). The
child
runs as the console script does (``sys.argv`` the script's path and the arguments,
``sys.exit(main())``, the interpreter's own handling of ``SystemExit`` and of an exception no one
caught, its exit handlers run) in ``cwd`` with exactly ``env``, stdin from /dev/null, its stdout
and stderr into the files ``out`` and ``err``.

    python cli_fork.py   # then: {"tool": "spotjob", "argv": ["status"], ...}
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

import agent.launcher
import orchestrator.cli
import orchestrator.cli_run  # imported by `spotjob run` when it runs: most of the table's rows
import orchestrator.cli_status  # imported by `spotjob status` when it runs

ENTRIES: dict[str, Callable[[], Any]] = {"spotjob": orchestrator.cli.main, "spotjob-agent": agent.launcher.cli}


def child(request: dict[str, Any]) -> int:
    """The request's command, as its console script would run it; its exit status."""
    entry = ENTRIES[request["tool"]]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = [request["path"], *request["argv"]]
    try:
        sys.exit(entry())
    except SystemExit as e:  # as the interpreter ends on it
        if e.code is None:
            status = 0
        elif isinstance(e.code, int):
            status = e.code
        else:
            print(e.code, file=sys.stderr)
            status = 1
    except BaseException:  # as the interpreter reports an exception no one caught
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # as the interpreter: a flush failing at exit
            status = 120
    return status & 0xFF


def main() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                status = child(request)
            except BaseException:  # the request could not be set up: said on the child's stderr
                traceback.print_exc()
            finally:
                os._exit(status)
        hung: list[bool] = []

        def kill(signum: int, frame: object, pid: int = pid, hung: list[bool] = hung) -> None:
            hung.append(True)
            os.kill(pid, signal.SIGKILL)

        signal.signal(signal.SIGALRM, kill)
        signal.alarm(int(request["timeout"]))
        _, wait_status = os.waitpid(pid, 0)
        signal.alarm(0)
        print(json.dumps([os.waitstatus_to_exitcode(wait_status), bool(hung)]), flush=True)


if __name__ == "__main__":
    main()
