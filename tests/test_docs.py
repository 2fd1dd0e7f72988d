"""Docs stay true: every engine option is documented."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from loopline.config import EngineArgs

ROOT = Path(__file__).resolve().parents[1]


def test_every_engine_option_is_documented():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [f.name for f in dataclasses.fields(EngineArgs) if f"`{f.name}`" not in text]
    assert not missing, f"document these EngineArgs fields in docs/configuration.md: {missing}"


def test_readme_has_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[dev]" && loopline generate' in readme
    assert "python -m pytest -q" in readme
