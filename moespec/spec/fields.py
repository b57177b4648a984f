"""The vocabulary every spec model is written in: the strict base model and the number types.

Counts are strict: `experts: true` or `experts: 2.5` is an error, not 1 or 2, and bounded: each integer field
says how large it may be, with the reason next to the bound, so that `experts: 10**30` is a spec error, not
a C++ overflow in torch. Floats are finite and bounded too: `.inf`, `.nan` and `1e308` are YAML floats, but no
width, capacity, std or weight.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema
from pydantic_core import PydanticCustomError


def IntRange(low: int, high: int, *, strict: bool = True) -> Any:
    """An integer from `low` to `high`, both included; out of range is one message naming both ends
    (`input should be between 1 and 65536`), and the JSON Schema says the same. `strict=False` for mapping
    keys, which JSON (and so an editor's schema check) writes as strings."""

    def within(value: int) -> int:
        if not low <= value <= high:
            raise PydanticCustomError("int_range", "input should be between {low} and {high}",
                                      {"low": low, "high": high})
        return value

    return Annotated[int, Field(strict=strict), AfterValidator(within),
                     WithJsonSchema({"type": "integer", "minimum": low, "maximum": high})]


def FloatRange(low: float, high: float, *, low_open: bool = False) -> Any:
    """A finite float from `low` to `high` (above `low` with `low_open`), both ends in pydantic's message and in
    the JSON Schema. Every float of a spec has one: `1e308` is a YAML float too, and a capacity, std or weight
    that large overflows the arithmetic built on it (`ceil(inf)`, a noise draw of inf, a loss of inf)."""
    lower = {"gt": low} if low_open else {"ge": low}
    return Annotated[float, Field(**lower, le=high, allow_inf_nan=False)]



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
