"""One writer process per tier directory, enforced with ``flock``.

Two processes writing one tier would each keep their own books (which slot holds
which key) and overwrite each other's blocks. The lock lives on ``DIR/LOCK`` and dies
with the process, ``kill -9`` included, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvoffload.exceptions import ConfigError


def lock_tier_dir(path: Path, tier: str, *, alternative: str = "") -> int:
    """Create ``path`` if needed and take its writer lock; return the lock's fd.

    Raises :class:`ConfigError` naming the tier and path when the directory cannot be
    used or another process holds it. ``alternative`` is appended to the fix offered.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"tier {tier!r}: path = {str(path)!r}: cannot use directory: "
            f"{exc.strerror or exc}; point tiers[].path at a writable directory"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"tier {tier!r}: path = {str(path)!r} is in use by another writer process; "
            f"give each writer its own tiers[].path{alternative}"
        ) from None
    return fd
