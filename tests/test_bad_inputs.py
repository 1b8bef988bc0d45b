"""Every case in tests/bad_inputs/ (README there) ends with its expected exit status and words.

Exit 2 means the run could not start: the message is one `error:` line naming the key, file or
line, and (unless the case says otherwise) no model was loaded. Exit 3 and 4 mean requests failed
alone: each named request has an outputs.jsonl line whose error holds the words.
"""

from __future__ import annotations

import json

import pytest

from tests.bad_inputs_runner import CASES, load_case, run_case


def test_the_corpus_has_at_least_40_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("name", CASES)
def test_bad_input_case(name, tmp_path, tiny_llama_dir, monkeypatch, capsys):
    case = load_case(name)
    status, stderr, out = run_case(name, tmp_path, tiny_llama_dir, monkeypatch, capsys)
    assert status == case["exit"], stderr
    assert "Traceback" not in stderr
    if case.get("stderr"):
        (error_line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
        missing = [word for word in case["stderr"] if word not in error_line]
        assert not missing, f"{missing} not in {error_line!r}"
    if case.get("outputs"):
        lines = {line["id"]: line for line in map(json.loads, (out / "outputs.jsonl").read_text().splitlines())}
        for request_id, words in case["outputs"].items():
            error = lines[request_id]["error"] or ""
            assert lines[request_id]["finish_reason"] == "error"
            assert [w for w in words if w not in error] == [], error
        served = [line for line in lines.values() if line["id"] not in case["outputs"]]
        assert all(line["error"] is None and line["output_token_ids"] for line in served)
