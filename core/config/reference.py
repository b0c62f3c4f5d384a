"""What the config model says about itself: docs/configuration.md (``render_markdown``,
``kvtier config docs``) and the effective config with where each value came from
(``effective``, ``render_toml``, ``render_json``: ``kvtier config show``).

Both walk the model (``KvtierConfig``): its sections (``[store]``, ``[store.pool]``), the
tables of its lists of sections (``[[store.tenants]]``) and each key's type, default,
description and environment variable. A key without a description is an error here, so the
reference never has a blank row."""

from __future__ import annotations

import enum
import inspect
import json
import re
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ByteSize, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from kvtier.core.config import (
    MOVED,
    KvtierConfig,
    Section,
    SourceRecord,
    load_config_with_sources,
    section_type,
)

ENV_PREFIX = "KVTIER_"
ENV_DELIMITER = "__"
REDACTED = "**********"  # what pydantic prints for a SecretStr
DOCS_PATH = "docs/configuration.md"
REGENERATE = f"kvtier config docs --output {DOCS_PATH}"


def env_name(path: str) -> str:
    """``store.pool.capacity`` -> ``KVTIER_STORE__POOL__CAPACITY``."""
    return ENV_PREFIX + ENV_DELIMITER.join(path.split(".")).upper()


@dataclass(frozen=True)
class Table:
    """A section of the model as one TOML table: ``path`` is ``""`` for the top level,
    ``store.pool``, or ``store.tenants`` for the tables of a list (``array``)."""

    path: str
    model: type[BaseModel]
    array: bool
    fields: list[tuple[str, FieldInfo]]  # keys of this table (not its sub-sections)
    in_array: bool  # inside a list's table: keys have no environment variable of their own

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name


def _array_item(field: FieldInfo) -> type[Section] | None:
    """The section a list field's tables are (``store.tenants``: ``TenantQuota``)."""
    if get_origin(field.annotation) is list:
        (item,) = get_args(field.annotation)
        if isinstance(item, type) and issubclass(item, Section):
            return item
    return None


def tables(model: type[BaseModel] = KvtierConfig) -> list[Table]:
    """Every table of the model, parents before children, in declaration order."""
    out: list[Table] = []

    def walk(model: type[BaseModel], path: str, array: bool, in_array: bool) -> None:
        fields = [(n, f) for n, f in model.model_fields.items() if section_type(f) is None]
        out.append(Table(path, model, array, fields, in_array))
        for name, field in model.model_fields.items():
            sub = f"{path}.{name}" if path else name
            section = section_type(field)
            item = _array_item(field)
            if section is not None:
                walk(section, sub, False, in_array)
            elif item is not None:
                walk(item, sub, True, True)

    walk(model, "", False, False)
    return out


def undocumented(model: type[BaseModel] = KvtierConfig) -> list[str]:
    """Keys without a description and sections without a docstring."""
    missing = []
    for table in tables(model):
        if table.path and not _doc(table.model):
            missing.append(f"[{table.path}] ({table.model.__name__}: no docstring)")
        missing += [table.key(n) for n, f in table.fields if not (f.description or "").strip()]
    return missing


def _doc(model: type[BaseModel]) -> str:
    """The first paragraph of the section's own docstring, in markdown."""
    doc = model.__dict__.get("__doc__") or ""
    first = inspect.cleandoc(doc).split("\n\n")[0]
    return " ".join(first.split()).replace("``", "`")


# -- types, units, defaults -----------------------------------------------------------------


def type_text(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        text = " or ".join(type_text(a) for a in rest)
        return f"{text}, optional" if len(rest) < len(args) else text
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin is list:
        item = args[0]
        if isinstance(item, type) and issubclass(item, Section):
            return "list of tables"
        return f"list of {type_text(item)}"
    if origin is dict:
        return f"table: {type_text(args[0])} -> {type_text(args[1])}"
    if isinstance(annotation, type):
        if issubclass(annotation, ByteSize):
            return 'size (bytes, or "8GiB")'
        if issubclass(annotation, enum.Enum):
            return " | ".join(str(m.value) for m in annotation)
        if issubclass(annotation, SecretStr):
            return "secret string"
        if issubclass(annotation, Path):
            return "path"
        if issubclass(annotation, BaseModel):
            return f"{annotation.__name__} ({annotation.__module__.removeprefix('kvtier.')})"
        return annotation.__name__
    return str(annotation)


def _is_bytes(annotation: Any) -> bool:
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_bytes(a) for a in get_args(annotation))
    return isinstance(annotation, type) and issubclass(annotation, ByteSize)


def unit(name: str, field: FieldInfo) -> str:
    if name.endswith("_s"):
        return "seconds"
    if name.endswith("_bytes") or _is_bytes(field.annotation):
        return "bytes"
    return ""


def human_bytes(value: int) -> str:
    for power, suffix in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if value and value % (1 << (10 * power)) == 0:
            return f"{value >> (10 * power)}{suffix}"
    return str(value)


def default_cell(field: FieldInfo) -> str:
    """The default as a table cell: a TOML value, or words where it depends on the machine
    (``json_schema_extra={"default_doc": ...}``)."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "default_doc" in extra:
        return f"*{_cell(str(extra['default_doc']))}*"
    return f"`{_cell(default_text(field))}`"


def default_text(field: FieldInfo) -> str:
    value = _default(field)
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, ByteSize):
        human = human_bytes(int(value))
        return json.dumps(human) if human != str(int(value)) else human
    return toml_value(_plain(value))


def _plain(value: Any) -> Any:
    """A default as the JSON-like value a config file would hold."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, SecretStr):
        return REDACTED
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


# -- TOML values ----------------------------------------------------------------------------

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def toml_value(value: Any) -> str:
    """A JSON-like value (None, bool, int, float, str, list, dict) as TOML; None inside an
    inline table is left out (TOML has no null)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        items = [f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}" if items else "{}"
    raise TypeError(f"no TOML for {type(value).__name__}")


# -- docs/configuration.md ------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _section_tables(model: type[BaseModel]) -> Iterator[type[Section]]:
    for table in tables(model):
        if issubclass(table.model, Section):
            yield table.model


def render_markdown(model: type[BaseModel] = KvtierConfig) -> str:
    """docs/configuration.md: every table and key of the model. Raises ``ValueError`` when a
    key has no description (or a section no docstring)."""
    missing = undocumented(model)
    if missing:
        raise ValueError(
            "config keys without a description (give each Field a description=, each "
            "section a docstring): " + ", ".join(missing)
        )
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from kvtier.core.config: do not edit. Regenerate with `{REGENERATE}`. -->",
        "",
        "Every kvtier process reads one config model (`kvtier.core.config`). Sources, the later "
        "winning:",
        "",
        "1. defaults (below);",
        "2. a TOML file: `--config PATH`, or `KVTIER_CONFIG=PATH`; its tables are the sections "
        "below;",
        f"3. environment variables `{ENV_PREFIX}<SECTION>{ENV_DELIMITER}<KEY>` (a nested "
        f"section adds `{ENV_DELIMITER}<SUB>`), case-insensitive; lists and tables are "
        "written as JSON;",
        "4. flags: each command's options, and for a vLLM instance its "
        "`kv_connector_extra_config` (`[connector]` keys, docs/connector.md).",
        "",
        "`kvtier config show` prints the effective config and where each value came from. "
        "Durations are `*_s` keys, in seconds; sizes take a number of bytes or a string such "
        'as `"8GiB"`. An unknown key is an error. A renamed key\'s old name is still '
        "accepted for one release, converted, with a warning naming the new key "
        "([Deprecated keys](#deprecated-keys)); setting both is an error.",
        "",
    ]
    for table in tables(model):
        heading = "Top level" if not table.path else f"[{table.path}]"
        if table.array:
            heading = f"[[{table.path}]]"
        lines += [f"## {heading}", ""]
        doc = _doc(table.model) if table.path else ""
        if doc:
            lines += [doc, ""]
        if table.array:
            lines += [
                f"Each entry of `{table.path}`: a `[[{table.path}]]` table in the file, or one "
                f"object of the JSON list in `{env_name(table.path)}`.",
                "",
            ]
        if not table.fields:
            continue
        lines += [
            "| key | type | default | unit | environment | description |",
            "|---|---|---|---|---|---|",
        ]
        for name, field in table.fields:
            env = "" if table.in_array else f"`{env_name(table.key(name))}`"
            lines.append(
                "| "
                + " | ".join(
                    [
                        f"`{name}`",
                        _cell(type_text(field.annotation)),
                        default_cell(field),
                        unit(name, field),
                        env,
                        _cell(field.description or ""),
                    ]
                )
                + " |"
            )
        lines.append("")
    lines += [
        "## Deprecated keys",
        "",
        "Accepted from every source (file, environment, flags, `kv_connector_extra_config`) "
        "until the next release, with a warning; the value is converted to the new key's unit.",
        "",
        "| old key | new key | conversion | old environment variable |",
        "|---|---|---|---|",
    ]
    for section in _section_tables(model):
        for old, renamed in section.RENAMED.items():
            conversion = renamed.unit_note() or "same value"
            old_path = section.key_path(old)
            lines.append(
                f"| `{old_path}` | `{section.key_path(renamed.new)}` | {conversion} | "
                f"`{env_name(old_path)}` |"
            )
    for old_path, new_path in MOVED.items():
        lines.append(f"| `{old_path}` | `{new_path}` | same value | `{env_name(old_path)}` |")
    lines.append("")
    return "\n".join(lines)


# -- kvtier config show ---------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    path: str  # store.pool.capacity
    value: Any  # JSON-like, secrets redacted
    source: str  # default | file PATH | env KVTIER_... | flag


_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/@:\s]*:)[^/@\s]+(?=@)", re.I)


def redact(value: Any) -> Any:
    """Secrets out of a JSON-like value: SecretStr fields are already ``**********``
    (pydantic's JSON dump); a password in a URL (``redis://:pw@host``) becomes one too."""
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda m: m.group("head") + REDACTED, value)
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    return value


def _leaf_paths(model: type[BaseModel], data: Mapping[str, Any], prefix: str) -> Iterator[str]:
    for key, value in data.items():
        field = model.model_fields.get(key)
        section = section_type(field) if field is not None else None
        if section is not None and isinstance(value, Mapping):
            yield from _leaf_paths(section, value, f"{prefix}{key}.")
        else:
            yield prefix + key


def sources(record: SourceRecord, model: type[BaseModel] = KvtierConfig) -> dict[str, str]:
    """Dotted key -> the source that set it (the highest in precedence)."""
    out: dict[str, str] = {}
    for label, data, renamed in reversed(record):  # lowest precedence first: later ones win
        for path in _leaf_paths(model, data, ""):
            old = renamed.get(path)
            if label == "env":
                out[path] = f"env {env_name(old or path)}"
            else:
                out[path] = f"{label} (as {old})" if old else label
    return out


def effective(config: KvtierConfig, record: SourceRecord) -> list[Setting]:
    """Every key of ``config`` with its value (secrets redacted) and its source: ``default``,
    ``file PATH``, ``env KVTIER_...`` or ``flag``; ``derived`` for a value no source set
    that differs from its default (``index.address`` from the old ``store.index_address``)."""
    dump = config.model_dump(mode="json")
    given = sources(record)
    out = []

    def walk(model: type[BaseModel], data: Mapping[str, Any], prefix: str) -> None:
        for name, field in model.model_fields.items():
            section = section_type(field)
            if section is not None:
                walk(section, data[name], f"{prefix}{name}.")
                continue
            path = prefix + name
            source = given.get(path)
            if source is None:
                source = "default" if _is_default(field, data[name]) else "derived"
            out.append(Setting(path, redact(data[name]), source))

    walk(KvtierConfig, dump, "")
    return out


def _default(field: FieldInfo) -> Any:
    """The field's default (PydanticUndefined for a required field)."""
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return field.default


def _is_default(field: FieldInfo, value: Any) -> bool:
    default = _default(field)
    try:
        return bool(_plain(default) == value or json.loads(json.dumps(_plain(default))) == value)
    except TypeError:
        return False


def render_toml(settings: list[Setting]) -> str:
    """The effective config as a TOML file, each key followed by its source."""
    lines = [
        "# kvtier: the effective config; after each key, where its value came from.",
        f"# Secrets show as {REDACTED}.",
    ]
    by_table: dict[str, list[Setting]] = {}
    for s in settings:
        table, _, _ = s.path.rpartition(".")
        by_table.setdefault(table, []).append(s)
    for table, rows in by_table.items():
        lines += ["", f"[{table}]"] if table else [""]
        for s in rows:
            key = toml_key(s.path.rpartition(".")[2])
            if s.value is None:
                lines.append(f"# {key} unset  # {s.source}")
            else:
                lines.append(f"{key} = {toml_value(s.value)}  # {s.source}")
    return "\n".join(lines) + "\n"


def render_json(settings: list[Setting]) -> str:
    """``{"config": nested values, "sources": {dotted key: source}}``."""
    nested: dict[str, Any] = {}
    for s in settings:
        node = nested
        *parents, leaf = s.path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = s.value
    return json.dumps({"config": nested, "sources": {s.path: s.source for s in settings}}, indent=2)


def show(file: str | Path | None = None, as_json: bool = False, **flags: Any) -> str:
    """``kvtier config show``: the config the services would read, rendered."""
    config, record = load_config_with_sources(file, **flags)
    settings = effective(config, record)
    return render_json(settings) if as_json else render_toml(settings)
