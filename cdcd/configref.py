"""The configuration reference, rendered from the config models: ``docs/config.md`` is this module's output
(``python -m cdcd.configref > docs/config.md``), and a test fails when the two differ or a key has no
description, so the reference cannot drift from the code."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from cdcd.config import Config

HEADER = """# Configuration reference

Generated from the config models in `cdcd/config.py` by `python -m cdcd.configref > docs/config.md`;
a test fails when a key is added without a description or this page is not regenerated. The examples
in `config/` show a whole file with comments. Any key can be overridden by an environment variable
`CDCD_SECTION__KEY` (`CDCD_SOURCE__POSTGRES__SLOT=cdcd_orders`); unknown keys, wrong types and missing
required keys are errors that name the key.
"""


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def type_name(annotation: Any) -> str:
    """A key's type as an operator reads it."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(named) + (" (optional)" if type(None) in args else "")
    if origin is list:
        inner = args[0]
        section = _section(inner)
        return f"list of {{{', '.join(section.model_fields)}}}" if section else f"list of {type_name(inner)}"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Path: "path",
             SecretStr: "string (secret)"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, list):
        value = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    return f"`{json.dumps(value, default=str)}`"


def undocumented(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every key (``section.key``) without a description, at any depth."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if not (field.description or "").strip():
            out.append(key)
        annotation = field.annotation
        nested = _section(annotation) or (_section(typing.get_args(annotation)[0])
                                          if typing.get_origin(annotation) is list else None)
        if nested is not None:
            out += undocumented(nested, f"{key}.")
    return out


def _table(model: type[BaseModel], prefix: str, sections: list[tuple[str, type[BaseModel], str]]) -> list[str]:
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        if section is not None:
            sections.append((f"{prefix}{name}", section, field.description or ""))
            continue
        meaning = " ".join((field.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{name}` | {type_name(field.annotation)} | {default_text(field)} | {meaning} |")
        if typing.get_origin(field.annotation) is list and _section(typing.get_args(field.annotation)[0]):
            item = _section(typing.get_args(field.annotation)[0])
            assert item is not None
            for sub, sub_field in item.model_fields.items():
                sub_meaning = " ".join((sub_field.description or "").split()).replace("|", "\\|")
                rows.append(f"| `{name}[].{sub}` | {type_name(sub_field.annotation)} | {default_text(sub_field)} "
                            f"| {sub_meaning} |")
    return rows


def reference() -> str:
    """docs/config.md."""
    out = [HEADER]
    pending: list[tuple[str, type[BaseModel], str]] = []
    for name, field in Config.model_fields.items():
        section = _section(field.annotation)
        assert section is not None, f"top-level key {name} is not a section"
        pending.append((name, section, field.description or ""))
    while pending:
        name, model, description = pending.pop(0)
        nested: list[tuple[str, type[BaseModel], str]] = []
        out += [f"## [{name}]", "", " ".join(description.split()), "", *_table(model, f"{name}.", nested), ""]
        pending[0:0] = nested  # a section's subsections follow it
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(reference(), end="")
