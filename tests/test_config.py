"""InferenceConfig: defaults, overrides and errors that name the section, key, file and closest key."""

from pathlib import Path

import pytest

from executor.core.config import ConfigError, build_config, load_config
from executor.core.config.inference_config import check_device_rules, not_applicable_keys


def write_yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_fill_missing_sections(tmp_path):
    config = load_config(write_yaml(tmp_path, "scheduler_config:\n  batch_size: 4\n"))
    assert config.scheduler_config.batch_size == 4
    assert config.scheduler_config.block_size == 128
    assert config.model_config.exe_mode == "eager"
    assert config.data_config.dataset == "default"


def test_unknown_key_names_section_file_and_closest_key(tmp_path):
    path = write_yaml(tmp_path, "scheduler_config:\n  batch_sise: 4\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert "scheduler_config.batch_sise" in message and str(path) in message and "'batch_size'" in message


def test_unknown_section_suggests_closest(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'model_config'"):
        load_config(write_yaml(tmp_path, "modle_config:\n  dtype: float32\n"))


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("scheduler_config", "batch_size", "'eight'", "must be an integer"),
        ("scheduler_config", "batch_size", "true", "must be an integer"),
        ("model_config", "with_ckpt", "1", "must be true or false"),
        ("scheduler_config", "stop_token_ids", "[1, x]", "must be an integer"),
        ("scheduler_config", "stop_token_ids", "7", "must be a list"),
    ],
)
def test_wrong_type_is_named(tmp_path, section, key, value, expected):
    path = write_yaml(tmp_path, f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=expected) as err:
        load_config(path)
    assert f"{section}.{key}" in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("scheduler_config", "batch_size", "0"),
        ("scheduler_config", "mem_fraction_static", "1.5"),
        ("data_config", "top_p", "2.0"),
    ],
)
def test_out_of_range_value_is_named(tmp_path, section, key, value):
    with pytest.raises(ConfigError, match=rf"{section}\.{key} .* must be [<>]="):
        load_config(write_yaml(tmp_path, f"{section}:\n  {key}: {value}\n"))


def test_bad_choice_suggests_closest(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'float32'"):
        load_config(write_yaml(tmp_path, "model_config:\n  dtype: floa32\n"))


def test_integer_is_accepted_where_a_number_is_expected():
    assert build_config({"scheduler_config": {"mem_fraction_static": 1}}).scheduler_config.mem_fraction_static == 1


def test_set_overrides_yaml_and_parses_values(tmp_path):
    path = write_yaml(tmp_path, "scheduler_config:\n  batch_size: 4\n")
    config = load_config(
        path, ["scheduler_config.batch_size=16", "model_config.dtype=float32", "scheduler_config.stop_token_ids=[5, 6]"]
    )
    assert config.scheduler_config.batch_size == 16
    assert config.model_config.dtype == "float32"
    assert config.scheduler_config.stop_token_ids == [5, 6]


@pytest.mark.parametrize("override", ["batch_size=4", "scheduler_config.batch_size", "=3"])
def test_malformed_set_is_an_error(tmp_path, override):
    with pytest.raises(ConfigError, match="--set"):
        load_config(write_yaml(tmp_path, ""), [override])


def test_set_with_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match="scheduler_config.max_new_token .*'max_new_tokens'"):
        load_config(write_yaml(tmp_path, ""), ["scheduler_config.max_new_token=3"])


def test_missing_file_and_bad_yaml_are_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write_yaml(tmp_path, "model_config: [unclosed\n"))


def test_graph_buckets_must_fit_the_batch():
    build_config(
        {"model_config": {"exe_mode": "ge_graph"}, "scheduler_config": {"batch_size": 4, "graph_buckets": [1, 4]}}
    )
    with pytest.raises(ConfigError, match=r"graph_buckets in run.yaml: every bucket must be in 1..batch_size \(2\)"):
        build_config({"scheduler_config": {"batch_size": 2, "graph_buckets": [1, 4]}}, source="run.yaml")


def test_sampling_keys_take_their_ranges_and_logprobs_may_be_null_or_capped():
    build_config({"data_config": {"temperature": 0.7, "top_p": 0.9, "min_p": 0.1, "logprobs": 5}})
    build_config({"data_config": {"logprobs": None, "frequency_penalty": -2.0, "repetition_penalty": 1.3}})
    build_config({"data_config": {"prompt_logprobs": 0}})
    with pytest.raises(ConfigError, match=r"data_config.prompt_logprobs in run.yaml must be <= 20, got 21"):
        build_config({"data_config": {"prompt_logprobs": 21}}, source="run.yaml")
    with pytest.raises(ConfigError, match=r"data_config.top_p in run.yaml must be > 0.0, got 0"):
        build_config({"data_config": {"top_p": 0}}, source="run.yaml")
    with pytest.raises(ConfigError, match=r"data_config.temperature in run.yaml must be a finite number, got inf"):
        build_config({"data_config": {"temperature": float("inf")}}, source="run.yaml")


def test_npu_only_keys_are_reported_not_applicable_elsewhere():
    config = build_config({"model_config": {"enable_static_kernel": True}})
    assert not_applicable_keys(config, "cpu") == [("model_config.enable_static_kernel", "only applies on NPU")]
    assert not_applicable_keys(config, "npu") == []


def test_not_applicable_keys_set_in_the_file_are_reported_with_their_reason_whatever_the_value():
    config = build_config(
        {"model_config": {"enable_weight_nz": True, "custom_params": {"enable_prefetch": False}}, "data_config": {}}
    )
    notes = dict(not_applicable_keys(config, "npu"))
    assert set(notes) == {"model_config.enable_weight_nz", "model_config.custom_params.enable_prefetch"}
    assert "NZ" in notes["model_config.enable_weight_nz"]
    assert not_applicable_keys(build_config({}), "cpu") == []


def test_a_refused_value_names_the_key_the_reason_and_what_runs():
    with pytest.raises(ConfigError) as err:
        build_config({"parallel_config": {"pp_size": 2}}, source="run.yaml")
    message = str(err.value)
    assert "parallel_config.pp_size in run.yaml is refused at 2: pipeline parallel is not built" in message
    assert "runs with 1" in message
    build_config({"parallel_config": {"world_size": 2, "pp_size": 1}, "model_config": {"force_eplb": False}})


def test_every_problem_of_a_file_is_reported_at_once_one_line_each(tmp_path):
    text = (
        "model_config:\n  platform_version: A3\n  force_eplb: true\n  custom_params:\n    enable_afd: true\n"
        "parallel_config:\n  pp_size: 16\n  cp_sise: 1\nscheduler_config:\n  batch_size: 0\n"
    )
    path = write_yaml(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    lines = str(err.value).splitlines()
    assert lines[0] == f"5 problems in {path}:"
    for key in ("force_eplb", "custom_params.enable_afd", "pp_size", "cp_sise", "batch_size"):
        assert sum(key in line for line in lines[1:]) == 1, key
    assert len(err.value.problems) == 5


@pytest.mark.parametrize(
    ("section", "key", "hint"),
    [
        ("parallel_config", "cp_size_", "'cp_size'"),
        ("scheduler_config", "max_new_token", "'max_new_tokens'"),
        ("parallel_config", "cp_sizes", "'cp_size'"),
    ],
)
def test_did_you_mean_offers_a_close_name_of_the_same_section(section, key, hint):
    with pytest.raises(ConfigError, match=f"did you mean {hint}"):
        build_config({section: {key: 1}})


@pytest.mark.parametrize(
    ("section", "key"),
    [("scheduler_config", "cp_size"), ("parallel_config", "context_size"), ("data_config", "block_size")],
)
def test_did_you_mean_stays_silent_when_no_name_of_the_section_is_close(section, key):
    with pytest.raises(ConfigError) as err:
        build_config({section: {key: 1}})
    assert "did you mean" not in str(err.value) and f"{section}.{key}" in str(err.value)


def test_cann_recipes_defaults_where_a_key_means_the_same():
    config = build_config({})
    assert config.data_config.input_truncated_len == 256
    assert config.scheduler_config.mem_fraction_static == 0.85
    assert config.model_config.enable_dynamic_graph is True
    assert config.scheduler_config.max_prefill_tokens == 0


def test_max_prefill_tokens_0_is_derived_from_truncation_and_batch_size():
    config = build_config({"data_config": {"input_truncated_len": 100}, "scheduler_config": {"batch_size": 3}})
    assert config.prefill_token_budget == 300
    untruncated = build_config({"data_config": {"input_truncated_len": 0}, "scheduler_config": {"batch_size": 2}})
    assert untruncated.prefill_token_budget == 2 * 8192
    assert build_config({"scheduler_config": {"max_prefill_tokens": 64}}).prefill_token_budget == 64


def test_custom_params_keys_are_checked_against_their_table():
    config = build_config({"model_config": {"custom_params": {"num_hidden_layers": 2, "enable_multi_streams": 1}}})
    assert config.model_config.custom_params == {"num_hidden_layers": 2, "enable_multi_streams": 1}
    with pytest.raises(ConfigError, match=r"model_config.custom_params.num_hidden_layers .* must be >= 1"):
        build_config({"model_config": {"custom_params": {"num_hidden_layers": 0}}})
    with pytest.raises(ConfigError, match=r"unknown key model_config.custom_params.enable_prefech .*'enable_prefetch'"):
        build_config({"model_config": {"custom_params": {"enable_prefech": True}}})


def test_shipped_configs_are_valid():
    for path in (Path(__file__).resolve().parents[1] / "models").glob("*/config/*.yaml"):
        load_config(path)


def test_npu_needs_block_sizes_in_multiples_of_128():
    config = build_config({"scheduler_config": {"block_size": 16}}, source="run.yaml")
    check_device_rules(config, "cpu")
    with pytest.raises(ConfigError, match="block_size in run.yaml must be a multiple of 128 on NPU"):
        check_device_rules(config, "npu")
    check_device_rules(build_config({"scheduler_config": {"block_size": 256}}), "npu")


# --- the YAML file itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "model_config:\n  dtype: float32\nmodel_config:\n  device: cpu\n",
            "run.yaml:3: duplicate section model_config (first on line 1)",
        ),
        (
            "scheduler_config:\n  batch_size: 2\n  block_size: 16\n  batch_size: 4\n",
            "run.yaml:4: duplicate key scheduler_config.batch_size (first on line 2)",
        ),
        (
            "model_config:\n  custom_params:\n    a: 1\n    a: 2\n",
            "run.yaml:4: duplicate key model_config.custom_params.a (first on line 3)",
        ),
    ],
)
def test_a_key_or_section_written_twice_is_refused_with_both_lines(tmp_path, text, expected):
    with pytest.raises(ConfigError) as err:
        load_config(write_yaml(tmp_path, text))
    assert expected in str(err.value)


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    text = "x: &base\n  batch_size: 2\nscheduler_config:\n  <<: *base\n  block_size: 16\n"
    with pytest.raises(ConfigError, match="unknown section 'x'"):  # got past the duplicate check
        load_config(write_yaml(tmp_path, text))


def test_a_yaml_file_that_is_not_utf8_is_named_with_line_and_column(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"model_config:\n  dtype: float32 # \xff\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:2: not UTF-8 \(byte 0xff at column 20\)"):
        load_config(path)


def test_yaml_syntax_errors_are_one_line_with_the_position(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write_yaml(tmp_path, "scheduler_config:\n  stop_token_ids: [1, 2\n"))
    assert "\n" not in str(err.value) and "line 3" in str(err.value)


def test_nan_is_not_a_number_a_range_can_check(tmp_path):
    with pytest.raises(ConfigError, match="mem_fraction_static .* must be a number"):
        load_config(write_yaml(tmp_path, "scheduler_config:\n  mem_fraction_static: .nan\n"))
