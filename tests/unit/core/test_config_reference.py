"""docs/configuration.md is generated from the config model, and every key has a description."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from kvtier.core.config.reference import DOCS_PATH, REGENERATE, render_markdown, undocumented
from kvtier.core.config.section import Section

ROOT = Path(__file__).resolve().parents[3]


def test_configuration_reference_is_current() -> None:
    generated = render_markdown()
    path = ROOT / DOCS_PATH
    current = path.read_text() if path.is_file() else ""
    assert current == generated, (
        f"{DOCS_PATH} differs from the config model: regenerate it with `{REGENERATE}` "
        f"(or `python -m kvtier config docs --output {DOCS_PATH}`) and commit it"
    )


def test_every_key_has_a_description() -> None:
    assert undocumented() == []


def test_a_key_without_a_description_fails_the_reference() -> None:
    class Inner(Section):
        """A section."""

        timeout_s: float = 1.0  # no description

    class Root(BaseModel):
        inner: Inner = Field(default_factory=Inner)

    with pytest.raises(ValueError, match=r"inner\.timeout_s"):
        render_markdown(Root)


def test_reference_lists_units_env_and_deprecated_names() -> None:
    text = render_markdown()
    row = next(line for line in text.splitlines() if line.startswith("| `lookup_wait_s` "))
    assert "| seconds |" in row and "`KVTIER_CONNECTOR__LOOKUP_WAIT_S`" in row
    assert "| `connector.lookup_wait_ms` | `connector.lookup_wait_s` |" in text
    assert "| `router.index_timeout_ms` | `router.index_timeout_s` |" in text
    assert "| `connector.lease_ttl_s` | `connector.load_lease_ttl_s` |" in text
    assert "| `connector.max_namespaces` | `connector.namespace_cache_size` |" in text
    assert "## [[store.tenants]]" in text and "## [store.remote.demotion]" in text
