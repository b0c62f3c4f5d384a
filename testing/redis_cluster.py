"""A real Redis Cluster on loopback for tests and benchmarks: ``masters`` masters with
``replicas`` replicas each, made by ``redis-cli --cluster create``, no persistence.

Each node's cluster bus gets its own port from ``free_port`` (``cluster-port``), not the
default port + 10000, which would land in the kernel's ephemeral range (see ``ports``).
``fail_over`` kills a master and waits until its replica serves its slots; ``move_slot``
migrates one slot with its keys to another master, as ``redis-cli --cluster reshard`` does.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvtier.testing.ports import free_port

NODE_TIMEOUT_MS = 1000  # how long a master may be silent before its replica takes over


@dataclass
class ClusterNode:
    port: int
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=1, socket_timeout=2)


@dataclass
class LocalRedisCluster:
    nodes: list[ClusterNode]
    workdir: Path
    killed: list[ClusterNode] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def live(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n not in self.killed]

    def master_of(self, slot: int) -> ClusterNode:
        """The node serving ``slot`` now, as a live node sees it."""
        for node in self.live():
            try:
                with node.client() as c:
                    for lo, hi, master, *_ in c.execute_command("CLUSTER SLOTS"):
                        if lo <= slot <= hi:
                            port = int(master[1])
                            return next(n for n in self.nodes if n.port == port)
            except redis.RedisError:
                continue
        raise RuntimeError(f"no live node knows who serves slot {slot}")

    def fail_over(self, slot: int, timeout_s: float = 30.0) -> tuple[ClusterNode, ClusterNode]:
        """SIGKILL the master of ``slot``; returns (killed, promoted) once a replica serves it
        and the cluster says ok."""
        old = self.master_of(slot)
        self.kill(old)
        return old, self.wait_for_new_master(slot, old, timeout_s)

    def kill(self, node: ClusterNode) -> None:
        node.proc.kill()
        node.proc.wait()
        self.killed.append(node)

    def wait_for_new_master(
        self, slot: int, old: ClusterNode, timeout_s: float = 30.0
    ) -> ClusterNode:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                new = self.master_of(slot)
                if new is not old and self._state_ok(new):
                    return new
            except RuntimeError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"no replica took over slot {slot} in {timeout_s} s")

    def move_slot(self, slot: int, to: ClusterNode) -> None:
        """Migrate ``slot`` and its keys to the master ``to`` (IMPORTING/MIGRATING, MIGRATE in
        batches, SETSLOT NODE on every master)."""
        source = self.master_of(slot)
        if source is to:
            return
        with source.client() as src, to.client() as dst:
            src_id = src.execute_command("CLUSTER MYID").decode()
            dst_id = dst.execute_command("CLUSTER MYID").decode()
            dst.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", src_id)
            src.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", dst_id)
            # "CLUSTER", "GETKEYSINSLOT" as two words: as one, redis-py decodes the key names
            while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000):
                src.execute_command("MIGRATE", "127.0.0.1", to.port, "", 0, 5000, "KEYS", *keys)
            for node in self.live():
                with node.client() as c:
                    if b"master" in c.execute_command("ROLE")[0]:
                        c.execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)

    def masters(self) -> list[ClusterNode]:
        out = []
        for node in self.live():
            with node.client() as c:
                if c.execute_command("ROLE")[0] == b"master":
                    out.append(node)
        return out

    def _state_ok(self, node: ClusterNode) -> bool:
        try:
            with node.client() as c:
                info = c.cluster("INFO")  # parsed by redis-py into a dict
        except redis.RedisError:
            return False
        return info.get("cluster_state") == "ok"

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()


def start_redis_cluster(workdir: Path, masters: int = 3, replicas: int = 1) -> LocalRedisCluster:
    """Start the nodes, create the cluster, and return once every node says cluster_state:ok."""
    exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if exe is None or cli is None:
        raise RuntimeError("redis-server not found: apt-get install redis-server (see .ci/run)")
    nodes: list[ClusterNode] = []
    cluster = LocalRedisCluster(nodes, workdir)
    try:
        for _ in range(masters * (1 + replicas)):
            port = free_port()
            node_dir = workdir / f"node-{port}"
            node_dir.mkdir(parents=True, exist_ok=True)
            argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "no"]
            argv += ["--cluster-enabled", "yes", "--cluster-port", str(free_port())]
            argv += ["--cluster-config-file", "nodes.conf"]
            argv += ["--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
            argv += ["--save", "", "--appendonly", "no", "--dir", str(node_dir)]
            argv += ["--logfile", "redis.log"]
            # a replica is promoted however long it lost its master (the drills promote stale
            # replicas on purpose: the case where acknowledged writes are lost)
            argv += ["--cluster-replica-validity-factor", "0"]
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            nodes.append(ClusterNode(port, proc))
        for node in nodes:
            _wait_ping(node)
        create = [cli, "--cluster", "create", *(n.address for n in nodes)]
        create += ["--cluster-replicas", str(replicas), "--cluster-yes"]
        subprocess.run(create, check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 60
        while not all(cluster._state_ok(n) and _synced(n) for n in nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not reach cluster_state:ok in 60 s")
            time.sleep(0.05)
        return cluster
    except BaseException:
        cluster.stop()
        raise


def _synced(node: ClusterNode) -> bool:
    """A master, or a replica whose link to its master is up (its first sync done)."""
    try:
        with node.client() as c:
            info = c.info("replication")
    except redis.RedisError:
        return False
    return info.get("role") == "master" or info.get("master_link_status") == "up"


def _wait_ping(node: ClusterNode) -> None:
    with node.client() as c:
        while True:
            try:
                c.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError):
                if node.proc.poll() is not None:
                    raise RuntimeError(
                        f"redis-server exited ({node.proc.returncode}) before answering on "
                        f"{node.port}"
                    ) from None
                time.sleep(0.02)
