"""The local backend's bearer token file is readable by its owner only, at every moment."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from orchestrator.backends.local_launch import write_token


def mode(path: str | int) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("existing", [None, 0o644, 0o666])
def test_the_token_is_never_in_a_file_anyone_but_the_owner_can_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: int | None
) -> None:
    path = tmp_path / "token"
    original_inode = None
    if existing is not None:
        path.write_text("an old token\n")
        os.chmod(path, existing)
        original_inode = os.stat(path).st_ino
    real_open, real_replace, real_rename = os.open, os.replace, os.rename
    opened: list[tuple[str, int]] = []
    renamed: list[tuple[str, str]] = []

    def checked_open(file: Any, flags: int, mode_: int = 0o777, *args: Any, **kw: Any) -> int:
        fd = real_open(file, flags, mode_, *args, **kw)
        opened.append((os.fspath(file), flags))
        if flags & (os.O_WRONLY | os.O_RDWR):
            # Whatever is about to be written here is readable by the owner only, from the start.
            assert mode(fd) == 0o600, f"{file} opened for writing with mode {oct(mode(fd))}"
        return fd

    def checked_replace(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        assert mode(src) == 0o600, f"{src} would appear at {dst} with mode {oct(mode(src))}"
        renamed.append((os.fspath(src), os.fspath(dst)))
        real_replace(src, dst, *args, **kw)

    monkeypatch.setattr(os, "open", checked_open)
    monkeypatch.setattr(os, "replace", checked_replace)
    monkeypatch.setattr(os, "rename", lambda *a, **k: checked_replace(*a, **k))
    token = write_token(str(path))
    monkeypatch.setattr(os, "open", real_open)
    monkeypatch.setattr(os, "rename", real_rename)

    assert path.read_text().strip() == token and len(token) >= 32
    assert mode(str(path)) == 0o600
    # The old file (its wider mode) never held the new token: it was replaced, not rewritten.
    assert all(name != str(path) for name, _ in opened)
    assert renamed and renamed[-1][1] == str(path)
    if original_inode is not None:
        assert os.stat(path).st_ino != original_inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"]  # no temporary file left
