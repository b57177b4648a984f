"""The JSON Schema of spec files, generated from the spec models (`moespec schema`, `spec.schema.json`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .models import Spec

SCHEMA_FILE = Path(__file__).parent.parent / "spec.schema.json"
"""The committed JSON Schema (`moespec schema` writes it); shipped specs point editors at it."""


def json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a spec file, generated from the pydantic models. Editors use it to
    complete and check specs; checks that span fields (top_k <= experts, ...) are only in `load_spec`.
    Definitions are named by their title, the name users see (`RescaleSpec` is `Rescale`)."""
    schema = Spec.model_json_schema()
    names = {name: definition.get("title", name) for name, definition in schema.get("$defs", {}).items()}
    schema = _renamed(schema, names)
    schema["$defs"] = {names[name]: definition for name, definition in schema.get("$defs", {}).items()}
    schema["$defs"] = dict(sorted(schema["$defs"].items()))
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema, "title": "moespec spec"}


def _renamed(node: Any, names: dict[str, str]) -> Any:
    """`node` with every `$ref` to `#/$defs/{old}` pointing at `#/$defs/{names[old]}`."""
    if isinstance(node, dict):
        return {key: (f"#/$defs/{names[value.removeprefix('#/$defs/')]}" if key == "$ref" else _renamed(value, names))
                for key, value in node.items()}
    if isinstance(node, list):
        return [_renamed(item, names) for item in node]
    return node


def json_schema_text() -> str:
    """`json_schema()` as the text of `spec.schema.json`."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"
