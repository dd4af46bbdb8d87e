"""``kvoffload lookup``: how much of each prompt's prefix the shared (redis) tier
holds (:mod:`kvoffload.lookup`), from prompts read as JSON lines and the engines'
hashing and layout given as flags."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from kvoffload.config import load_config
from kvoffload.lookup import Prompt
from kvoffload.tools.cli_common import EXIT_OK, check_output, dump, usage

logger = logging.getLogger("kvoffload")

LOOKUP_MODEL_FLAGS = ("--model-id", "--num-layers", "--num-kv-heads", "--head-dim")
"""The model's fields ``lookup`` needs unless ``--fingerprint`` is given."""


def lookup_command(args: argparse.Namespace) -> int:
    """``kvoffload lookup``: one JSON line per prompt (its full blocks, and the blocks
    and tokens each shared tier holds of its prefix); ``--json``: that and the round
    trips."""
    from kvoffload.lookup import PrefixLookup, VllmEngineLayout, VllmHashing

    # Each value given is checked first, then what is missing or clashes, then the
    # prompts and the config are read: a bad value is named whatever else is wrong.
    check_output("--json", args.json)
    for flag in ("--block-size", *LOOKUP_MODEL_FLAGS[1:], "--tensor-parallel-size"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value <= 0:
            raise usage(f"{flag} {value}: it must be greater than zero")
    if args.model_id is not None and (not args.model_id or not args.model_id.isprintable()):
        raise usage(f"--model-id {args.model_id!r}: give the connector's model_id")
    fps = None if args.fingerprint is None else _fingerprints(args.fingerprint)
    prompts = None if args.prompts is None else _read_prompts(args.prompts)
    config = load_config(args.config)
    if prompts is None or args.block_size is None:
        raise usage(
            f"{'--prompts' if args.prompts is None else '--block-size'}: missing; "
            "give the prompts (a JSON-lines file) and the engines' block_size"
        )
    fields = {f: getattr(args, f[2:].replace("-", "_")) for f in LOOKUP_MODEL_FLAGS}
    given = [f for f, v in fields.items() if v is not None]
    fingerprints: list[bytes] | VllmEngineLayout
    if fps is not None:
        if given:
            raise usage(
                f"--fingerprint and {given[0]}: give the fingerprints or the model's "
                "fields, not both"
            )
        fingerprints = fps
    else:
        missing = [f for f, v in fields.items() if v is None]
        if missing:
            raise usage(
                f"{missing[0]}: missing; give the model's {', '.join(LOOKUP_MODEL_FLAGS)} "
                "(or --fingerprint)"
            )
        fingerprints = VllmEngineLayout(
            model_id=str(args.model_id),
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            block_size=args.block_size,
            dtype=args.dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            cache_dtype=args.cache_dtype,
            mla=args.mla,
        )
    seed = args.hash_seed if args.hash_seed is not None else os.environ.get("PYTHONHASHSEED")
    hashing = VllmHashing(args.block_size, args.hash_algo, seed)
    with PrefixLookup(config, hashing, fingerprints) as lookup:
        full = [len(lookup.hashing.block_hashes(p)) for p in prompts]
        answers = lookup.lookup(prompts)
    for i, n in enumerate(full):
        held = {a.tier: a.blocks[i] for a in answers}
        line = {
            "prompt": i,
            "full_blocks": n,
            "blocks": held,
            "tokens": {t: b * args.block_size for t, b in held.items()},
        }
        print(json.dumps(line))
    for a in answers:
        logger.info(
            "lookup: tier %s: %d prompts, %d names asked, %d round trips (new "
            "connections' handshakes included)",
            a.tier,
            len(prompts),
            a.names,
            a.round_trips,
        )
    dump(
        args.json,
        {
            "block_size": args.block_size,
            "full_blocks": full,
            "tiers": {
                a.tier: {"blocks": a.blocks, "round_trips": a.round_trips, "names": a.names}
                for a in answers
            },
        },
    )
    return EXIT_OK


def _fingerprints(text: str) -> list[bytes]:
    out = []
    for part in text.split(","):
        try:
            fp = bytes.fromhex(part.strip())
        except ValueError:
            fp = b""
        if len(fp) != 16:
            raise usage(
                f"--fingerprint {text!r}: expected 32 hex digits per rank, comma-separated "
                "(a layout's fingerprint: the hex after the key prefix in the tier's names on the "
                "server, {key_prefix}:{fingerprint}:{key})"
            )
        out.append(fp)
    return out


def _read_prompts(path: Path) -> list[Prompt]:
    """``--prompts``: JSON lines, each a list of token ids or an object of
    :class:`~kvoffload.lookup.Prompt`'s fields (``lora_name`` and ``lora_path``)."""
    where = "<stdin>" if str(path) == "-" else str(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise usage(f"--prompts {where}: cannot be read: {why}") from None
    fix = (
        "each line is a JSON list of token ids, or an object with token_ids and "
        "optional cache_salt, lora_name and lora_path"
    )
    prompts: list[Prompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except ValueError as exc:
            raise usage(f"--prompts {where}:{n}: not JSON ({exc}); {fix}") from None
        if isinstance(raw, list):
            raw = {"token_ids": raw}
        if not isinstance(raw, dict) or not set(raw) <= {
            "token_ids",
            "cache_salt",
            "lora_name",
            "lora_path",
        }:
            raise usage(f"--prompts {where}:{n}: unexpected {_short(raw)}; {fix}")
        tokens = raw.get("token_ids")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
        ):
            raise usage(
                f"--prompts {where}:{n}: token_ids = {_short(tokens)}: expected a list of "
                "non-negative integers"
            )
        extra = {k: raw.get(k) for k in ("cache_salt", "lora_name", "lora_path")}
        for key, value in extra.items():
            if value is not None and not isinstance(value, str):
                raise usage(f"--prompts {where}:{n}: {key} = {_short(value)}: expected a string")
        if (extra["lora_name"] is None) != (extra["lora_path"] is None):
            raise usage(f"--prompts {where}:{n}: give both lora_name and lora_path, or neither")
        lora = None
        if extra["lora_name"] is not None and extra["lora_path"] is not None:
            lora = (extra["lora_name"], extra["lora_path"])
        prompts.append(Prompt(tokens, extra["cache_salt"], lora))
    if not prompts:
        raise usage(f"--prompts {where}: no prompt in it; {fix}")
    return prompts


def _short(value: object, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
