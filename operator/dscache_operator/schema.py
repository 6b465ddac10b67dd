"""Building blocks of the spec models: the base model, field patterns, durations, CEL rules.

Every spec model derives from :class:`SpecModel`: snake_case in Python,
camelCase on the wire, unknown fields refused, frozen. The patterns here are
also the CRD's, so the API server and :func:`dscache_operator.spec.parse_spec`
refuse the same values.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from pydantic.alias_generators import to_camel

DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DURATION_PART = re.compile(r"([0-9]+)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}

Duration = Annotated[str, Field(pattern=DURATION_PATTERN, max_length=32)]
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=32)]
ShortString = Annotated[str, Field(min_length=1, max_length=253)]
ResourceList = dict[str, int | str]


class InvalidSpecError(ValueError):
    """The resource's spec cannot be reconciled; the message says what to change."""


def parse_duration(value: str) -> float:
    """``"90s"``, ``"5m"``, ``"1h30m"``, ``"250ms"`` -> seconds."""
    if not re.fullmatch(DURATION_PATTERN, value):
        raise ValueError(f"not a duration: {value!r} (examples: 30s, 5m, 1h30m)")
    return sum(int(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))


def cel_rules(*rules: tuple[str, str]) -> ConfigDict:
    """A model config carrying ``x-kubernetes-validations``: ``(CEL rule, message)`` pairs."""
    validations: list[JsonValue] = [{"rule": rule, "message": message} for rule, message in rules]
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": validations})


class SpecModel(BaseModel):
    """Base of the spec models (camelCase aliases, no unknown fields, frozen)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )
