"""The base of every configuration section (``pipeline_rl.config``): unknown keys are errors and
values are re-validated on assignment. Its own module so that every section module of this folder
shares it without importing the tree (``config/tree.py``), which imports them all; stdlib and
pydantic only."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


def choice_table(value: object, default: str) -> object:
    """A section that is a choice (a discriminated union on ``type``), as written: a bare name
    is ``{"type": name}``, a table without ``type`` is ``default``'s; anything else is returned
    as it is (pydantic judges it)."""
    if isinstance(value, str):
        return {"type": value}
    if isinstance(value, dict) and "type" not in value:
        return {"type": default, **value}
    return value


def foreign_keys(choice: type[BaseModel], data: object) -> Iterator[str]:
    """The keys of a choice's table (``data``, as written) that are not ``choice``'s own fields:
    each choice refuses them in its own line, naming the flag."""
    if isinstance(data, dict):
        yield from (key for key in data if key not in choice.model_fields)
