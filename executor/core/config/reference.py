"""Renders docs/configuration.md's key tables from the section classes, so the doc cannot drift.

python -m executor.core.config.reference  # prints the tables that docs/configuration.md holds
python -m executor.core.config.reference flat  # the flattened schema's tables

Each row's outcome column starts with the outcome (`used`, `not applicable`, `refused unless
<values>`), then the reason: tests read it back to check what the loader does with each key.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any

from executor.core.config.flat_schema import FLAT_SECTIONS, TOP_LEVEL
from executor.core.config.sections import NESTED, NOT_APPLICABLE, REFUSED, SECTIONS


def _rule_text(metadata: Mapping[str, Any]) -> str:
    parts = []
    if "choices" in metadata:
        parts.append("one of " + ", ".join(f"`{c}`" for c in metadata["choices"]))
    if "min" in metadata:
        parts.append(f">= {metadata['min']}")
    if "above" in metadata:
        parts.append(f"> {metadata['above']}")
    if "max" in metadata:
        parts.append(f"<= {metadata['max']}")
    if metadata.get("npu_only"):
        parts.append("NPU only (logged as not applicable elsewhere)")
    return "; ".join(parts)


def outcome_text(metadata: Mapping[str, Any]) -> str:
    outcome = metadata["outcome"]
    if outcome == REFUSED:
        values = ", ".join(f"`{value!r}`" for value in metadata["runs_with"])
        return f"refused unless {values}: {metadata['reason']}"
    if outcome == NOT_APPLICABLE:
        return f"not applicable: {metadata['reason']}"
    return outcome


def _meaning(metadata: Mapping[str, Any]) -> str:
    """The help text; a flattened key's names the sectioned key it is read as, and how its values map."""
    help_text = metadata.get("help", "")
    if "maps_to" not in metadata:
        return help_text
    values = ", ".join(f"`{v!r}` as `{target!r}`" for v, target in metadata.get("values", {}).items())
    return "; ".join(part for part in (f"read as `{metadata['maps_to']}`", values, help_text) if part)


def _table(heading: str, keys_cls: type) -> list[str]:
    lines = [heading, "", "| key | default | rule | outcome | meaning |", "|---|---|---|---|---|"]
    for f in dataclasses.fields(keys_cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        cells = (f"`{f.name}`", f"`{default!r}`", _rule_text(f.metadata), outcome_text(f.metadata))
        lines.append(f"| {' | '.join(cells)} | {_meaning(f.metadata)} |")
    return [*lines, ""]


def render_key_tables() -> str:
    lines: list[str] = []
    for name, section_cls in SECTIONS.items():
        lines += _table(f"### `{name}`", section_cls)
    for name, keys_cls in NESTED.items():
        lines += _table(f"### `{name}`", keys_cls)
    return "\n".join(lines)


def render_flat_key_tables() -> str:
    """The flattened schema's tables: headed `flattened top level`, `flattened <section>`."""
    lines: list[str] = []
    for name, keys_cls in FLAT_SECTIONS.items():
        lines += _table("### flattened " + ("top level" if name == TOP_LEVEL else f"`{name}`"), keys_cls)
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_flat_key_tables() if sys.argv[1:] == ["flat"] else render_key_tables())
