"""Child-process programs for the crash, full-disk and shared-tier tests (run with
``python -c`` or as a script; not collected by pytest). Real processes, real files,
real signals."""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import time
from collections import Counter

import torch

from kvoffload.config import layout_from_config, load_config
from kvoffload.exceptions import KVOffloadError
from kvoffload.keys import BlockKey, chain_key
from kvoffload.tier import Tier, build_tiers
from kvoffload.tools.stress import BlockDataGenerator


def key_for(round_no: int, i: int) -> BlockKey:
    return chain_key(b"crash-round-%d" % round_no, i.to_bytes(8, "little"))


class MixedData:
    """Block contents for the crash test's compressed rounds: KV-like values (a codec
    shrinks them) for two keys in three, random bytes (stored raw) for the third, so
    a packed slab's extents differ in length. Same interface as the generator."""

    def __init__(self, bytes_per_block: int, seed: int) -> None:
        self.nbytes = bytes_per_block
        self.kv = BlockDataGenerator(bytes_per_block, seed, kind="kv")
        self.raw = BlockDataGenerator(bytes_per_block, seed)

    def _pick(self, key: BlockKey) -> BlockDataGenerator:
        return self.raw if key[-1] % 3 == 2 else self.kv

    def fill(self, key: BlockKey, row: torch.Tensor) -> None:
        self._pick(key).fill(key, row)

    def matches(self, key: BlockKey, row: torch.Tensor, scratch: torch.Tensor) -> bool:
        return self._pick(key).matches(key, row, scratch)


def block_data(bytes_per_block: int, data: str) -> BlockDataGenerator | MixedData:
    """The generator for ``data``: ``random`` (the default), ``kv`` or ``mixed``."""
    if data == "mixed":
        return MixedData(bytes_per_block, seed=7)
    return BlockDataGenerator(bytes_per_block, seed=7, kind=data)


def store_forever(config_json: str, round_no: int, batch: int, data: str = "random") -> None:
    """Store batches until killed; print ``ACK`` with the keys stored once
    ``complete_store`` has returned, and ``EVICT`` with the keys eviction dropped,
    before the write. As the books settle a write: where the tier answers charges (a
    packed, compressed slab) a block answered 0 found no room and fails its store (not
    acknowledged, and the next store makes room for it), and the others are charged
    what they took."""
    config = load_config(json.loads(config_json))
    layout = layout_from_config(config)
    gen = block_data(layout.bytes_per_block, data)
    (tier,) = build_tiers(config, layout)
    buf = torch.empty((batch, layout.bytes_per_block), dtype=torch.uint8)
    print("READY", flush=True)
    i = 0
    while True:
        keys = [key_for(round_no, i + j) for j in range(batch)]
        i += batch
        plan = tier.manager.prepare_store(keys)
        assert plan is not None
        if plan.evicted:
            print("EVICT", " ".join(k.hex() for k in plan.evicted), flush=True)
        new = plan.keys_to_store
        for row, key in enumerate(new):
            gen.fill(key, buf[row])
        # As a job does once it has read what it demotes (nothing here): the space of
        # victims the store does not reuse goes back to the tier before the write.
        tier.backend.released([s for s in plan.evicted_slots if s not in plan.slots])
        charges = tier.backend.write(plan.slots, new, buf[: len(new)])
        stored = new
        if charges is not None:
            stored = [k for k, c in zip(new, charges, strict=True) if c]
            unplaced = [k for k, c in zip(new, charges, strict=True) if not c]
            tier.manager.complete_store(unplaced, success=False)
            tier.manager.charge(stored, [c for c in charges if c], unplaced=len(unplaced))
        tier.manager.complete_store(stored)
        print("ACK", " ".join(k.hex() for k in stored), flush=True)


def fill_past_limit(config_json: str, limit: int, count: int) -> None:
    """Open a tier, then cap the file size (RLIMIT_FSIZE): stores whose slots lie past
    the cap fail as a full disk would. Report what failed and whether loads worked."""
    config = load_config(json.loads(config_json))
    layout = layout_from_config(config)
    gen = BlockDataGenerator(layout.bytes_per_block, seed=7)
    (tier,) = build_tiers(config, layout)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a fatal signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    ok, failed, raised = [], 0, 0
    buf = torch.empty((1, layout.bytes_per_block), dtype=torch.uint8)
    from kvoffload.exceptions import BackendError

    for i in range(count):
        key = key_for(0, i)
        plan = tier.manager.prepare_store([key])
        assert plan is not None
        gen.fill(key, buf[0])
        try:
            tier.backend.write(plan.slots, plan.keys_to_store, buf)
        except BackendError:
            tier.manager.complete_store(plan.keys_to_store, success=False)
            failed += 1
            continue
        except Exception:
            raised += 1
            continue
        tier.manager.complete_store(plan.keys_to_store)
        ok.append(key)
    # Loads of what was stored keep working, disk full or not.
    loaded = 0
    scratch = torch.empty(layout.bytes_per_block, dtype=torch.uint8)
    for key in ok:
        slots = tier.manager.prepare_load([key])
        valid = tier.backend.read(slots, [key], buf)
        tier.manager.complete_load([key])
        loaded += int(valid[0] and gen.matches(key, buf[0], scratch))
    print(json.dumps({"stored": len(ok), "failed": failed, "raised": raised, "loaded": loaded}))
    tier.close()


# -- one writer and one reader process on a shared LMDB tier (test_shared_lmdb) -------


def shared_key(round_no: int, i: int) -> BlockKey:
    return chain_key(b"shared-round-%d" % round_no, i.to_bytes(8, "little"))


class _Commands:
    """The parent's command lines on stdin, read with ``os.read`` so that a poll
    between batches never blocks and never loses what a buffered reader would hold."""

    def __init__(self) -> None:
        self._buf = b""
        self._lines: list[str] = []
        self.eof = False

    def _fill(self, timeout: float | None) -> None:
        if self.eof or not select.select([0], [], [], timeout)[0]:
            return
        chunk = os.read(0, 1 << 16)
        if not chunk:
            self.eof = True
            return
        *done, self._buf = (self._buf + chunk).split(b"\n")
        self._lines += [line.decode() for line in done]

    def ready(self) -> list[str]:
        """Every complete line there is now, without waiting."""
        self._fill(0)
        lines, self._lines = self._lines, []
        return lines

    def next(self) -> str | None:
        """The next line, waiting for it; ``None`` at end of input."""
        while not self._lines and not self.eof:
            self._fill(None)
        return self._lines.pop(0) if self._lines else None


def serve_writer(config_json: str, batch: int, pause_s: float) -> None:
    """The writer: for each ``open R`` line, open the tier (taking the directory's
    writer lock, recovering what is there), store batches of round R's keys until a
    ``close`` line comes, then close the tier. Prints ``READY``, then ``EVICT`` and
    ``ACK`` as :func:`store_forever` does, then ``CLOSED`` with the problems the
    manager's and the backend's ``check()`` found. Ends at end of input. ``pause_s``
    between batches sets how fast the tier turns over (and leaves a reader a core)."""
    config = load_config(json.loads(config_json))
    layout = layout_from_config(config)
    gen = BlockDataGenerator(layout.bytes_per_block, seed=7)
    buf = torch.empty((batch, layout.bytes_per_block), dtype=torch.uint8)
    cmds = _Commands()
    print("STARTED", flush=True)
    while (line := cmds.next()) is not None:
        cmd, _, arg = line.partition(" ")
        assert cmd == "open", line
        round_no = int(arg)
        (tier,) = build_tiers(config, layout)
        print("READY", flush=True)
        i = 0
        while not (pending := cmds.ready()):
            keys = [shared_key(round_no, i + j) for j in range(batch)]
            i += batch
            plan = tier.manager.prepare_store(keys)
            assert plan is not None
            if plan.evicted:
                print("EVICT", " ".join(k.hex() for k in plan.evicted), flush=True)
            for row, key in enumerate(plan.keys_to_store):
                gen.fill(key, buf[row])
            tier.backend.write(plan.slots, plan.keys_to_store, buf[: len(plan.keys_to_store)])
            tier.manager.complete_store(plan.keys_to_store)
            print("ACK", " ".join(k.hex() for k in plan.keys_to_store), flush=True)
            time.sleep(pause_s)
        assert pending == ["close"], pending
        problems = tier.manager.check() + tier.backend.check()
        tier.close()
        print("CLOSED", json.dumps(problems), flush=True)


def _read_checked(
    tier: Tier,
    keys: list[BlockKey],
    by_key: bool,
    gen: BlockDataGenerator,
    stats: Counter[str],
    seen: set[str],
) -> list[BlockKey]:
    """Read ``keys`` from ``tier``, checking every block served bit-exact against
    ``gen``; return the misses. ``by_key``: read straight from the backend, keys the
    manager does not know (LMDB looks records up by key; a reader's slots are its own);
    else the manager's load protocol (lookup, prepare_load, read, complete_load)."""
    buf = torch.empty((len(keys), gen.nbytes), dtype=torch.uint8)
    scratch = torch.empty(gen.nbytes, dtype=torch.uint8)
    if by_key:
        valid = tier.backend.read([0] * len(keys), keys, buf)
    else:
        keys = [k for k in keys if tier.manager.lookup([k]) == 1]
        slots = tier.manager.prepare_load(keys)
        valid = tier.backend.read(slots, keys, buf[: len(keys)])
        tier.manager.complete_load(keys)
    what = "by_key" if by_key else "managed"
    misses = []
    for row, (key, ok) in enumerate(zip(keys, valid, strict=True)):
        if not ok:
            stats[f"{what}_misses"] += 1
            misses.append(key)
            continue
        stats[f"{what}_reads"] += 1
        seen.add(key.hex())
        if not gen.matches(key, buf[row], scratch):
            stats["bit_errors"] += 1
    return misses


def serve_reader(config_json: str) -> None:
    """The reader (``readonly: true``): for each ``go R`` line, until a ``stop`` line,
    open the tier and read what its manager learnt at open twice over, newest first,
    and by key the blocks of the ``ACK`` lines the parent forwards meanwhile (stored
    after the open); then close and open again. Every block served is checked
    bit-exact. Prints ``OPENED`` after the round's first open and ``DONE`` with the
    counts and the keys read."""
    config = load_config(json.loads(config_json))
    layout = layout_from_config(config)
    gen = BlockDataGenerator(layout.bytes_per_block, seed=7)
    cmds = _Commands()
    print("STARTED", flush=True)
    while (line := cmds.next()) is not None:
        if line.startswith("ACK "):
            continue  # forwarded before the parent saw our last DONE
        assert line.startswith("go "), line
        stats: Counter[str] = Counter()
        seen: set[str] = set()
        stop = False
        while not stop:
            (tier,) = build_tiers(config, layout)
            stats["opens"] += 1
            if stats["opens"] == 1:
                print("OPENED", flush=True)
            known = [k for k, _ in tier.manager.policy.items()][::-1]
            at_open = set(known)
            for _ in range(2):
                for lo in range(0, len(known), 64):
                    tier.drop(_read_checked(tier, known[lo : lo + 64], False, gen, stats, seen))
                known = [k for k, _ in tier.manager.policy.items()][::-1]
                fresh: list[BlockKey] = []
                for cmd_line in cmds.ready():
                    if cmd_line == "stop":
                        stop = True
                    elif cmd_line.startswith("ACK "):
                        fresh += [BlockKey(bytes.fromhex(h)) for h in cmd_line.split()[1:]]
                fresh = [k for k in fresh[-64:] if k not in at_open]
                if fresh:
                    stats["by_key_probes"] += len(fresh)
                    _read_checked(tier, fresh, True, gen, stats, seen)
            stats["missing_blocks"] += tier.backend.missing_blocks
            tier.close()
        print("DONE", json.dumps({**stats, "seen": sorted(seen)}), flush=True)


def open_as(config_json: str) -> None:
    """Once a line comes on stdin, open the tier of a config and read every block it
    holds, newest first; print the counts. On a kvoffload error, print it as one line
    on stderr, as the CLI does, and exit with 2."""
    config = load_config(json.loads(config_json))
    layout = layout_from_config(config)
    sys.stdin.readline()
    try:
        (tier,) = build_tiers(config, layout)
    except KVOffloadError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    stats: Counter[str] = Counter(managed_reads=0, managed_misses=0, bit_errors=0)
    keys = [k for k, _ in tier.manager.policy.items()][::-1]  # newest first
    gen = BlockDataGenerator(layout.bytes_per_block, seed=7)
    for lo in range(0, len(keys), 64):
        _read_checked(tier, keys[lo : lo + 64], False, gen, stats, set())
    stats["missing_blocks"] = tier.backend.missing_blocks
    tier.close()
    print(json.dumps({"held": len(keys), **stats}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "store_forever":
        store_forever(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:6])
    elif sys.argv[1] == "fill_past_limit":
        fill_past_limit(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "serve_writer":
        serve_writer(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif sys.argv[1] == "serve_reader":
        serve_reader(sys.argv[2])
    elif sys.argv[1] == "open_as":
        open_as(sys.argv[2])
    time.sleep(0)
