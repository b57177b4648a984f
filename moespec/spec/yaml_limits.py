"""Limits on the YAML a spec may be, checked before anything is built from it.

A spec is a few kB of a few hundred values. YAML aliases let 0.5 kB stand for billions of values ("billion
laughs": each level repeats the previous one nine times), and 10,000 nested `[` make every recursive walker
(PyYAML's composer, our position recorder, pydantic) overflow the stack. So the loader below composes the node
tree with a budget: aliased nodes are shared, not copied, and it adds each alias's full expanded size and
height to the running totals as it meets it, refusing at that alias. PyYAML builds Python objects only from
a composed tree, so a refused document is never constructed, and everything that walks the data later
(positions, validation, the problem finder) walks at most `MAX_YAML_NODES` values `MAX_YAML_DEPTH` deep.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_SPEC_BYTES = 1_000_000
"""Spec files and embedded spec texts above 1 MB are refused unread; the largest shipped spec is under 1 kB."""

MAX_YAML_NODES = 10_000
"""Values (scalars, lists, mappings; each alias counted at its expanded size) a spec may have; the largest
shipped spec (`sparse_mlp_l.yaml`) has 76."""

MAX_YAML_DEPTH = 32
"""Nesting a spec may have (aliases expanded); the deepest shipped spec has 8 levels
(`moe.0.where.1.stages.2.0` of `convnext_t_moe8_last3_top1.yaml`, the document its first)."""


class YamlLimitError(yaml.MarkedYAMLError):
    """A document over a limit, at the node (or alias) where it went over."""


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing documents with over `MAX_YAML_NODES` expanded values or nested deeper
    than `MAX_YAML_DEPTH` while it composes them."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._values = 0  # expanded values so far
        self._depth = 0  # open collections around the node being composed
        self._open: list[str | None] = []  # anchors of those collections
        self._shape: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded values, expanded height)

    def compose_node(self, parent: Any, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open:
                raise YamlLimitError(problem=f"the alias *{event.anchor} is inside the value it names (a recursive "
                                             f"alias); write the value out", problem_mark=event.start_mark)
            node = super().compose_node(parent, index)  # the anchored node itself, shared
            values, height = self._shape[id(node)]
            self._spend(values, height, event.start_mark, f"the alias *{event.anchor}")
            return node
        self._spend(1, 1, event.start_mark, "this value")
        self._depth += 1
        self._open.append(event.anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open.pop()
        children = [self._shape[id(child)] for child in _children(node)]
        values, height = sum(v for v, _ in children), max((h for _, h in children), default=0)
        self._shape[id(node)] = (1 + values, 1 + height)
        return node

    def _spend(self, values: int, height: int, mark: yaml.Mark, what: str) -> None:
        """Count `values` more values, `height` levels below the current depth; refuse past a limit."""
        self._values += values
        if self._values > MAX_YAML_NODES:
            raise YamlLimitError(problem=f"{what} takes the spec past {MAX_YAML_NODES:,} values (YAML aliases count "
                                         f"at their expanded size); a spec needs far fewer, refusing to expand it",
                                 problem_mark=mark)
        if self._depth + height > MAX_YAML_DEPTH:
            raise YamlLimitError(problem=f"{what} nests the spec deeper than {MAX_YAML_DEPTH} levels (YAML aliases "
                                         f"count at their expanded depth); a spec needs fewer than 10",
                                 problem_mark=mark)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []
