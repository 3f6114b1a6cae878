"""The base of every configuration section (pydantic), shared by the components that own a section
(actor, critic, optimizer, placement) and the run's tree that composes them (flows/config.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    # Attribute docstrings become field descriptions: the Prefect UI shows them beside each field.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
