"""Child-process programs for the crash and full-disk tests (run with ``python -c``
or as a script; not collected by pytest). Real processes, real files, real signals."""

from __future__ import annotations

import json
import resource
import signal
import sys
import time

import torch

from kvoffload.config import layout_from_config, load_config
from kvoffload.keys import BlockKey, chain_key
from kvoffload.tier import build_tiers
from kvoffload.tools.stress import BlockDataGenerator


def key_for(round_no: int, i: int) -> BlockKey:
    return chain_key(b"crash-round-%d" % round_no, i.to_bytes(8, "little"))


def store_forever(config_json: str, round_no: int, batch: int) -> None:
    """Store batches until killed; print ``ACK`` with the keys once ``complete_store``
    has returned, and ``EVICT`` with the keys eviction dropped, before the write."""
    config = load_config(json.loads(config_json))
    layout = layout_from_config(config)
    gen = BlockDataGenerator(layout.bytes_per_block, seed=7)
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
        for row, key in enumerate(plan.keys_to_store):
            gen.fill(key, buf[row])
        tier.backend.write(plan.slots, plan.keys_to_store, buf[: len(plan.keys_to_store)])
        tier.manager.complete_store(plan.keys_to_store)
        print("ACK", " ".join(k.hex() for k in plan.keys_to_store), flush=True)


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


if __name__ == "__main__":
    if sys.argv[1] == "store_forever":
        store_forever(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "fill_past_limit":
        fill_past_limit(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    time.sleep(0)
