"""Renders docs/configuration.md's key tables from the section classes, so the doc cannot drift.

python -m executor.core.config.reference  # prints the tables that docs/configuration.md holds
"""

from __future__ import annotations

import dataclasses

from executor.core.config.sections import SECTIONS


def _rule_text(metadata: dict) -> str:
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
        parts.append("NPU only (logged as unused elsewhere)")
    return "; ".join(parts)


def render_key_tables() -> str:
    lines: list[str] = []
    for name, section_cls in SECTIONS.items():
        lines += [f"### `{name}`", "", "| key | default | rule | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(section_cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            lines.append(
                f"| `{f.name}` | `{default!r}` | {_rule_text(dict(f.metadata))} | {f.metadata.get('help', '')} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render_key_tables())
