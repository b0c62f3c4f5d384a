"""What one engine-to-store control call costs, by path, beside a raw Unix-socket floor:

    kvtier bench control [--calls 2000] [--hit-chunks 8] [--repeats 3]

One ``kvtier store serve`` process; one client process (this one). Each path is timed over
``--calls`` calls, the paths interleaved call by call within each repeat (so a slow moment of
the machine lands on every path alike), p50 and p90 per path:

- ``floor``: a raw ping-pong of the same bytes as a leased lookup's request and reply with an
  echo process on a Unix socket (the transport's cost, no store work: what no control
  protocol on this socket can beat);
- ``miss, view``: a lookup the store's shared view answers (``kvtier.store.client.view``): no
  round trip at all;
- ``miss, socket`` / ``miss, gRPC``: the same lookup asked of the store (control socket /
  gRPC over loopback TCP);
- ``hit+lease, view`` / ``hit+lease, socket`` / ``hit+lease, gRPC``: a lookup of
  ``--hit-chunks`` committed chunks that leases them (what a hit waits for): pinned by the
  engine itself in the store's lease region (``kvtier.store.client.view_leases``, no round
  trip), or asked of the store; and ``release``: giving the lease back after the load (off
  the scheduler thread, on the connector's ops thread).
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from kvtier.core.keys import Namespace, prompt_keys
from kvtier.store.client.control import HEADER
from kvtier.store.client.grpc import GrpcStoreClient
from kvtier.store.proto import store_pb2 as pb
from kvtier.testing.services import start_store

CHUNK_BYTES = 64 << 10

# an echo server for the floor, in its own process as the store is
_ECHO = """
import socket, struct, sys
H = struct.Struct("<IB")
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1]); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
reply = bytes(int(sys.argv[2]))
def exact(n):
    buf = bytearray(n); view = memoryview(buf); got = 0
    while got < n:
        k = conn.recv_into(view[got:])
        if not k: sys.exit(0)
        got += k
    return buf
while True:
    n, _ = H.unpack(exact(H.size)); exact(n)
    conn.sendall(H.pack(len(reply), 0) + reply)
"""


def _namespace() -> Namespace:
    return Namespace(
        model="bench-control",
        dtype="uint8",
        num_layers=1,
        num_kv_heads=1,
        head_size=CHUNK_BYTES,
        chunk_tokens=16,
    )


class Floor:
    """A raw framed ping-pong with an echo process on a Unix socket."""

    def __init__(self, path: Path, request_bytes: int, reply_bytes: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ECHO, str(path), str(reply_bytes)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.frame = HEADER.pack(request_bytes, 1) + bytes(request_bytes)

    def __call__(self) -> None:
        self.sock.sendall(self.frame)
        n, _ = HEADER.unpack(self.sock.recv(HEADER.size, socket.MSG_WAITALL))
        self.sock.recv(n, socket.MSG_WAITALL) if n else None

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


def run(calls: int, hit_chunks: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-control-") as tmp:
        run_dir = Path(tmp) / "run"
        store = start_store(run_dir, "256MiB", "bench-control", remote=False)
        viewed = GrpcStoreClient(store.address, fast_control=True)
        fast = GrpcStoreClient(store.address, fast_control=True, view_leases=False)
        grpc_only = GrpcStoreClient(store.address, fast_control=False)
        control = fast.control
        if control is None:
            raise RuntimeError("the store serves no control socket (store.fast_control)")
        ns = _namespace()
        ns_id = fast.register_namespace(ns, CHUNK_BYTES)
        grpc_only.register_namespace(ns, CHUNK_BYTES)
        viewed.register_namespace(ns, CHUNK_BYTES)
        tokens = [rng.randrange(4, 1 << 20) for _ in range(hit_chunks * ns.chunk_tokens)]
        hit_keys = prompt_keys(ns, tokens)
        written = fast.allocate(ns_id, hit_keys, [CHUNK_BYTES] * hit_chunks)
        fast.commit(written.lease_id, None, [0] * hit_chunks)
        missing = prompt_keys(ns, [t + 1 for t in tokens])
        miss_request = pb.LookupRequest(
            epoch=fast.epoch, ns_id=ns_id, keys=b"".join(missing), lease_ttl_s=0
        )
        lease_request = pb.LookupRequest(
            epoch=fast.epoch,
            ns_id=ns_id,
            keys=b"".join(hit_keys),
            lease_ttl_s=30.0,
            session=fast.open_own_session(),
        )
        reply_bytes = len(control.call("Lookup", lease_request).SerializeToString())
        floor = Floor(Path(tmp) / "echo.sock", lease_request.ByteSize(), reply_bytes)

        leases: dict[int, list[int]] = {id(c): [] for c in (viewed, fast, grpc_only)}

        def hit_lease(client: GrpcStoreClient) -> None:
            got = client.lookup(ns_id, hit_keys, 30.0)
            assert len(got.hits) == hit_chunks
            leases[id(client)].append(got.lease_id)

        def release(client: GrpcStoreClient) -> None:
            client.release([leases[id(client)].pop()])

        def view_miss() -> None:
            assert not fast.lookup(ns_id, missing, 30.0).hits

        paths: dict[str, Callable[[], object]] = {
            "floor (raw Unix-socket ping-pong)": floor,
            "miss, view (no round trip)": view_miss,
            "miss, socket": lambda: control.call("Lookup", miss_request),
            "miss, gRPC": lambda: grpc_only.lookup(ns_id, missing, 30.0),
            f"hit+lease {hit_chunks} chunks, view (no round trip)": lambda: hit_lease(viewed),
            f"hit+lease {hit_chunks} chunks, socket": lambda: hit_lease(fast),
            f"hit+lease {hit_chunks} chunks, gRPC": lambda: hit_lease(grpc_only),
            "release, view": lambda: release(viewed),
            "release, socket": lambda: release(fast),
            "release, gRPC": lambda: release(grpc_only),
        }
        samples: dict[str, list[list[float]]] = {name: [] for name in paths}
        try:
            for _ in tqdm(range(repeats), desc="repeats", leave=False):
                per: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(calls):
                    for name, call in paths.items():
                        start = time.perf_counter()
                        call()
                        per[name].append(time.perf_counter() - start)
                for name in paths:
                    samples[name].append(per[name])
            misses_from_view = fast.view_misses
            hits_from_view = viewed.view_hits
        finally:
            floor.close()
            viewed.close()
            fast.close()
            grpc_only.close()
            store.stop()
    rows = []
    for name, reps in samples.items():
        p50s = [float(np.percentile(r, 50)) * 1e6 for r in reps]
        p90s = [float(np.percentile(r, 90)) * 1e6 for r in reps]
        rows.append({"path": name, "p50_us": p50s, "p90_us": p90s})
    return {
        "calls": calls,
        "repeats": repeats,
        "hit_chunks": hit_chunks,
        "view_misses": misses_from_view,
        "view_hits": hits_from_view,
        "rows": rows,
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"control path, µs per call ({report['calls']} calls x {report['repeats']} repeats, "
        "paths interleaved; p50 and p90 of each repeat)"
    )
    print("| path | p50 µs | p90 µs |")
    print("|---|---:|---:|")
    for row in report["rows"]:
        p50 = " / ".join(f"{x:.0f}" if x >= 10 else f"{x:.1f}" for x in row["p50_us"])
        p90 = " / ".join(f"{x:.0f}" if x >= 10 else f"{x:.1f}" for x in row["p90_us"])
        print(f"| {row['path']} | {p50} | {p90} |")
    asked = report["calls"] * report["repeats"]
    print(f"leased hits the engine pinned itself: {report['view_hits']} of {asked} asked")
