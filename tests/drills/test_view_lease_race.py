"""The drill for engines' own read leases (``kvtier.store.client.view_leases``): eviction and
deletes racing the pins, with real processes. A store process with a small pool; a writer
process that keeps filling it past its size and deletes as it goes (so the store evicts and
unlinks all the time); this process leasing hits from the shared view, copying their bytes out
of the pool and releasing. Every copy made under a lease released OK must hold the chunk's
own bytes: a pin the store did not honour shows as another chunk's bytes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.api.types import LeaseStatus
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.client.shm import SHM_DIR

from support.helpers import start_store_process

CHUNK = 64 << 10
POOL_CHUNKS = 96
UNIVERSE = 4 * POOL_CHUNKS  # keys the writer cycles through: a quarter is in the pool
NS = Namespace(
    model="race", dtype="uint8", num_layers=1, num_kv_heads=1, head_size=CHUNK, chunk_tokens=1
)
SECONDS = 4.0

WRITER = textwrap.dedent(
    """
    import random, sys, time
    import numpy as np
    from kvtier.core.keys import Namespace, prompt_keys
    from kvtier.store.client.grpc import GrpcStoreClient
    from kvtier.tiers.cpu import CpuTier

    address, ns_json, chunk, universe, seconds = sys.argv[1:6]
    chunk, universe, seconds = int(chunk), int(universe), float(seconds)
    ns = Namespace.model_validate_json(ns_json)
    keys = prompt_keys(ns, np.arange(universe, dtype=np.uint32))
    rng = random.Random(7)
    with CpuTier(GrpcStoreClient(address)) as tier:
        ns_id = tier.register_namespace(ns, chunk)
        print("ready", flush=True)
        end, at = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            batch = keys[at : at + 8]
            at = (at + 8) % universe
            with tier.allocate(ns_id, batch, chunk) as lease:
                for i in lease.allocated:
                    lease.write(i, np.resize(np.frombuffer(batch[i], np.uint8), chunk))
            if rng.random() < 0.3:  # and deletes: chunks unlinked while engines may pin them
                start = rng.randrange(universe - 4)
                tier.store.delete(ns_id, keys[start : start + 4])
    print("done", flush=True)
    """
)


def test_eviction_and_deletes_racing_engine_pins_never_tear_a_copy(run_dir: Path) -> None:
    store = start_store_process(
        run_dir, str(POOL_CHUNKS * CHUNK), env={"KVTIER_STORE__POOL__EVICTION": "lru"}
    )
    client = GrpcStoreClient(store.address)
    writer = None
    try:
        ns_id = client.register_namespace(NS, CHUNK)
        info = client.info()
        pool = np.memmap(SHM_DIR / info.segment_name, dtype=np.uint8, mode="r")
        keys = prompt_keys(NS, np.arange(UNIVERSE, dtype=np.uint32))
        writer = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                store.address,
                NS.model_dump_json(),
                str(CHUNK),
                str(UNIVERSE),
                str(SECONDS),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        rng = np.random.default_rng(3)
        copied = torn = expired = 0
        end = time.monotonic() + SECONDS
        while time.monotonic() < end:
            start = int(rng.integers(0, UNIVERSE - 4))
            got = client.lookup(ns_id, keys[start : start + 4], 30.0)
            # the copy comes a step later, as a load does: about half the pool turns over
            # meanwhile, so the store evicts and reuses pages of what was just leased
            time.sleep(float(rng.uniform(0, 0.02)))
            copies = [b"".join(bytes(pool[o : o + n]) for o, n in h.extents) for h in got.hits]
            if got.lease_id:
                status = client.release([got.lease_id])[0]
                if status is not LeaseStatus.OK:
                    expired += 1
                    continue
            for hit, copy in zip(got.hits, copies, strict=True):
                copied += 1
                torn += copy != hit.key * (CHUNK // len(hit.key))
        assert writer.wait(30) == 0
        stats = client.stats()
        # the race happened: the store evicted and deleted under leases engines took themselves
        assert client.view_hits > 50 and copied > 50
        assert stats["evictions"] > 0 and stats["deletes"] > 0 and stats["view_hit_chunks"] > 0
        assert (torn, expired) == (0, 0)
        del pool
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
            writer.wait()
        client.close()
        store.stop()
