"""One config model: defaults < file < environment < flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.core.config import load_config


def test_defaults_work_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_CONFIG", raising=False)
    config = load_config()
    assert config.store.address is None  # embedded store by default
    assert config.store.pool.capacity == 1 << 30
    assert config.store.pool.eviction == "s3fifo"


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(
        '[store]\ngrpc_port = 1111\nhttp_port = 2222\nnode_id = "from-file"\n'
        '[store.pool]\ncapacity = "2GiB"\neviction = "lru"\n'
    )
    monkeypatch.setenv("KVTIER_STORE__HTTP_PORT", "3333")
    monkeypatch.setenv("KVTIER_STORE__POOL__CAPACITY", "4GiB")
    config = load_config(path, **{"store.node_id": "from-flag", "store.grpc_port": None})
    assert config.store.grpc_port == 1111  # file (flag given as None = not set)
    assert config.store.http_port == 3333  # env beats file
    assert config.store.pool.capacity == 4 << 30  # env, nested
    assert config.store.pool.eviction == "lru"  # file, beside an env value in the same section
    assert config.store.node_id == "from-flag"  # flag beats everything


def test_config_file_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[store.pool]\npage_size = "1MiB"\n')
    monkeypatch.setenv("KVTIER_CONFIG", str(path))
    assert load_config().store.pool.page_size == 1 << 20


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[store]\nno_such_field = 1\n", "no_such_field"),
        ('[store.pool]\npage_size = "3000B"\n', "page_size"),
        ('[store.pool]\neviction = "random"\n', "eviction"),
        ("[store]\ngrpc_port = 70000\n", "grpc_port"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ValidationError, match=message):
        load_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_config(tmp_path / "nope.toml")
