"""The base of every section of kvtier's one config model (``kvtier.core.config``), and how
a section keeps accepting the old name of a renamed key for one release."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, model_validator


class ConfigDeprecationWarning(DeprecationWarning):
    """An old config key name was used. Shown by default (Python hides a plain
    DeprecationWarning raised outside ``__main__``), once per message per process."""


warnings.simplefilter("default", ConfigDeprecationWarning)


class Renamed(NamedTuple):
    """A section key's new name, and what an old value is multiplied by to become a new one
    (``0.001``: the old key was milliseconds, the new one seconds)."""

    new: str
    factor: float = 1.0

    def unit_note(self) -> str:
        """How an old value converts, in words (empty when it does not change)."""
        if self.factor == 1.0:
            return ""
        if self.factor == 1e-3:
            return "milliseconds -> seconds: value / 1000"
        return f"multiplied by {self.factor:g}"


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, and an error
    never repeats the value it refused.

    ``hide_input_in_errors``: pydantic otherwise prints the offending input in every error
    (``input_value=...``), and for a model-level check that input is the whole section: a
    tenant's ``cache_salts``, most of a credential's token. Errors name the field and what
    is wrong with it; a value belongs in the file it came from, not in a log.

    ``RENAMED``: old key -> ``Renamed(new key, factor)``. Each source (TOML file, environment,
    vLLM's ``kv_connector_extra_config``, flags, a constructor call) may still use the old
    name for one release: its value is converted to the new key with a
    ``ConfigDeprecationWarning`` naming the new key; giving both is an error. ``SECTION`` is
    where the section sits in the config (``"connector"``), for the messages."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)

    RENAMED: ClassVar[Mapping[str, Renamed]] = {}
    SECTION: ClassVar[str] = ""

    @classmethod
    def key_path(cls, key: str) -> str:
        return f"{cls.SECTION}.{key}" if cls.SECTION else key

    @classmethod
    def upgrade_keys(cls, data: Any, source: str = "") -> Any:
        """``data`` (this section's raw input) with every old key renamed and its value
        converted; anything but a mapping is returned as is. ``source`` names where the keys
        came from, for the warning. Raises ``ValueError`` when an old key and its new one are
        both given."""
        if not cls.RENAMED or not isinstance(data, Mapping):
            return data
        if not any(old in data for old in cls.RENAMED):
            return data
        out = dict(data)
        for old, renamed in cls.RENAMED.items():
            if old not in out:
                continue
            if renamed.new in out:
                raise ValueError(
                    f"{cls.key_path(old)} and {cls.key_path(renamed.new)} both set"
                    f"{' in ' + source if source else ''}: {cls.key_path(old)} is the old name "
                    f"of {cls.key_path(renamed.new)}; keep only {renamed.new}"
                )
            value = out.pop(old)
            out[renamed.new] = _convert(cls.key_path(old), value, renamed.factor)
            note = f" ({renamed.unit_note()})" if renamed.unit_note() else ""
            where = f" ({source})" if source else ""
            deprecated(
                f"config key {cls.key_path(old)}{where} is deprecated: set "
                f"{cls.key_path(renamed.new)}{note}; the old name goes in the next release"
            )
        return out

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        return cls.upgrade_keys(data)


_WARNED: dict[Any, Any] = {}  # the warnings registry of deprecated(): each message once


def deprecated(message: str) -> None:
    """A ``ConfigDeprecationWarning``, once per message per process. Attributed to
    "kvtier.config" rather than a line of kvtier or pydantic, which would print that line."""
    warnings.warn_explicit(
        message,
        ConfigDeprecationWarning,
        "kvtier.config",
        0,
        module="kvtier.config",
        registry=_WARNED,
    )


def _convert(key: str, value: Any, factor: float) -> Any:
    if factor == 1.0:
        return value
    try:
        number = float(value)  # a TOML/JSON number, or an environment variable's string
    except (TypeError, ValueError):
        raise ValueError(f"{key}: not a number") from None
    return number * factor
