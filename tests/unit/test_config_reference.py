"""docs/config.md is the config models' reference: every key described, the page regenerated."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from cdcd.config import LogConfig
from cdcd.configref import reference, undocumented

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_every_key_has_a_description() -> None:
    assert undocumented() == []


def test_docs_config_md_is_the_models_reference() -> None:
    assert DOC.read_text() == reference(), "regenerate it: .venv/bin/python -m cdcd.configref > docs/config.md"


def test_a_key_added_without_a_description_is_caught() -> None:
    class Extended(LogConfig):
        colour: bool = Field(default=False)

    assert undocumented(Extended, "log.") == ["log.colour"]
