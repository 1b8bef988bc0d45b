"""The findings of issue 6's probe (77 hostile inputs and faults), one test each.

Two findings are tested where their machinery lives, in test_resume.py: a full disk
(test_a_full_disk_names_the_file_keeps_whole_lines_and_resumes) and Ctrl-C
(test_a_signal_stops_after_the_step_and_the_same_command_resumes); kill -9 with no way to
continue is test_killed_run_resumes_to_the_uninterrupted_outputs.
"""

from __future__ import annotations

import pytest

from tests.bad_inputs_runner import load_case, run_case
from tests.run_harness import run_into, write_run

FINDINGS = {
    "a token id at the vocabulary size fails alone": "request_token_id_at_vocab",
    "a token id too large for int64 fails alone": "request_token_id_beyond_int64",
    "a section written twice is refused with both lines": "yaml_section_twice",
    "a key written twice is refused with both lines": "yaml_key_twice",
    "a non-UTF-8 byte in the YAML names the file and line": "yaml_not_utf8",
    "a malformed config.json is one line before loading": "model_config_json_malformed",
    "missing safetensors are one line before loading": "model_weights_missing",
    "truncated safetensors name the corrupt file": "model_weights_truncated",
    "device cuda without CUDA is one line before loading": "device_cuda_absent",
    "a KV pool too small for one request gives the numbers": "kv_pool_too_small",
    "a read-only output folder is found before loading": "output_read_only",
    "an output folder under a file is found before loading": "output_parent_is_file",
    "a run in which every request failed does not exit 0": "request_all_fail",
}


@pytest.mark.parametrize("case", list(FINDINGS.values()), ids=list(FINDINGS))
def test_probe_finding(case, tmp_path, tiny_llama_dir, monkeypatch, capsys):
    expected = load_case(case)["exit"]
    status, stderr, _ = run_case(case, tmp_path, tiny_llama_dir, monkeypatch, capsys)
    assert status == expected and "Traceback" not in stderr


def test_a_rerun_that_cannot_continue_leaves_the_finished_run_untouched(tiny_llama_dir, tmp_path):
    """The probe's rerun wiped a finished run's outputs and left summary and config of two runs."""
    out = tmp_path / "out"
    assert run_into(write_run(tmp_path, tiny_llama_dir, num_prompts=3), out) == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert run_into(write_run(tmp_path, tiny_llama_dir, num_prompts=3, seed=1), out) == 2
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
