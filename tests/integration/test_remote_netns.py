"""The remote tier across a real network interface: two network namespaces joined by a veth
pair, a store in each; the puller's fetch must cross the pair (its rx counter says so).

Needs root (CAP_NET_ADMIN and ``ip netns``), as CI runs; elsewhere it is skipped."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import support
from support.helpers import start_store_process

pytestmark = pytest.mark.remote
# run by file inside the namespaces (its imports: kvtier and numpy)
DRIVER = Path(support.__file__).with_name("remote_netns_driver.py")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def veth_pair() -> Iterator[tuple[str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = f"kvt{os.getpid() % 100000}"
    a, b = f"{tag}a", f"{tag}b"
    try:
        _ip("netns", "add", a)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"{tag}-va", "type", "veth", "peer", "name", f"{tag}-vb")
        for ns, dev, addr in ((a, f"{tag}-va", "10.77.0.1"), (b, f"{tag}-vb", "10.77.0.2")):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


NODE_TOKEN = "node-token-" + "n" * 16


def test_fetch_crosses_a_veth_pair(veth_pair, tmp_path: Path) -> None:
    """Two stores in two network namespaces, each bound to its veth address: beyond loopback,
    so with credentials (protected mode); each presents a node token to the other."""
    ns_a, ns_b = veth_pair
    credentials = [{"name": "nodes", "token": NODE_TOKEN, "role": "node"}]
    env = {
        "KVTIER_AUTH__CREDENTIALS": json.dumps(credentials),
        "KVTIER_AUTH__TOKEN": NODE_TOKEN,
    }
    stores = []
    try:
        for ns, addr, name in ((ns_b, "10.77.0.2", "holder"), (ns_a, "10.77.0.1", "puller")):
            # the puller fetches only from peers it knows: the holder, started first
            peers = ("--peers", stores[0].address) if stores else ()
            stores.append(
                start_store_process(
                    tmp_path,
                    "64MiB",
                    "--remote",
                    "--remote-host",
                    addr,
                    "--grpc-host",
                    addr,
                    *peers,
                    node_id=name,
                    env=env,
                    wrapper=("ip", "netns", "exec", ns),
                )
            )
        holder, puller = stores
        assert holder.ready["transfer"].startswith("10.77.0.2:")
        n, size = 8, 1 << 20
        driver = [sys.executable, str(DRIVER)]
        args = [holder.address, puller.address, f"{ns_a[:-1]}-va", str(n), str(size)]
        out = subprocess.run(
            ["ip", "netns", "exec", ns_a, *driver, *args],
            env={**os.environ, **env},
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert report["status"] == "ok" and report["local"] == n and report["exact"], report
        assert report["rx_bytes"] >= n * size  # the chunks came in over the veth interface
    finally:
        for store in stores:
            store.stop()
