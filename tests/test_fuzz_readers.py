"""Fuzzing the two readers of user files: whatever the bytes, the YAML loader raises only
ConfigError and the dataset reader only DatasetError, and what they return is well formed."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor.core.config import ConfigError, InferenceConfig, load_config
from executor.core.config.sections import SECTIONS
from executor.offline.dataset import DatasetError, PromptRecord, load_prompts

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4)
    ),
    max_leaves=12,
)

# Real section and key names most of the time, so that fuzzing gets past "unknown section".
section_names = st.one_of(st.sampled_from(sorted(SECTIONS)), st.text(max_size=8))
config_keys = st.one_of(
    st.sampled_from(sorted({key for cls in SECTIONS.values() for key in cls.__dataclass_fields__})), st.text(max_size=8)
)
config_documents = st.dictionaries(
    section_names, st.one_of(st.dictionaries(config_keys, values, max_size=4), values), max_size=4
)


def read_as_file(reader: Callable[[Path], Any], error_type: type[Exception], name: str, data: bytes) -> Any:
    """`reader(path)` on a file holding `data`; None when it raised its own error: one line per problem
    (a ConfigError with several problems lists them under one heading line)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / name
        path.write_bytes(data)
        try:
            return reader(path)
        except error_type as exc:
            problems = getattr(exc, "problems", [str(exc)])
            assert all("\n" not in problem for problem in problems), "each problem is one line"
            assert str(exc).count("\n") == (0 if len(problems) == 1 else len(problems))
            return None


def load_config_from(data: bytes) -> InferenceConfig | None:
    return read_as_file(load_config, ConfigError, "run.yaml", data)


@FUZZ
@given(st.binary(max_size=300))
def test_yaml_loader_raises_only_config_error_for_any_bytes(data):
    load_config_from(data)


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("ab:{}[]-,&*!|>'\"#%@` \n\t.0123456789_")), max_size=120))
def test_yaml_loader_raises_only_config_error_for_yaml_like_text(text):
    load_config_from(text.encode())


@FUZZ
@given(config_documents)
def test_yaml_loader_raises_only_config_error_for_any_structure(document):
    config = load_config_from(yaml.safe_dump(document, allow_unicode=True).encode())
    assert config is None or isinstance(config, InferenceConfig)


prompt_fields = st.fixed_dictionaries(
    {},
    optional={
        "id": values,
        "prompt": st.one_of(st.text(max_size=10), values),
        "messages": st.one_of(
            st.lists(st.dictionaries(st.sampled_from(["role", "content", "name"]), values, max_size=3), max_size=3),
            values,
        ),
        "prompt_token_ids": st.one_of(st.lists(st.integers(min_value=-5, max_value=2**70), max_size=4), values),
        "extra": values,
    },
)


def load_prompts_from(data: bytes) -> list[PromptRecord] | None:
    records = read_as_file(load_prompts, DatasetError, "prompts.jsonl", data)
    if records is None:
        return None
    for record in records:  # every record is servable or says why not
        fields = (record.prompt, record.messages, record.prompt_token_ids)
        assert sum(f is not None for f in fields) == (0 if record.error else 1)
    assert len({record.id for record in records}) == len(records)
    return records


@FUZZ
@given(st.binary(max_size=300))
def test_dataset_reader_raises_only_dataset_error_for_any_bytes(data):
    load_prompts_from(data)


@FUZZ
@given(st.lists(prompt_fields, min_size=1, max_size=5))
def test_dataset_reader_raises_only_dataset_error_for_any_json_lines(objects):
    lines = [json.dumps(obj, allow_nan=True) for obj in objects]
    load_prompts_from(("\n".join(lines) + "\n").encode())
