"""The parameters of a structured-output constraint (plain data, no torch, no grammar library).

:mod:`loraplex.engine.structured_output` compiles them with xgrammar; this module stays light so
that ``SamplingParams`` (and ``import loraplex``) import nothing heavy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled (bad JSON schema, regex or grammar, or no xgrammar)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's ``StructuredOutputsParams``); set exactly one of:

    - ``json``: a JSON schema (dict or JSON text); the output is one JSON value valid under it.
    - ``json_object``: True: the output is any JSON object (OpenAI ``{"type": "json_object"}``).
    - ``regex``: the output matches this regular expression (whole output).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: an EBNF grammar in xgrammar's GBNF dialect (root rule ``root``).

    ``any_whitespace``: JSON may contain free whitespace between tokens (default
    False: compact JSON). ``strict`` (JSON schema only): properties not in the
    schema are refused (xgrammar strict mode; default True, as OpenAI ``strict``).
    Raises ``ValueError`` naming the field when zero or several are set or a value is malformed.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    any_whitespace: bool = False
    strict: bool = True
    _key: tuple[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams: exactly one of json, json_object, regex, choice, grammar "
                             f"must be set (got {given or 'none'})")
        kind = given[0]
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"StructuredOutputsParams.json: not valid JSON ({exc})") from None
                except RecursionError:
                    raise ValueError("StructuredOutputsParams.json: nested too deeply to parse") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"StructuredOutputsParams.json: a JSON schema is an object, got {type(schema).__name__}")
            object.__setattr__(self, "json", schema)
            try:
                text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
            except RecursionError:
                raise ValueError("StructuredOutputsParams.json: nested too deeply") from None
        elif kind == "choice":
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice: must be a non-empty list of non-empty strings")
            text = json.dumps(self.choice)
        elif kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise ValueError(f"StructuredOutputsParams.{kind}: must be a non-empty string")
        else:
            text = ""
        object.__setattr__(self, "_key", (f"{kind}|ws={int(self.any_whitespace)}|strict={int(self.strict)}", text))

    @property
    def kind(self) -> str:
        """``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        return self._key[0].split("|", 1)[0]

    @property
    def cache_key(self) -> tuple[str, str]:
        """(kind and options, canonical constraint text): equal keys compile to the same grammar."""
        return self._key
