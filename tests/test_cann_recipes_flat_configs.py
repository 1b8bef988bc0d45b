"""cann-recipes-infer's flattened-schema YAML (glm_5_2, kimi_k3, pangu_7b) runs as it is: every key its
files use has the outcome docs/configuration.md's flattened tables give it, a file is read as the
sectioned file it stands for, and a file mixing the two schemas is refused in one line. Checked on
our own files in tests/data/cann_recipes_flat/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from executor.core.config import ConfigError, build_config, load_config
from executor.core.config.flat_schema import FLAT_SECTIONS
from executor.core.config.inference_config import not_applicable_keys
from executor.core.config.sections import NESTED, SECTIONS
from tests.test_cann_recipes_configs import doc_outcomes, refused_keys, value_of

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "tests" / "data" / "cann_recipes_flat").glob("*.yaml"))

# Every key that cann-recipes-infer's flattened-schema files (models/glm_5_2, kimi_k3, pangu_7b) set, as
# found in its repository; "" is the top level.
CANN_FLAT_KEYS = {
    "": "model_name model_path draft_model_path exe_mode world_size",
    "model_config": (
        "custom_params draft_model_type enable_cache_compile enable_multi_streams enable_offload "
        "enable_online_split_weight enable_profiler enable_static_kernel enable_weight_nz enlarge_pool_size "
        "gmm_quant_mode mm_quant_mode next_n pa_block_size perfect_eplb platform_version prefill_mini_batch_size "
        "shared_indexer_offload skip_warm_up tokenizer_mode with_ckpt"
    ),
    "model_config.custom_params": (
        "attn_res_mode enable_flash_kda enable_fused_recurrent_kda enable_mega_moe enable_moe_bf16_mode "
        "enable_multi_streams moe_chunk_max_len"
    ),
    "data_config": "batch_size dataset input_max_len max_new_tokens temperature",
    "parallel_config": "attn_tp_size cp_size dense_tp_size embed_tp_size lmhead_tp_size moe_tp_size oproj_tp_size",
}

FLAT = """\
model_name: "deepseek_v3"
model_path: "/models/tiny"
exe_mode: "acl_graph"
world_size: 2
model_config:
  pa_block_size: 64
  with_ckpt: False
  enable_multi_streams: True
  tokenizer_mode: "default"
  custom_params:
    num_hidden_layers: 2
data_config:
  dataset: "default"
  input_max_len: 100
  max_new_tokens: 7
  batch_size: 4
  temperature: 0.5
parallel_config:
  attn_tp_size: 2
  oproj_tp_size: 2
"""

SECTIONED = """\
model_config:
  model_name: "deepseek_v3"
  model_path: "/models/tiny"
  exe_mode: "npugraph_ex"
  with_ckpt: False
  custom_params:
    num_hidden_layers: 2
    enable_multi_streams: True
data_config:
  dataset: "default"
  input_truncated_len: 100
  temperature: 0.5
  apply_chat_template: False
parallel_config:
  world_size: 2
  attn_tp_size: 2
  o_proj_tp_size: 2
scheduler_config:
  block_size: 64
  max_new_tokens: 7
  batch_size: 4
"""


def flat_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """`flat.key` (top level) and `flat.section.key` -> value for every key a file sets, custom_params' included."""
    keys: dict[str, Any] = {}
    for name, value in raw.items():
        if name not in FLAT_SECTIONS:
            keys[f"flat.{name}"] = value
            continue
        for key, inner in value.items():
            keys[f"flat.{name}.{key}"] = inner
            if key == "custom_params":
                keys |= {f"flat.{name}.custom_params.{k}": v for k, v in inner.items()}
    return keys


def documented(outcomes: dict[str, Any], key: str) -> Any:
    """A flattened key's row; custom_params' keys are those of the sectioned custom_params table."""
    return outcomes.get(key) or outcomes[key.removeprefix("flat.")]


def meta(key: str) -> dict[str, Any]:
    """The flat_schema.py field metadata of `flat.key` or `flat.section.key`."""
    prefix, _, name = key.removeprefix("flat.").rpartition(".")
    return FLAT_SECTIONS[prefix].__dataclass_fields__[name].metadata


def test_the_data_files_use_every_key_cann_recipes_flattened_files_use():
    used: set[str] = set()
    for path in FILES:
        used |= set(flat_keys(yaml.safe_load(path.read_text())))
    expected = {".".join(("flat", *filter(None, [s]), k)) for s, keys in CANN_FLAT_KEYS.items() for k in keys.split()}
    assert expected <= used, sorted(expected - used)
    assert [path.stem for path in FILES] == ["glm_5_2", "kimi_k3", "pangu_7b"]


def test_every_flattened_key_has_an_outcome_in_the_docs_and_a_sectioned_target_that_exists():
    outcomes = doc_outcomes()
    for section, keys in CANN_FLAT_KEYS.items():
        for key in keys.split():
            documented(outcomes, ".".join(("flat", *filter(None, [section]), key)))
    for prefix, keys_cls in FLAT_SECTIONS.items():
        hints = keys_cls.__annotations__
        for name, f in keys_cls.__dataclass_fields__.items():
            if "maps_to" in f.metadata and "values" not in f.metadata:
                target_prefix, _, target = f.metadata["maps_to"].rpartition(".")
                target_cls = SECTIONS.get(target_prefix) or NESTED[target_prefix]
                assert hints[name] == target_cls.__annotations__[target], (prefix, name)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_each_key_of_a_flattened_file_has_its_documented_outcome(path):
    outcomes = doc_outcomes()
    raw = yaml.safe_load(path.read_text())
    should_refuse = refused_keys(flat_keys(raw), lambda key: documented(outcomes, key))
    problems: list[str] = []
    try:
        load_config(path)
    except ConfigError as exc:
        problems = exc.problems
    # Every refusal is reported at once, one line each, under the name the file wrote, and nothing else.
    assert len(problems) == len(should_refuse), problems
    for key, outcome in should_refuse.items():
        (line,) = [p for p in problems if f"{key.removeprefix('flat.')} in {path} is refused" in p]
        assert outcome.reason in line

    for key, outcome in should_refuse.items():
        *parents, name = key.removeprefix("flat.").split(".")
        target = raw
        for part in parents:
            target = target[part]
        target[name] = outcome.runs_with[0]
    config = build_config(raw, source=str(path))
    logged = dict(not_applicable_keys(config, "npu"))
    for key, value in flat_keys(raw).items():
        if key.startswith("flat.model_config.custom_params."):
            key_meta: dict[str, Any] = {"maps_to": key.removeprefix("flat.")}
        elif key == "flat.model_config.custom_params":
            continue
        else:
            key_meta = dict(meta(key))
        target = key_meta.get("maps_to")
        name = target or key.removeprefix("flat.")
        if documented(outcomes, key).outcome == "not applicable":
            assert logged.get(name) == documented(outcomes, key).reason, key
        elif target is None:  # a refused key of its own, at the value that runs: nothing to read
            assert documented(outcomes, key).outcome == "refused", key
        else:
            assert value_of(config, target) == key_meta.get("values", {}).get(value, value), key


def test_a_flattened_file_builds_the_config_of_the_sectioned_file_it_stands_for(tmp_path):
    (tmp_path / "flat.yaml").write_text(FLAT)
    (tmp_path / "sectioned.yaml").write_text(SECTIONED)
    flat = load_config(tmp_path / "flat.yaml", ["scheduler_config.max_prefill_tokens=512"])
    sectioned = load_config(tmp_path / "sectioned.yaml", ["scheduler_config.max_prefill_tokens=512"])
    assert flat.to_dict() == sectioned.to_dict()
    assert flat.explicit_keys == sectioned.explicit_keys


@pytest.mark.parametrize(
    ("text", "marks"),
    [
        (
            "world_size: 2\nexe_mode: eager\nscheduler_config:\n  batch_size: 4\n",
            ("world_size", "exe_mode", "scheduler_config"),
        ),
        (
            "data_config:\n  input_max_len: 8\n  input_truncated_len: 8\n",
            ("data_config.input_max_len", "data_config.input_truncated_len"),
        ),
        (
            "model_name: qwen3\nmodel_path: x\nmodel_config:\n  model_name: qwen3\n",
            ("model_name", "model_path", "model_config.model_name"),
        ),
        ("model_config:\n  pa_block_size: 128\nscheduler_config:\n  block_size: 128\n", ("pa_block_size",)),
    ],
)
def test_a_file_mixing_the_two_schemas_is_refused_in_one_line(tmp_path, text, marks):
    path = tmp_path / "mixed.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "\n" not in message and "mixes cann-recipes' two schemas" in message and str(path) in message
    assert all(mark in message for mark in marks)


def test_a_sectioned_file_may_keep_model_name_and_world_size_at_the_top_as_cann_recipes_pd_files_do(tmp_path):
    """cann-recipes' *_pd/prefill.yaml and decode.yaml keep both "for backward compatibility"."""
    path = tmp_path / "prefill.yaml"
    path.write_text(
        "model_name: qwen3\nworld_size: 1\nmodel_config:\n  model_name: qwen3\nscheduler_config:\n  batch_size: 4\n"
    )
    config = load_config(path)
    assert (config.model_config.model_name, config.parallel_config.world_size) == ("qwen3", 1)
    path.write_text("model_name: qwen3\nmodel_config:\n  model_name: llama\n")
    with pytest.raises(ConfigError, match="model_name 'qwen3' at the top of .* differs from model_config.model_name"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("world_size: 1\nentry_script: run.py\n", "unknown key entry_script in {path}"),
        ("world_size: 1\nmodel_config:\n  pa_block_sise: 128\n", "unknown key model_config.pa_block_sise in {path}"),
        ("world_size: 1\ndata_config:\n  input_max_len: -1\n", "data_config.input_max_len in {path} must be >= 0"),
        ("exe_mode: graph\n", "exe_mode in {path} must be one of"),
    ],
)
def test_a_bad_flattened_key_is_one_line_naming_the_key_as_written_and_the_file(tmp_path, text, expected):
    path = tmp_path / "flat.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "\n" not in str(err.value) and expected.format(path=path) in str(err.value)


def test_two_flattened_keys_for_one_sectioned_key_are_an_error(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text(
        "world_size: 1\nmodel_config:\n  enable_offload: true\n  custom_params:\n    enable_offload: true\n"
    )
    with pytest.raises(ConfigError, match="model_config.enable_offload and model_config.custom_params.enable_offload"):
        load_config(path)
