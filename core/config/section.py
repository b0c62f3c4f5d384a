"""The base of every section of kvtier's one config model (``kvtier.core.config``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, and an error
    never repeats the value it refused.

    ``hide_input_in_errors``: pydantic otherwise prints the offending input in every error
    (``input_value=...``), and for a model-level check that input is the whole section: a
    tenant's ``cache_salts``, most of a credential's token. Errors name the field and what
    is wrong with it; a value belongs in the file it came from, not in a log."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)
