"""What a rerun into an output folder may do: which settings change outputs, and the resume command."""

from __future__ import annotations

import argparse
import dataclasses
from concurrent.futures import ProcessPoolExecutor

from executor.core.config import build_config
from executor.core.config.sections import SECTIONS
from executor.offline.__main__ import resume_command
from executor.offline.dataset import PromptRecord
from executor.offline.run_folder import (
    OUTPUT_NEUTRAL_KEYS,
    changed_settings,
    check_output_dir,
    request_hash,
    settings_hash,
)


def test_output_neutral_keys_name_real_config_keys():
    real = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert OUTPUT_NEUTRAL_KEYS <= real


def test_only_settings_that_change_outputs_change_the_settings_hash():
    base = settings_hash(build_config({}))
    assert settings_hash(build_config({"scheduler_config": {"batch_size": 64, "num_blocks": 9}})) == base
    assert settings_hash(build_config({"model_config": {"output_path": "/elsewhere"}})) == base
    assert settings_hash(build_config({"scheduler_config": {"max_new_tokens": 5}})) != base
    assert settings_hash(build_config({"model_config": {"dtype": "float16"}})) != base


def test_the_request_hash_follows_the_line_content_and_the_settings():
    one, other = PromptRecord("a", prompt="x", content_hash="1"), PromptRecord("a", prompt="y", content_hash="2")
    assert request_hash(one, "s") == request_hash(one, "s")
    assert request_hash(one, "s") != request_hash(other, "s")
    assert request_hash(one, "s") != request_hash(one, "t")


def test_checking_an_output_folder_leaves_nothing_behind(tmp_path):
    check_output_dir(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []


def _check_many_times(output_dir, times: int) -> int:
    for _ in range(times):
        check_output_dir(output_dir)
    return times


def test_ranks_checking_one_missing_output_folder_at_once_all_pass(tmp_path):
    """Every torchrun rank checks the same output_path; a check that created and removed the folder
    failed another rank's check now and then (seen in CI)."""
    with ProcessPoolExecutor(2) as pool:
        checked = list(pool.map(_check_many_times, [tmp_path / "out" / "run"] * 2, [300] * 2))
    assert checked == [300, 300]
    assert list(tmp_path.iterdir()) == []


def test_the_resume_command_adds_the_output_folder_only_when_the_config_has_none(tmp_path):
    args = argparse.Namespace(yaml="my run.yaml", overrides=["scheduler_config.batch_size=8"])
    command = resume_command(args, build_config({}), tmp_path / "res" / "x")
    assert command == (
        "python -m executor.offline --yaml 'my run.yaml' --set scheduler_config.batch_size=8 "
        f"--set model_config.output_path={tmp_path}/res/x"
    )
    config = build_config({"model_config": {"output_path": str(tmp_path)}})
    assert "output_path" not in resume_command(args, config, tmp_path)


def test_a_key_the_earlier_config_lacks_is_no_change_while_it_holds_its_default():
    # a run folder written before data_config.bad_words existed; the key now at its default, then set
    earlier, defaults = {"data_config.seed": 5}, {"data_config.seed": 0, "data_config.bad_words": []}
    unchanged = {"data_config.seed": 5, "data_config.bad_words": []}
    assert changed_settings(earlier, unchanged, defaults) == []
    banned = {"data_config.seed": 5, "data_config.bad_words": ["x"]}
    assert changed_settings(earlier, banned, defaults) == ["data_config.bad_words was not set, now ['x']"]
    assert changed_settings(earlier, unchanged) == ["data_config.bad_words was not set, now []"]  # no defaults
