"""Read a run's YAML file into a mapping, refusing what PyYAML would silently accept or explain badly.

PyYAML keeps the last of two equal keys, so a section written twice loses the first one's keys
without a word; here that is an error with both line numbers. Bytes that are not UTF-8 and YAML
syntax errors become one-line ConfigErrors naming the file, line and column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from executor.core.config.errors import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"


def load_yaml_mapping(path: Path) -> dict[str, Any]:
    """The file's top-level mapping ({} for an empty file); any problem is a ConfigError naming the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    text = _decode_utf8(data, path)
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _check_no_duplicate_keys(root, path, prefix="", visited=set())
        raw = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {_one_line(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise ConfigError(f"{path} is nested too deeply to be a run config") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def _decode_utf8(data: bytes, path: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - line_start + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 (byte 0x{data[exc.start]:02x} at column {column}); save the file as UTF-8"
        ) from None


def _one_line(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    what = " ".join(str(part) for part in (exc.context, exc.problem) if part)
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark else what


def _check_no_duplicate_keys(node: Node, path: Path, prefix: str, visited: set[int]) -> None:
    """Walk the composed document; two equal scalar keys in one mapping are an error with both lines.

    `visited` holds the nodes already walked: aliases share nodes, and a file of nested aliases
    must not cost exponential time.
    """
    if id(node) in visited:
        return
    visited.add(id(node))
    if isinstance(node, SequenceNode):
        for item in node.value:
            _check_no_duplicate_keys(item, path, prefix, visited)
        return
    if not isinstance(node, MappingNode):
        return
    first: dict[tuple[str, str], Node] = {}
    for key_node, value_node in node.value:
        if isinstance(key_node, ScalarNode) and key_node.tag != _MERGE_TAG:
            earlier = first.setdefault((key_node.tag, key_node.value), key_node)
            if earlier is not key_node:
                kind = "section" if not prefix else "key"
                raise ConfigError(
                    f"{path}:{key_node.start_mark.line + 1}: duplicate {kind} {prefix}{key_node.value} "
                    f"(first on line {earlier.start_mark.line + 1}); YAML would keep only the last one"
                )
            _check_no_duplicate_keys(value_node, path, f"{prefix}{key_node.value}.", visited)
        else:
            _check_no_duplicate_keys(value_node, path, prefix, visited)
