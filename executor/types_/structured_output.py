"""What a request's output must match (structured output), as plain data: the kind of constraint
and its text, read from the names vLLM and OpenAI give them. Compiling it (xgrammar) is the
sampler's business (executor/core/sampler/structured_output.py); this module knows no library."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# vLLM's per-request names (its older `guided_*` fields and the keys of its `structured_outputs`)
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "grammar", "json_object")
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """One request's constraint: `kind` in KINDS; `value` the JSON schema (as JSON text), the
    regular expression, the EBNF grammar, the choices, or "" for any JSON object (json_object).
    Frozen and hashable, so that a compiled grammar can be cached on it."""

    kind: str
    value: str | tuple[str, ...]

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind

    def describe(self) -> str:
        """A short name for logs: the kind and the first characters of the constraint."""
        text = " | ".join(self.value) if isinstance(self.value, tuple) else self.value
        return f"{self.kind} {text[:60]!r}" if text else self.kind


def parse_structured_output(fields: Mapping[str, Any]) -> StructuredOutputSpec | None:
    """The constraint that `fields` (a dataset line, data_config, or a server body) asks for, or None.

    Exactly one of guided_json, guided_regex, guided_choice, guided_grammar and structured_outputs
    (a mapping with one of json, regex, choice, grammar, json_object: true) may be set. A value of the
    wrong type raises ValueError naming the key."""
    given = [key for key in (*GUIDED_FIELDS, "structured_outputs") if fields.get(key) not in (None, "", [], {})]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give at most one of {list(GUIDED_FIELDS) + ['structured_outputs']}, got {given}")
    key = given[0]
    value = fields[key]
    if key == "structured_outputs":
        if not isinstance(value, Mapping):
            raise ValueError(f"'structured_outputs' must be a mapping, got {type(value).__name__}")
        inner = [k for k in STRUCTURED_OUTPUTS_KEYS if value.get(k) not in (None, "", [], {}, False)]
        unknown = sorted(set(value) - set(STRUCTURED_OUTPUTS_KEYS))
        if unknown:
            raise ValueError(
                f"'structured_outputs' has unknown key(s) {unknown}; allowed: {list(STRUCTURED_OUTPUTS_KEYS)}"
            )
        if len(inner) != 1:
            raise ValueError(
                f"'structured_outputs' must set exactly one of {list(STRUCTURED_OUTPUTS_KEYS)}, got {inner}"
            )
        kind = inner[0]
        if kind == "json_object":
            return StructuredOutputSpec("json_object", "")
        return _spec(kind, value[kind], f"'structured_outputs'.{kind}")
    return _spec(key.removeprefix("guided_"), value, repr(key))


def response_format_spec(response_format: Mapping[str, Any] | None) -> StructuredOutputSpec | None:
    """OpenAI's `response_format`: {type: text} (no constraint), {type: json_object} (any JSON
    object) or {type: json_schema, json_schema: {name, schema, strict}}."""
    if response_format is None:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputSpec("json_object", "")
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, Mapping) or "schema" not in body:
            raise ValueError("response_format.json_schema must be an object with a 'schema'")
        return _spec("json", body["schema"], "response_format.json_schema.schema")
    raise ValueError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")


def _spec(kind: str, value: Any, where: str) -> StructuredOutputSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{where} is not valid JSON: {exc}") from None
        if not isinstance(value, (Mapping, bool)):
            raise ValueError(f"{where} must be a JSON schema (an object), got {type(value).__name__}")
        return StructuredOutputSpec("json", json.dumps(value, sort_keys=True))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{where} must be a non-empty list of non-empty strings, got {value!r}")
        return StructuredOutputSpec("choice", tuple(value))
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where} must be a non-empty string, got {value!r}")
    return StructuredOutputSpec(kind, value)
