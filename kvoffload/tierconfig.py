"""The settings every tier shares, below the config and the backends' own settings.

A built-in tier's settings model lives in its package (``kvoffload.backends.<tier>.
settings``) and subclasses :class:`TierConfig` (the persistent tiers
:class:`DiskTierConfig`) from here; :mod:`kvoffload.config` puts them together. This
module imports neither torch nor any backend, so validating a config stays light.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic.json_schema import WithJsonSchema

# Re-exported: the codec names, declared once beside the codecs (CODECS).
from kvoffload.codec import Compression as Compression
from kvoffload.codec import require_blosc2
from kvoffload.sizes import SIZE_HINT, parse_size

Bytes = Annotated[
    int,
    BeforeValidator(parse_size),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "exclusiveMinimum": 0},
                # The units of parse_size, case-insensitively (JSON Schema has no flags).
                {
                    "type": "string",
                    "pattern": r"^\s*\d+(\.\d+)?\s*([KkMmGgTt]([Ii]?[Bb])?|[Bb])?\s*$",
                },
            ],
            "description": SIZE_HINT,
        }
    ),
]
"""A byte count; accepts ints and strings like ``"512MiB"`` (parsed by pydantic's
``ByteSize``, through :func:`~kvoffload.sizes.parse_size`); validated as positive.
Not named ``ByteSize``, which would hide pydantic's own."""

PolicyName = Literal["lru", "arc"]
"""The config's ``eviction``: the names of :data:`kvoffload.policies.POLICIES` (declared
here, below the config and the policies both, so neither spells them again)."""

MODEL_CONFIG: Final = ConfigDict(
    extra="forbid",
    use_attribute_docstrings=True,
    validate_default=True,
    frozen=True,
    # A ValidationError's own text (seen by whoever validates a model directly; ours
    # go through _format_errors) would quote whole tiers, secrets included.
    hide_input_in_errors=True,
)


class TierConfig(BaseModel):
    """Settings every tier has. Backends with more settings subclass this."""

    model_config = MODEL_CONFIG

    name: str = Field(default="tier", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Unique tier name, used in logs, metrics and CLI output (letters, digits, ``_.-``)."""
    backend: str = "cpu"
    """Registered backend name (entry-point group ``kvoffload.backends``)."""
    capacity: Bytes = 1024**3
    """Bytes of block data this tier may hold, e.g. ``"4GiB"``; slot headers count too."""
    write_policy: Literal["write_through", "on_evict"] = "write_through"
    """How this tier is filled from the tier above it (ignored on the first tier, which
    takes the engine's stores). ``write_through``: a copy is queued as soon as the
    block is stored above, so it survives the upper tier's loss. ``on_evict``: the block
    is copied down only when the tier above evicts it, which writes less."""
    admit_after_hits: int = Field(default=0, ge=0)
    """Admission filter: copy a block into this tier only once it has been loaded this
    many times (``0``: admit every block). Protects an SSD from one-shot blocks."""
    max_pending_stores: int = Field(default=8, ge=1, le=4096)
    """Backpressure: store jobs into this tier queued or running at once. A store that
    finds the queue full is dropped and counted; the caller never waits."""
    max_store_delay_ms: float | None = Field(default=None, gt=0)
    """Backpressure by latency: drop new stores while the queued jobs would take longer
    than this to drain (queue depth x recent job time). ``null``: queue depth only."""
    write_throttle: Bytes | None = None
    """Test knob: cap this tier's write rate at this many bytes per second (sleeping
    after each write), to simulate a slow disk. ``null``: full speed."""
    breaker_errors: int = Field(default=5, ge=0)
    """Circuit breaker: after this many failed reads or writes in a row, bypass the
    tier for ``breaker_backoff_ms`` (no stores into it, no loads from it: misses),
    then try it again; one success closes the breaker. ``0``: never bypass. A failing
    disk then costs a few errors per back-off instead of an error per batch."""
    breaker_backoff_ms: float = Field(default=5000.0, gt=0)
    """How long a tripped breaker bypasses the tier before the next try."""


def check_compression(name: str) -> str:
    """A codec other than ``none`` needs blosc2, which is optional: refuse it at load
    time, not at the first store."""
    require_blosc2("compression", name)
    return name


class DiskTierConfig(TierConfig):
    """Settings shared by the persistent tiers."""

    path: str = Field(min_length=1)
    """Directory holding the tier's files; created if missing. Required: a default would
    put the tier wherever the engine happens to start, and two tiers that both left it
    out would share it. Relative paths are taken from the current directory. One writer
    process per directory, and no tier's directory inside another's."""
    compression: Compression = "none"
    """Lossless compression of each block as stored: ``none``, ``lz4`` (faster) or
    ``zstd`` (smaller); blosc2 with a shuffle by the cache dtype's size
    (``pip install 'kvoffload[compress]'``). Checksums cover the stored bytes. A
    block that does not shrink is stored raw. Changing it keeps the tier's blocks
    readable. On ``mmap`` a compressed block uses the front of its slot (less I/O, the
    same slot count); on ``lmdb`` it takes only its compressed size on disk."""

    _compression = field_validator("compression")(check_compression)
    fsync: bool = True
    """``true``: flush to the device after every store batch, so a block whose store
    completed survives power loss. ``false``: completed stores survive a process crash
    (``kill -9``); a power cut may lose recent ones. The checksums keep a torn payload
    from ever being served either way, but with ``false`` an LMDB environment itself
    may be damaged by a power cut (LMDB's own caveat for unsynced writes)."""
