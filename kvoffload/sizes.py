"""Human-readable byte sizes ("512MiB", "4GiB", "1.5GB", 4096) for config fields."""

from __future__ import annotations

import re
from typing import Final

_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

SIZE_HINT: Final = "a positive size such as '512MiB', '4GiB', '1.5GB' or a byte count"


def parse_size(value: object) -> int:
    """Return ``value`` in bytes; raise ``ValueError`` naming what is allowed.

    Integers are byte counts. Strings take IEC (KiB, MiB, GiB, TiB: powers of 1024)
    or SI (KB, MB, GB, TB: powers of 1000) suffixes, case-insensitively. Zero,
    negative and fractional-byte results are rejected: a tier of zero bytes is a
    configuration mistake, not a way to disable it.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected {SIZE_HINT}, got a boolean")
    if isinstance(value, int):
        nbytes = value
    elif isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected {SIZE_HINT}, got a fractional byte count")
        nbytes = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"expected {SIZE_HINT}")
        scaled = float(match.group(1)) * _UNITS[unit]
        if not scaled.is_integer():
            raise ValueError(f"expected {SIZE_HINT}, got a fractional byte count")
        nbytes = int(scaled)
    else:
        raise ValueError(f"expected {SIZE_HINT}, got {type(value).__name__}")
    if nbytes <= 0:
        raise ValueError(f"expected {SIZE_HINT}; sizes must be greater than zero")
    return nbytes


def format_size(nbytes: float) -> str:
    """Format a byte count with IEC units, for tables and log lines."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
