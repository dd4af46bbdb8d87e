"""What every ``kvoffload`` subcommand shares: its exit codes, its one-line errors
(:func:`usage`, raised before any tier is opened), the checks of output paths and
positive numbers, and the ``--json`` writer."""

from __future__ import annotations

import json
from pathlib import Path

from kvoffload.exceptions import KVOffloadError

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def one_line(text: str) -> str:
    """``text`` with every unprintable character escaped (``\\n``, ``\\x1b``, ...): a
    file name or argument holding a newline cannot split the error line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def check_output(flag: str, path: Path | None) -> None:
    """Refuse an output path that cannot be a file before any work starts, not after a
    run of minutes: an existing directory, or one whose nearest existing ancestor is
    not a directory."""
    if path is None:
        return
    try:
        if path.is_dir():
            raise usage(f"{flag} {path}: is a directory; give the path of a file")
        parent = next((d for d in path.parents if d.exists()), None)
    except OSError as exc:
        raise usage(f"{flag} {path}: cannot be written: {exc.strerror or exc}") from None
    if parent is not None and not parent.is_dir():
        raise usage(f"{flag} {path}: {parent} is not a directory; give the path of a file")


def check_positive(flag: str, value: float | None) -> None:
    """Refuse a given ``flag`` value that is not above zero (``None``: not given)."""
    if value is not None and not value > 0:  # NaN too: it is not > 0
        raise usage(f"{flag} = {value}: it must be greater than zero")


def dump(path: Path | None, data: object) -> None:
    """Write ``data`` as the ``--json`` document at ``path`` (``None``: not asked for)."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


def usage(message: str) -> KVOffloadError:
    """The error of a bad argument, for the caller to raise: :func:`~kvoffload.tools.cli.main`
    prints it as one line and exits :data:`EXIT_USAGE`."""
    return KVOffloadError(message)
