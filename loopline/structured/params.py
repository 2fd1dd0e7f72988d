"""``StructuredOutputsParams``: what a request's output must match (vLLM's shape and names)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from loopline.errors import InvalidRequestError, check_object

# Bounds on what one request may ask the grammar compiler to build (a schema or grammar compiles on the host).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text), ``regex``, ``choice`` (a list of
    strings), ``grammar`` (EBNF / GBNF text), ``json_object=True`` (any JSON object). ``whitespace_pattern``
    optionally sets the whitespace a JSON output may use; ``disable_any_whitespace`` allows none."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or json_object, got "
                f"{kinds or 'none'}", param="structured_outputs")
        if self.json is not None:
            if isinstance(self.json, str):
                _bounded("structured_outputs.json", self.json)
                try:
                    self.json = json.loads(self.json)
                except ValueError as e:
                    raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}",
                                              param="structured_outputs.json") from e
            if not isinstance(self.json, (dict, bool)):
                raise InvalidRequestError(f"structured_outputs.json must be a JSON schema (an object), got "
                                          f"{type(self.json).__name__}", param="structured_outputs.json")
            _bounded("structured_outputs.json", json.dumps(self.json))
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.60}",
                                              param=f"structured_outputs.{name}")
                _bounded(f"structured_outputs.{name}", value)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError(f"structured_outputs.choice must be a list of 1 to {MAX_CHOICES} non-empty "
                                          "strings", param="structured_outputs.choice")
            self.choice = list(self.choice)
            _bounded("structured_outputs.choice", "".join(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("structured_outputs.disable_any_whitespace must be a boolean",
                                      param="structured_outputs.disable_any_whitespace")

    @property
    def kind(self) -> str:
        """Which constraint it is: ``json``, ``regex``, ``choice``, ``grammar`` or ``json_object``."""
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams:
        """From a request's ``structured_outputs`` object; unknown keys are refused, naming them."""
        if isinstance(data, cls):
            return data
        check_object(data, cls, "structured_outputs")
        return cls(**data)


def _bounded(name: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"{name} must be at most {MAX_SPEC_CHARS} characters, got {len(text)}", param=name)
