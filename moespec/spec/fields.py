"""The vocabulary every spec model is written in: the strict base model and the number types.

Counts are strict: `experts: true` or `experts: 2.5` is an error, not 1 or 2. Factors are finite: `.inf` and
`.nan` are YAML floats, but no width, capacity or weight.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

PositiveInt = Annotated[int, Field(gt=0, strict=True)]
NonNegativeInt = Annotated[int, Field(ge=0, strict=True)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class SpecModel(BaseModel):
    """One YAML mapping of a spec: unknown keys are errors, values are frozen, attribute docstrings become the
    JSON Schema's descriptions. A class named `...Spec` is titled without the suffix (`RescaleSpec` is
    `Rescale` in the schema), so Python names can differ from layer classes while the schema keeps the
    names users see."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True,
                              model_title_generator=lambda cls: cls.__name__.removesuffix("Spec") or cls.__name__)


def _as_list(value: Any) -> Any:
    """Accept one item where a list is expected: `aux_loss: {...}` means `aux_loss: [{...}]`."""
    return value if isinstance(value, list) else [value]


def OneOrList(item: Any) -> Any:
    """`list[item]` that also accepts a single `item`, in validation and in the JSON Schema."""
    return Annotated[list[item], BeforeValidator(_as_list, json_schema_input_type=Union[item, list[item]])]
