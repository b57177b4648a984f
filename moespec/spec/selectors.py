"""Block selectors: the `where:` of a surgery group.

A selector picks residual blocks of the backbone by position. Blocks are numbered in network order; a
stage is a run of blocks at one resolution (see `spec.blocks.BlockLayout`). Each selector is a small pydantic
model registered under its one YAML key, with a `resolve(layout)` that returns global block indices or raises
`SelectorError` listing what exists.

    {every: 2}                    blocks i with (i + 1) % 2 == 0
    {stage_every: 2}              the same within each stage: block j of a stage with (j + 1) % 2 == 0
    {last: 2} / {first: 2}        the last / first 2 blocks
    {blocks: [0, -1]}             explicit indices, negatives count from the end
    {stage_last: 2}               the final block of each of the last 2 stages ("all": every stage)
    {stages: {2: [4, -1]}}        per-stage block indices
    [sel, sel, ...]               the union
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag

from .blocks import BlockLayout
from .fields import IntRange
from .registry import SELECTORS, register_selector

MAX_BLOCKS = 4_096
"""Selector counts and indices stay within +-4,096 blocks (or stages): 40 x the deepest timm backbones, which
have about 100 residual blocks."""
BlockCount = IntRange(1, MAX_BLOCKS)
BlockIndex = IntRange(-MAX_BLOCKS, MAX_BLOCKS - 1, strict=False)


class SelectorError(ValueError):
    """A selector that does not fit the backbone's blocks."""


class Selector(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    FORM: ClassVar[str] = ""  # how it is written, for error messages

    def resolve(self, layout: BlockLayout) -> list[int]:
        raise NotImplementedError


def _check_index(index: int, count: int, what: str) -> int:
    if not -count <= index < count:
        raise SelectorError(f"{what} index {index} is out of range; valid: 0..{count - 1} or -{count}..-1")
    return index % count


@register_selector("every")
class Every(Selector):
    """Every N-th block: blocks i with (i + 1) % N == 0 (1, 3, 5, ... for N = 2)."""

    FORM: ClassVar[str] = "{every: N}"

    every: BlockCount

    def resolve(self, layout: BlockLayout) -> list[int]:
        return [i for i in range(len(layout.blocks)) if (i + 1) % self.every == 0]


@register_selector("last")
class Last(Selector):
    """The last N blocks."""

    FORM: ClassVar[str] = "{last: N}"

    last: BlockCount

    def resolve(self, layout: BlockLayout) -> list[int]:
        count = len(layout.blocks)
        if self.last > count:
            raise SelectorError(f"last: {self.last} asks for more blocks than the model has ({count}); use 1..{count}")
        return list(range(count - self.last, count))


@register_selector("first")
class First(Selector):
    """The first N blocks."""

    FORM: ClassVar[str] = "{first: N}"

    first: BlockCount

    def resolve(self, layout: BlockLayout) -> list[int]:
        count = len(layout.blocks)
        if self.first > count:
            raise SelectorError(f"first: {self.first} asks for more blocks than the model has ({count}); "
                                f"use 1..{count}")
        return list(range(self.first))


@register_selector("blocks")
class Blocks(Selector):
    """Explicit global block indices; negatives count from the end."""

    FORM: ClassVar[str] = "{blocks: [i, ...]}"

    blocks: Annotated[list[BlockIndex], Field(min_length=1)]

    def resolve(self, layout: BlockLayout) -> list[int]:
        return [_check_index(i, len(layout.blocks), "block") for i in self.blocks]


@register_selector("stage_last")
class StageLast(Selector):
    """The final block of each of the last N stages (`all`: of every stage)."""

    FORM: ClassVar[str] = "{stage_last: N | all}"

    stage_last: Union[BlockCount, Literal["all"]]

    def resolve(self, layout: BlockLayout) -> list[int]:
        count = len(layout.stages)
        n = count if self.stage_last == "all" else self.stage_last
        if n > count:
            raise SelectorError(f"stage_last: {n} asks for more stages than the model has ({count}); use 1..{count} "
                                f"or all")
        return [stage[-1] for stage in layout.stages[count - n :]]


@register_selector("stages")
class Stages(Selector):
    """Block indices within stages: {stage: [block, ...]}; negatives count from the end."""

    FORM: ClassVar[str] = "{stages: {stage: [i, ...]}}"

    stages: Annotated[dict[BlockIndex, Annotated[list[BlockIndex], Field(min_length=1)]],
                      Field(min_length=1, json_schema_extra={"propertyNames": {"pattern": "^-?[0-9]+$"}})]

    def resolve(self, layout: BlockLayout) -> list[int]:
        picked = []
        for stage_index, block_indices in self.stages.items():
            stage = layout.stages[_check_index(stage_index, len(layout.stages), "stage")]
            picked += [stage[_check_index(i, len(stage), f"stage {stage_index} block")] for i in block_indices]
        return picked


@register_selector("stage_every")
class StageEvery(Selector):
    """Every N-th block of each stage, counted from the stage's first block: blocks j of a stage with
    (j + 1) % N == 0. The sweet-spot study's "Every 2" on ConvNeXt-T (stages of 3, 3, 9, 3 blocks): 1, 1,
    1 3 5 7, 1, 7 layers; `{every: 2}` counts across the stages (9 layers). On a single-stage model the two
    agree, as every stage selector sees its one stage (`{stage_last: 1}`: the last block)."""

    FORM: ClassVar[str] = "{stage_every: N}"

    stage_every: BlockCount

    def resolve(self, layout: BlockLayout) -> list[int]:
        return [block for stage in layout.stages for j, block in enumerate(stage) if (j + 1) % self.stage_every == 0]


def _selector_tag(value: Any) -> str | None:
    if isinstance(value, dict) and len(value) == 1:
        key = next(iter(value))
        return key if key in SELECTORS else None
    if isinstance(value, Selector):
        return next(k for k, cls in SELECTORS.items() if isinstance(value, cls))
    return None


def where_type() -> Any:
    """The type of a `where:` field over the selectors registered now: one selector (chosen by its single key)
    or a list of them, stored as a list (their union)."""
    forms = ", ".join(cls.FORM for cls in SELECTORS.values())
    one = Annotated[
        Union[tuple(Annotated[cls, Tag(key)] for key, cls in SELECTORS.items())],  # type: ignore[misc]
        Discriminator(_selector_tag, custom_error_type="selector",
                      custom_error_message=f"a selector is one of {forms}, or a list of them"),
    ]
    return Annotated[list[one], BeforeValidator(lambda value: value if isinstance(value, list) else [value],
                                                json_schema_input_type=Union[one, list[one]]),
                     Field(min_length=1)]


def resolve_where(where: list[Selector], layout: BlockLayout) -> list[int]:
    """The sorted union of the blocks picked by a list of selectors."""
    picked: set[int] = set()
    for selector in where:
        picked.update(selector.resolve(layout))
    if not picked:
        raise SelectorError(f"matches no block; the model has {layout.describe()}")
    return sorted(picked)
