"""A store with credentials on and a Unix socket for its node, as a real process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.testing.services import start_store

from support.secure_env import TOKENS, SecureStore, auth_env


@pytest.fixture(scope="module")
def secure_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStore]:
    run_dir = tmp_path_factory.mktemp("secure-store")
    socket = run_dir / "sock" / "store.sock"
    service = start_store(
        run_dir,
        "64MiB",
        "secure-node",
        remote=False,
        env=auth_env(TOKENS["node"]),
        extra=("--unix-socket", str(socket)),
    )
    try:
        yield SecureStore(service, socket)
    finally:
        service.stop()
