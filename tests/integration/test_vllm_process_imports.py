"""The vLLM process (the connector, an embedded store) imports no server machinery: a fresh
interpreter loads the connector's scheduler and worker sides and is checked for kvtier's HTTP
and gRPC servers and their wiring (the import rule itself: tests/unit/test_layering.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_the_vllm_process_imports_no_server_machinery(tmp_path: Path) -> None:
    """The connector (scheduler side: tiers, an embedded store; worker side: copies) loads none
    of kvtier's HTTP or gRPC servers nor their wiring (vLLM brings FastAPI on its own). With
    the embedded store: a superset of what a connector to a node store imports."""
    code = f"""
import sys
import kvtier.connector.vllm_connector, kvtier.connector.worker
from kvtier.core.config import StoreConfig
from kvtier.tiers import connect
tier = connect(StoreConfig(run_dir={str(tmp_path)!r}, pool={{"capacity": 1 << 20}}))
tier.close()
bad = sorted(m for m in sys.modules if m in (
    "kvtier.core.http", "kvtier.store.server.http", "kvtier.index.server.http",
    "kvtier.store.server.grpc", "kvtier.index.server.grpc", "kvtier.store.server.service",
    "kvtier.index.server.service", "kvtier.bench", "kvtier.testing"))
print(",".join(bad))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"the vLLM process imported {out}"
