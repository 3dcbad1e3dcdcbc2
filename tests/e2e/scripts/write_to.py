"""A training script that fails the way a full or read-only disk makes one fail: it writes
``--bytes`` bytes to ``PATH`` (``/dev/full`` answers every write with ENOSPC) and flushes."""

from __future__ import annotations

import argparse


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("path")
    p.add_argument("--bytes", type=int, default=1 << 20)
    args = p.parse_args()
    with open(args.path, "wb") as f:
        f.write(b"\0" * args.bytes)
        f.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
