"""The other agents on this machine that hear the same Azure scheduled events.

An Azure event is the VM's, and acknowledging it lets Azure act on the whole VM at once. Two jobs
on one VM (two agents on a shared machine, a job and an eval job) both flush for it, and the one
that finishes first must not acknowledge while the other is still flushing.

Each Azure source registers here while it listens: a file ``<pid>-<start ticks>`` in a folder of
this user's temp folder named after the metadata URL (``spotjob-azure-<uid>/<url hash>/``), with
one line per event whose flush it has finished. An event is acknowledged only when every other
registered agent that still runs has finished it too: the last agent to finish acknowledges (two
that finish together may both; Azure takes a repeated acknowledgement). A file whose process is gone
counts for nothing and is removed. Agents of other users, or in another container (a pod of its
own on a Kubernetes node), are not seen: README, "Known limits".
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile

from agent.crc32c import crc32c_bytes, to_hex
from agent.process_tree import read_proc

log = logging.getLogger(__name__)


def private_folder(cloud: str, base_url: str, lacking: str) -> str | None:
    """``spotjob-<cloud>-<uid>/`` of this user's temp folder, made 0700 (with ``<url hash>/`` in it
    for ``base_url``, the metadata server's, when that is not empty); None if it cannot be made or
    is not this user's alone, after a warning that ends with ``lacking``: what goes without it."""
    top = os.path.join(tempfile.gettempdir(), f"spotjob-{cloud}-{os.getuid()}")
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(top, 0o700)
        info = os.lstat(top)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            log.warning("%s is not a private folder of this user: %s", top, lacking)
            return None
        if not base_url:
            return top
        path = os.path.join(top, url_key(base_url))
        os.makedirs(path, exist_ok=True)
        return path
    except OSError as e:
        log.warning("cannot keep %s (%s): %s", top, e, lacking)
        return None


def url_key(base_url: str) -> str:
    """A metadata URL as a file name: agents that ask one server (one machine's) share its files."""
    return to_hex(crc32c_bytes(base_url.encode()))


def _folder(base_url: str) -> str | None:
    """This user's folder of agents listening to ``base_url``; None if there is none (then nothing
    is coordinated)."""
    return private_folder("azure", base_url, "Azure acknowledgements are not coordinated with other jobs")


class SharedVm:
    """This agent's entry in the register of agents hearing one metadata URL's events."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._path: str | None = None
        self._finished: set[str] = set()

    def join(self) -> None:
        folder = _folder(self.base_url)
        me = read_proc(os.getpid())
        if folder is None or me is None:
            return
        path = os.path.join(folder, f"{os.getpid()}-{me.start_ticks}")
        try:
            with open(path, "w"):
                pass
        except OSError as e:
            log.warning("cannot register in %s (%s): Azure acknowledgements are not coordinated", folder, e)
            return
        self._path = path

    def finished(self, event_id: str) -> None:
        """This agent's flush for ``event_id`` has ended."""
        if self._path is None or event_id in self._finished:
            return
        self._finished.add(event_id)
        with contextlib.suppress(OSError), open(self._path, "a") as f:
            f.write(event_id.replace("\n", " ") + "\n")

    def unfinished(self, event_id: str) -> list[int]:
        """The pids of the other agents still running here that have not finished ``event_id``."""
        if self._path is None:
            return []
        folder = os.path.dirname(self._path)
        try:
            names = os.listdir(folder)
        except OSError:
            return []
        out = []
        for name in names:
            path = os.path.join(folder, name)
            if path == self._path:
                continue
            pid, _, ticks = name.partition("-")
            info = read_proc(int(pid)) if pid.isdigit() else None
            if info is None or str(info.start_ticks) != ticks or info.state == "Z":
                with contextlib.suppress(OSError):
                    os.unlink(path)  # its agent is gone
                continue
            try:
                with open(path) as f:
                    done = set(f.read().splitlines())
            except OSError:
                continue  # unregistered meanwhile
            if event_id not in done:
                out.append(int(pid))
        return sorted(out)

    def leave(self) -> None:
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            self._path = None
