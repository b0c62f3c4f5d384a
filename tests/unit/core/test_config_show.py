"""``kvtier config show`` and renamed keys: where each value came from, secrets redacted, old
key names accepted (converted, with a warning) from every source, both names an error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from kvtier.cli import app
from kvtier.connector.config import ConnectorConfigError, parse_extra_config
from kvtier.core.config import ConfigDeprecationWarning, ConnectorConfig, load_config
from kvtier.core.config.reference import show

SECRET = "s3cret-token-0123456789"


@pytest.fixture(autouse=True)
def _no_kvtier_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return path


def test_show_names_the_source_of_each_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, "[store]\ngrpc_port = 1111\nhttp_port = 2222\n")
    monkeypatch.setenv("KVTIER_STORE__HTTP_PORT", "3333")
    monkeypatch.setenv("KVTIER_STORE__POOL__CAPACITY", "2GiB")
    out = json.loads(show(path, as_json=True))
    config, sources = out["config"], out["sources"]
    assert config["store"]["grpc_port"] == 1111
    assert sources["store.grpc_port"] == f"file {path}"
    assert config["store"]["http_port"] == 3333  # env beats the file
    assert sources["store.http_port"] == "env KVTIER_STORE__HTTP_PORT"
    assert config["store"]["pool"]["capacity"] == 2 << 30
    assert sources["store.pool.capacity"] == "env KVTIER_STORE__POOL__CAPACITY"
    assert sources["store.pool.eviction"] == "default"
    assert sources["connector.lookup_wait_s"] == "default"
    assert set(sources) >= {"log_level", "auth.tls.ca_file", "router.index_timeout_s"}

    toml = show(path)
    assert f"grpc_port = 1111  # file {path}" in toml
    assert "http_port = 3333  # env KVTIER_STORE__HTTP_PORT" in toml
    assert "# address unset  # default" in toml


def test_show_reads_the_config_file_from_kvtier_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, '[router]\npolicy = "sticky"\n')
    monkeypatch.setenv("KVTIER_CONFIG", str(path))
    result = CliRunner().invoke(app, ["config", "show", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["config"]["router"]["policy"] == "sticky"
    assert out["sources"]["router.policy"] == f"file {path}"


def test_show_redacts_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(
        tmp_path,
        '[index]\nredis_url = "redis://user:hunter2pw@redis:6379/0"\n'
        f'[[store.tenants]]\nname = "a"\ncache_salts = ["{SECRET}-salt"]\n'
        f'[[auth.credentials]]\nname = "ops"\ntoken = "{SECRET}-cred"\nrole = "admin"\n',
    )
    monkeypatch.setenv("KVTIER_AUTH__TOKEN", SECRET)
    for as_json in (False, True):
        text = show(path, as_json=as_json)
        assert SECRET not in text and "hunter2pw" not in text
        assert "**********" in text and "redis://user:**********@redis:6379/0" in text


def test_old_key_in_a_file_is_converted_with_a_warning(tmp_path: Path) -> None:
    path = _toml(tmp_path, "[connector]\nlookup_wait_ms = 7\nlease_ttl_s = 90\n")
    with pytest.warns(ConfigDeprecationWarning) as warned:
        config = load_config(path)
    messages = " ".join(str(w.message) for w in warned)
    assert "set connector.lookup_wait_s (milliseconds -> seconds" in messages
    assert "set connector.load_lease_ttl_s" in messages
    assert config.connector.lookup_wait_s == pytest.approx(0.007)
    assert config.connector.load_lease_ttl_s == 90
    with pytest.warns(ConfigDeprecationWarning):
        out = json.loads(show(path, as_json=True))
    assert out["sources"]["connector.lookup_wait_s"] == (
        f"file {path} (as connector.lookup_wait_ms)"
    )


def test_old_key_from_env_flags_and_extra_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_ROUTER__INDEX_TIMEOUT_MS", "200")
    with pytest.warns(ConfigDeprecationWarning, match=r"router\.index_timeout_s"):
        config = load_config()
    assert config.router.index_timeout_s == pytest.approx(0.2)
    with pytest.warns(ConfigDeprecationWarning):
        out = json.loads(show(as_json=True))
    assert out["sources"]["router.index_timeout_s"] == "env KVTIER_ROUTER__INDEX_TIMEOUT_MS"
    monkeypatch.delenv("KVTIER_ROUTER__INDEX_TIMEOUT_MS")

    with pytest.warns(ConfigDeprecationWarning, match=r"connector\.save_wait_s"):
        assert load_config(**{"connector.save_wait_ms": 4}).connector.save_wait_s == 0.004
    with pytest.warns(ConfigDeprecationWarning, match=r"connector\.namespace_cache_size"):
        assert ConnectorConfig(max_namespaces=12).namespace_cache_size == 12
    with pytest.warns(ConfigDeprecationWarning, match=r"connector\.lookup_deadline_s"):
        config = parse_extra_config({"lookup_deadline_ms": 500})
    assert config.connector.lookup_deadline_s == 0.5


def test_old_name_in_a_lower_source_loses_to_the_new_name_above_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, "[connector]\nsave_wait_ms = 9\n")
    monkeypatch.setenv("KVTIER_CONNECTOR__SAVE_WAIT_S", "0.5")
    with pytest.warns(ConfigDeprecationWarning):
        assert load_config(path).connector.save_wait_s == 0.5


def test_old_and_new_name_together_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, "[connector]\nlookup_wait_ms = 7\nlookup_wait_s = 0.007\n")
    with pytest.raises(ValidationError, match=r"lookup_wait_ms and connector\.lookup_wait_s both"):
        load_config(path)
    with pytest.raises(ValidationError, match="both set"):
        ConnectorConfig(lease_ttl_s=5, load_lease_ttl_s=5)
    monkeypatch.setenv("KVTIER_ROUTER__INDEX_TIMEOUT_MS", "10")
    monkeypatch.setenv("KVTIER_ROUTER__INDEX_TIMEOUT_S", "0.01")
    with pytest.raises(ValidationError, match=r"keep only index_timeout_s"):
        load_config()
    monkeypatch.delenv("KVTIER_ROUTER__INDEX_TIMEOUT_MS")
    monkeypatch.delenv("KVTIER_ROUTER__INDEX_TIMEOUT_S")
    with pytest.raises(ConnectorConfigError, match="both set"):
        parse_extra_config({"save_wait_ms": 1, "save_wait_s": 0.001})


def test_an_old_name_that_is_not_a_number_is_an_error(tmp_path: Path) -> None:
    path = _toml(tmp_path, '[connector]\nlookup_wait_ms = "soon"\n')
    with pytest.raises(ValidationError, match=r"connector\.lookup_wait_ms: not a number"):
        load_config(path)


def test_unknown_keys_are_still_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError, match="lookup_wait_us"):
        load_config(_toml(tmp_path, "[connector]\nlookup_wait_us = 5\n"))
    monkeypatch.setenv("KVTIER_ROUTER__INDEX_TIMEOUT", "1")
    with pytest.raises(ValidationError, match="index_timeout"):
        load_config()
    monkeypatch.delenv("KVTIER_ROUTER__INDEX_TIMEOUT")
    with pytest.raises(ConnectorConfigError, match="lease_ttl"):
        parse_extra_config({"lease_ttl": 5})


def test_config_docs_command_prints_the_reference() -> None:
    result = CliRunner().invoke(app, ["config", "docs"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("# Configuration reference")
