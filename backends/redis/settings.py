"""The ``redis`` tier's settings: the server or cluster, the key prefix, the client's
timeouts and the credentials, validated without torch or the redis client (so that
``kvoffload config validate`` and the config's loading stay light).

Secrets: ``password`` and ``username`` are :class:`~pydantic.SecretStr`, so they
appear in no repr, log or validation error; credentials written into ``url`` are
moved out of it when the config is validated, for the same reason.
"""

from __future__ import annotations

import re
from typing import Any, Final, Literal
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from pydantic import ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator

from kvoffload.tierconfig import Bytes, Compression, TierConfig, check_compression

_PREFIX_RE: Final = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
NODE_RE: Final = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d{1,5})$")
MASK: Final = "***"


class _Hidden:
    """Stands in for a secret of the wrong type in a validation error."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def __repr__(self) -> str:
        return f"<hidden {self.kind}: quote it in YAML>"


class RedisTierConfig(TierConfig):
    """A tier on a Redis server (``url``) or Redis Cluster (``nodes``), shared by every
    engine that names the same server, prefix and layout."""

    # Validation errors must never echo a password: pydantic would print each field's
    # input, and an error in any field of a tier would show the whole mapping.
    model_config = ConfigDict(hide_input_in_errors=True)

    backend: Literal["redis"] = "redis"
    """Selects the Redis backend."""
    capacity: Bytes = 1024**3
    """Upper bound the client assumes on what it has stored (value bytes, headers
    included), kept because every tier's manager allocates against one. The server's
    ``maxmemory`` decides what actually stays: it evicts, not this client."""
    url: str | None = None
    """A standalone server, ``redis://host:6379/0`` or ``rediss://...`` for TLS; query
    options go to redis-py (e.g. ``?ssl_ca_certs=/etc/ca.pem``). Credentials written
    here are moved to ``username``/``password`` (never logged)."""
    nodes: list[str] | None = None
    """A cluster instead: some of its masters as ``host:port``; the rest are found."""
    key_prefix: str = "kvo"
    """First part of every key (1-64 letters, digits, ``_.-``): separates deployments
    sharing one server, and lets an operator find or flush this tier's keys."""
    compression: Compression = "none"
    """Lossless compression of each value (see the disk tiers' ``compression``): the
    server then holds more blocks in the same ``maxmemory``, and each load and store
    moves fewer bytes over the network. Checksums cover the stored bytes."""

    _compression = field_validator("compression")(check_compression)
    ttl_s: int | None = Field(default=None, gt=0)
    """Expire each block this many seconds after its last store; ``null``: only the
    server's eviction removes blocks."""
    max_connections: int = Field(default=16, ge=1, le=1024)
    """Connections per server (per cluster node); a batch waits for a free one up to
    ``socket_timeout_ms``."""
    socket_timeout_ms: float = Field(default=2000.0, gt=0)
    """Longest wait for the server to accept or answer a piece of a batch; past it the
    batch fails (a miss or a failed store), so a slow server costs at most this."""
    connect_timeout_ms: float = Field(default=1000.0, gt=0)
    """Longest wait for a connection to open; a server that is down fails this fast."""
    username: SecretStr | None = None
    """ACL user (Redis 6+); ``null``: the default user."""
    password: SecretStr | None = None
    """AUTH password; never logged, printed or put in an error message."""

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_url(cls, data: Any) -> Any:
        """Move credentials out of ``url`` into the secret fields, so the url (logged,
        printed, quoted in errors) never carries a secret (:func:`_move_credentials`)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for field in ("username", "password"):
            value = data.get(field)
            if value is not None and not isinstance(value, str | SecretStr):
                # Fails validation as it should, but names only the type: pydantic puts
                # a field's input in its error, and YAML reads ``password: 1234`` as a
                # number.
                data[field] = _Hidden(type(value).__name__)
        if isinstance(data.get("url"), str):
            data["url"] = _move_credentials(data["url"], data)
        return data

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str | None, info: ValidationInfo) -> str | None:
        if url is None:
            return None
        tier = info.data.get("name", "?")
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(
                f"tier {tier!r}: url must start with redis:// (or rediss:// for TLS), "
                f"e.g. redis://host:6379/0; got scheme {parts.scheme!r}"
            )
        if "@" in parts.netloc:
            raise ValueError(
                f"tier {tier!r}: url carries credentials and username/password are set "
                "too; keep only the username and password fields (never logged)"
            )
        try:
            port = parts.port
        except ValueError:
            port = -1
        if not parts.hostname or port == -1:
            raise ValueError(
                f"tier {tier!r}: url {url!r} names no valid host[:port]; e.g. redis://host:6379/0"
            )
        return url

    @field_validator("nodes")
    @classmethod
    def _check_nodes(cls, nodes: list[str] | None, info: ValidationInfo) -> list[str] | None:
        """Also checks that exactly one of url and nodes is given: here, as an error
        of one field, rather than in a model validator, whose error would carry the
        whole tier mapping, password included, as its input."""
        tier = info.data.get("name", "?")
        if "url" in info.data and (info.data["url"] is None) == (nodes is None):
            got = "neither" if nodes is None else "both"
            raise ValueError(
                f"tier {tier!r}: give exactly one of url (a standalone server, e.g. "
                "redis://host:6379/0) or nodes (a cluster's masters, e.g. "
                f"[host1:7000, host2:7000]); got {got}"
            )
        if nodes is None:
            return None
        if not nodes:
            raise ValueError(
                f"tier {tier!r}: nodes is empty; list at least one cluster master as "
                "host:port, e.g. [10.0.0.1:7000]"
            )
        for node in nodes:
            m = NODE_RE.match(node)
            if m is None or not 0 < int(m["port"]) < 65536:
                raise ValueError(
                    f"tier {tier!r}: nodes entry {node!r} is not host:port with a port "
                    "1..65535, e.g. 10.0.0.1:7000 or [::1]:7000"
                )
        return nodes

    @field_validator("key_prefix")
    @classmethod
    def _check_prefix(cls, prefix: str, info: ValidationInfo) -> str:
        if not _PREFIX_RE.match(prefix):
            raise ValueError(
                f"tier {info.data.get('name', '?')!r}: key_prefix = {prefix!r}: use 1-64 "
                "letters, digits or _.- (':' separates the parts of a key, and braces "
                "would pin every key to one cluster slot)"
            )
        return prefix

    def where(self) -> str:
        """The server(s), for logs, errors and ``kvoffload inspect``: the url (which
        carries no credentials, see above; a query option named like a secret, such
        as ``ssl_password``, is masked too) or the cluster's startup nodes."""
        if self.url is not None:
            return _mask_options(self.url)
        return f"cluster {','.join(self.nodes or [])}"


_SECRET_OPTION: Final = re.compile(r"pass|secret|token", re.IGNORECASE)
"""Url query options whose values :meth:`RedisTierConfig.where` masks."""


def _mask_options(url: str) -> str:
    head, sep, query = url.partition("?")
    if not sep:
        return url
    options = [
        (name, MASK if _SECRET_OPTION.search(name) else value)
        for name, value in parse_qsl(query, keep_blank_values=True)
    ]
    return f"{head}?{urlencode(options, safe='*')}"


def _move_credentials(url: str, fields: dict[str, Any]) -> str:
    """``url`` without its credentials (``user:password@`` or ``?password=``), which go
    into ``fields`` where those are unset; where they are set too, a masked ``***@``
    is left for the url's validator to reject. The userinfo ends at the url's last
    ``@``, so that a password with an unescaped ``/``, ``?`` or ``@`` is still found
    and never left in the url."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, rest = rest.rpartition("@")
    where, _, query = rest.partition("?")
    found: list[tuple[str, str]] = []
    if at:
        user, colon, password = userinfo.partition(":")
        found += [("username", unquote(user)), ("password", unquote(password) if colon else "")]
    options = []
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name in ("username", "password"):
            found.append((name, value))
        else:
            options.append((name, value))
    clash = False
    for name, value in found:
        if not value:
            continue
        if fields.get(name) is None:
            fields[name] = value
        else:
            clash = True
    masked = f"{MASK}@" if clash else ""
    tail = f"?{urlencode(options)}" if options else ""
    return f"{scheme}://{masked}{where}{tail}"


SETTINGS = RedisTierConfig
"""This tier's settings model: the config validates a tier naming it with this."""
