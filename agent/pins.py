"""Pins: a reader's lease on the checkpoint it reads, which the writer's retention leaves alone.

A reader (a read-only Checkpointer's restore, ``spotjob ckpt export``) writes one empty object,
``<uri>/.spotjob/pins/<folder>_<expiry>_<reader id>``, before it reads a checkpoint folder, and
deletes it when the read ends. Everything retention needs is in the name, so a retention pass
pays one listing of ``.spotjob/pins/`` for all pins and reads none. While the read goes on, a
thread renews the pin every ``PIN_SECONDS / 3``: it writes the name with a later expiry, then
deletes the old one (one of them is always there). A pin whose expiry has passed (a crashed
reader's) is ignored by retention and deleted by it.

Clocks: the writer dates a pin by the store's own time (S3's LastModified, GCS's ``updated``, a
file's mtime, which every listing carries): a pin holds ``PIN_SECONDS`` plus
``CLOCK_MARGIN_SECONDS`` after the store wrote it, compared with the store's time of the manifest
the writer has just committed. Neither the reader's clock nor the writer's enters, so a reader
whose clock is minutes off is pinned as long as any. Where the store gives no time (a ``Storage``
that does not say), the expiry in the name (the reader's clock plus ``PIN_SECONDS``) is compared
with the writer's clock less the margin: a reader whose clock is behind the writer's by more than
the margin loses its pin early, and a pin due more than ``PIN_SECONDS`` plus the margin after the
writer's now is not honoured (and is removed). Either way no pin, however its name was written,
keeps a folder more than ``PIN_SECONDS`` plus the margin once its reader stops renewing. No torch
import.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from agent._layout import CONTROL_FOLDER
from agent.storage.base import PermanentStorageError, Storage, StorageError

log = logging.getLogger(__name__)

PINS_PREFIX = f"{CONTROL_FOLDER}/pins/"
PIN_SECONDS = 300.0
"""How long a pin holds without being renewed (renewed every third of it while the read goes on)."""
CLOCK_MARGIN_SECONDS = 60.0
"""Slack on a pin's lifetime: the store's timestamps' resolution, or (where the store gives no time)
how far the writer's clock may be ahead of a reader's before that reader's pins expire early."""

_NAME_RE = re.compile(r"^(step-\d+(?:\.\d+)?)_(\d+)_([0-9a-f]+)$")


def _pin_key(folder: str, expires: float, reader: str) -> str:
    return f"{PINS_PREFIX}{folder}_{int(expires)}_{reader}"


def pinned_folders(
    storage: Storage, *, now: float | None = None, stamp: str | None = None
) -> tuple[set[str], list[str]]:
    """(folders with an unexpired pin, keys of expired pins): one listing of ``.spotjob/pins/``.

    ``stamp``: the key of an object the caller has just written (the manifest it committed). When
    the store dates it and every pin (``ObjectInfo.modified``), a pin's age is the store's own time
    (one stat, only when there are pins): no clock of a reader or of the writer enters. Otherwise
    the expiry in a pin's name is compared with ``now`` (the writer's clock) less the margin.
    """
    now = time.time() if now is None else now
    found: list[tuple[str, str, int, float | None]] = []  # (key, folder, expiry named, store time)
    for info in storage.list(PINS_PREFIX):
        m = _NAME_RE.match(info.key[len(PINS_PREFIX) :]) if info.key.startswith(PINS_PREFIX) else None
        if m is not None:  # anything else is not a pin this spotjob wrote: never deleted
            found.append((info.key, m.group(1), int(m.group(2)), info.modified))
    store_now: float | None = None
    if found and stamp is not None and all(modified is not None for *_, modified in found):
        stamped = storage.stat(stamp)
        if stamped is not None and stamped.modified is not None:
            # No pin is written after the store's now: the newest of them bounds it too.
            store_now = max([stamped.modified] + [modified for *_, modified in found if modified is not None])
    live: set[str] = set()
    expired: list[str] = []
    for key, folder, expires, modified in found:
        if store_now is not None and modified is not None:
            if modified + PIN_SECONDS + CLOCK_MARGIN_SECONDS > store_now:
                live.add(folder)
            else:
                expired.append(key)
        elif expires > now + PIN_SECONDS + CLOCK_MARGIN_SECONDS:
            # No reader writes a pin for longer than PIN_SECONDS: one due later (a reader's clock
            # far ahead, or a name written by hand) would keep its folder for good. Not honoured.
            expired.append(key)
        elif expires + CLOCK_MARGIN_SECONDS > now:
            live.add(folder)
        else:
            expired.append(key)
    return live, expired


class Pin:
    """One reader's pin on one folder, renewed by a daemon thread until ``release()``."""

    def __init__(self, storage: Storage, folder: str, key: str) -> None:
        self._storage = storage
        self.folder = folder
        self._keys = [key]
        """Every name this pin was written under and not yet deleted (one, but for a failed delete)."""
        self._reader = key.rsplit("_", 1)[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._renew_loop, name="spotjob-pin", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(PIN_SECONDS / 3):
            with self._lock:
                if self._stop.is_set():
                    return
                key = _pin_key(self.folder, time.time() + PIN_SECONDS, self._reader)
                try:
                    self._storage.put_bytes(key, b"")
                except StorageError as e:
                    log.warning(
                        "could not renew the pin on %s (tried again in %.0f s; a pin lapses %.0f s after the last "
                        "renewal the store took, and the job's retention may then delete the checkpoint under this "
                        "read): %s",
                        self._storage.url(self.folder),
                        PIN_SECONDS / 3,
                        PIN_SECONDS + CLOCK_MARGIN_SECONDS,
                        e,
                    )
                    continue
                if key not in self._keys:
                    self._keys.append(key)
                # The names before it, a failed delete's too: one left behind would hold the
                # folder for minutes after the read ended.
                stale = [k for k in self._keys if k != key]
                try:
                    if stale:
                        self._storage.delete(stale)
                    self._keys = [key]
                except StorageError as e:
                    log.debug("could not remove the pin's earlier name (tried again at the next renewal): %s", e)

    def release(self) -> None:
        """Stop renewing and delete the pin (a failure to delete leaves it to expire)."""
        with self._lock:
            self._stop.set()
            try:
                self._storage.delete(self._keys)
            except StorageError as e:
                log.debug("could not remove the pin %s (it expires by itself): %s", self._keys, e)
        self._thread.join()


class Pinner:
    """A reader's pins: ``pin(folder)`` moves its one pin to ``folder``; without write access to
    the URI it reads unpinned and warns once, saying why."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._reader = secrets.token_hex(8)
        self._pin: Pin | None = None
        self._refused = False

    def pin(self, folder: str) -> None:
        if self._pin is not None and self._pin.folder == folder:
            return
        self.release()
        if self._refused:
            return
        key = _pin_key(folder, time.time() + PIN_SECONDS, self._reader)
        try:
            self._storage.put_bytes(key, b"")
        except PermanentStorageError as e:
            self._refused = True
            log.warning(
                "reading %s without a pin (said once): could not write under %s (%s). The training job's "
                "retention may delete a checkpoint while it is read (a restore then starts over at the newest, an "
                "export of a named --step fails); "
                "give this reader write and delete access to that folder to pin what it reads",
                self._storage.url(folder),
                self._storage.url(PINS_PREFIX),
                e,
            )
            return
        except StorageError as e:
            log.warning("reading %s without a pin this time: %s", self._storage.url(folder), e)
            return
        self._pin = Pin(self._storage, folder, key)

    def release(self) -> None:
        if self._pin is not None:
            pin, self._pin = self._pin, None
            pin.release()


@contextmanager
def pinned(storage: Storage, folder: str) -> Iterator[None]:
    """Hold a pin on ``folder`` for the duration (unpinned, with a warning, where it cannot be written)."""
    pinner = Pinner(storage)
    pinner.pin(folder)
    try:
        yield
    finally:
        pinner.release()
