"""Human-readable byte sizes ("512MiB", "4GiB", "1.5GB", 4096) for config fields.

pydantic's :class:`~pydantic.ByteSize` does the parsing. This module decides which
spellings a size may have, fewer than pydantic takes (no bits, no PB or EB, no
``".5"``, nothing after the unit), hands pydantic each in one spelling whose meaning it
fixes (a bare ``k`` as ``kb``: SI, like ``KB``), and refuses the rest, and zero,
negative and fractional byte counts, in one line that says what is allowed.
"""

from __future__ import annotations

import re
from typing import Final

from pydantic import ByteSize, TypeAdapter, ValidationError

_UNITS: Final[dict[str, str]] = {
    "": "b",
    "b": "b",
    "k": "kb",
    "kb": "kb",
    "m": "mb",
    "mb": "mb",
    "g": "gb",
    "gb": "gb",
    "t": "tb",
    "tb": "tb",
    "kib": "kib",
    "mib": "mib",
    "gib": "gib",
    "tib": "tib",
}
"""Each unit a size may be written with, lower-cased -> pydantic's name for it. SI
(KB, MB, GB, TB and bare K, M, G, T) are powers of 1000, IEC (KiB, MiB, GiB, TiB)
powers of 1024."""
_SIZE_RE: Final = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_BYTE_SIZE: Final = TypeAdapter(ByteSize)

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
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"expected {SIZE_HINT}, got a fractional byte count")
        value = int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if match is None or unit is None:
            raise ValueError(f"expected {SIZE_HINT}")
        number = match.group(1)
        # pydantic truncates a fractional byte count; a size that has one is refused.
        if not (float(number) * ByteSize.byte_sizes[unit]).is_integer():
            raise ValueError(f"expected {SIZE_HINT}, got a fractional byte count")
        value = f"{number}{unit}"  # with its unit, even "b": the count then goes by float
    elif not isinstance(value, int):
        raise ValueError(f"expected {SIZE_HINT}, got {type(value).__name__}")
    elif value <= 0:  # pydantic's own error for a negative count would name no units
        raise ValueError(f"expected {SIZE_HINT}; sizes must be greater than zero")
    try:
        nbytes = int(_BYTE_SIZE.validate_python(value))
    except ValidationError:  # a spelling above that pydantic does not read as we do
        raise ValueError(f"expected {SIZE_HINT}") from None
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
