"""The base of every configuration section (``pipeline_rl.config``): unknown keys are errors and
values are re-validated on assignment. Its own module so that every section module of this folder
shares it without importing the tree (``tree.py``), which imports them all; stdlib and pydantic only."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are re-validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
