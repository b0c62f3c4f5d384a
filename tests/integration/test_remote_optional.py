"""The transfer engine is optional (``kvtier[remote]``): in a fresh interpreter where the
package cannot be imported, a store without the remote tier runs, and one with it fails at
start with a clear error, leaving no segment behind."""

from __future__ import annotations

import subprocess
import sys


def test_store_runs_without_the_engine_package(tmp_path) -> None:
    """With the package made unimportable: a store without the remote tier runs; one with it
    fails at start with a clear error (and leaves no segment behind)."""
    code = f"""
import sys, os
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "mooncake" or name.startswith("mooncake."):
            raise ImportError("no mooncake here")
sys.meta_path.insert(0, Block())
from kvtier.core.config import StoreConfig
from kvtier.core.errors import ErrorCode, KvtierError
from kvtier.store.state.core import StoreCore
from kvtier.store.node import NodeStore
from kvtier.store.remote.demotion import Demoter
run_dir = {str(tmp_path)!r}
NodeStore(StoreConfig(run_dir=run_dir, pool={{"capacity": 1 << 20}})).close()
try:
    NodeStore(StoreConfig(run_dir=run_dir, pool={{"capacity": 1 << 20}},
                          remote={{"enabled": True}}))
except KvtierError as exc:
    assert exc.code is ErrorCode.UNAVAILABLE and "kvtier[remote]" in exc.message, exc
else:
    raise AssertionError("started without the engine")
assert not [n for n in os.listdir("/dev/shm") if n.startswith("kvtier-") and str(os.getpid()) in n]
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
