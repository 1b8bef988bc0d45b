"""`python -m executor.offline`: bad input is a clear error before any model loads; a good run
writes outputs.jsonl, steps.jsonl, summary.json and the resolved config."""

import json
import shutil
from pathlib import Path

import pytest

from executor.offline import __main__ as cli


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything tries to build the engine."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded although the input was bad")

    monkeypatch.setattr(cli, "OfflineInference", refuse)


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def run_cli(tmp_path: Path, model_dir: Path, dataset_text: str, *overrides: str) -> int:
    dataset = write(tmp_path / "prompts.jsonl", dataset_text)
    yaml_path = write(
        tmp_path / "run.yaml",
        f"model_config:\n  model_path: {model_dir}\n  dtype: float32\n  device: cpu\n"
        f"  output_path: {tmp_path / 'out'}\n"
        f"data_config:\n  dataset_path: {dataset}\n"
        "scheduler_config:\n  batch_size: 4\n  max_new_tokens: 5\n  block_size: 16\n",
    )
    return cli.main(["--yaml", str(yaml_path), *[arg for o in overrides for arg in ("--set", o)]])


def test_empty_dataset_is_a_clear_error(tmp_path, tiny_llama_dir, no_model_load, capsys):
    assert run_cli(tmp_path, tiny_llama_dir, "\n") == 2
    assert "prompts.jsonl" in capsys.readouterr().err


def test_malformed_line_is_named_by_number(tmp_path, tiny_llama_dir, no_model_load, capsys):
    assert run_cli(tmp_path, tiny_llama_dir, '{"prompt": "w3 w4"}\n{"prompt": \n') == 2
    assert "prompts.jsonl:2" in capsys.readouterr().err


def test_missing_model_path_is_a_clear_error(tmp_path, no_model_load, capsys):
    assert run_cli(tmp_path, tmp_path / "no-such-model", '{"prompt": "w3"}\n') == 2
    err = capsys.readouterr().err
    assert "model_config.model_path" in err and "no-such-model" in err


def test_bad_override_is_a_clear_error(tmp_path, tiny_llama_dir, no_model_load, capsys):
    assert run_cli(tmp_path, tiny_llama_dir, '{"prompt": "w3"}\n', "scheduler_config.batch_size=0") == 2
    assert "scheduler_config.batch_size" in capsys.readouterr().err


def test_unknown_model_name_is_a_clear_error(tmp_path, tiny_llama_dir, no_model_load, capsys):
    assert run_cli(tmp_path, tiny_llama_dir, '{"prompt": "w3"}\n', "model_config.model_name=gpt9") == 2
    assert "gpt9" in capsys.readouterr().err


def test_run_writes_every_result_file(tmp_path, tiny_llama_dir, capsys):
    dataset = (
        '{"prompt": "w3 w4 w5"}\n{"id": "chat", "messages": [{"role": "user", "content": "w9 w10"}]}\n'
        '{"prompt_token_ids": [5, 6, 7, 8]}\n'
    )
    assert run_cli(tmp_path, tiny_llama_dir, dataset, "scheduler_config.ignore_eos=true") == 0
    out = tmp_path / "out"
    outputs = [json.loads(line) for line in (out / "outputs.jsonl").read_text().splitlines()]
    assert sorted(o["id"] for o in outputs) == ["0", "2", "chat"]
    assert all(len(o["output_token_ids"]) == 5 and o["finish_reason"] == "length" for o in outputs)
    assert {"id", "prompt", "output_text", "output_token_ids", "prompt_tokens", "finish_reason", "error"} <= set(
        outputs[0]
    )
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert steps[0]["phase"] == "prefill" and [s["phase"] for s in steps[1:]] == ["decode"] * 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 3 and summary["output_tokens"] == 15
    assert {"ttft_mean_ms", "tpot_mean_ms", "output_tokens_per_s", "prefill", "decode"} <= set(summary)
    assert "p99_ms" in summary["decode"]
    assert "ignore_eos: true" in (out / "config.yaml").read_text()
    printed = capsys.readouterr().out
    assert "=== run complete" in printed and "[chat]" in printed and "summary.json" in printed
    assert "{" not in printed.split("=== run complete", 1)[1]  # the end table, not the JSON
    step_text = (out / "steps.log").read_text()
    assert (
        step_text.count("[Main] Inference time") == len((out / "steps.jsonl").read_text().splitlines())
        and "decode average" in step_text
    )


def test_enable_profiler_writes_a_trace(tmp_path, tiny_llama_dir):
    assert run_cli(tmp_path, tiny_llama_dir, '{"prompt": "w3 w4"}\n', "model_config.enable_profiler=true") == 0
    trace = json.loads((tmp_path / "out" / "prof" / "prefill" / "prefill_0.pt.trace.json").read_text())
    assert trace["traceEvents"]


def test_random_weights_are_seeded(tmp_path, tiny_llama_dir):
    def outputs(seed: int, run: str) -> list[list[int]]:
        run_dir = tmp_path / run
        run_dir.mkdir(exist_ok=True)
        assert (
            run_cli(
                run_dir,
                tiny_llama_dir,
                '{"prompt_token_ids": [5, 6, 7]}\n',
                "model_config.with_ckpt=false",
                f"data_config.seed={seed}",
                "scheduler_config.ignore_eos=true",
            )
            == 0
        )
        lines = (run_dir / "out" / "outputs.jsonl").read_text().splitlines()
        return [json.loads(line)["output_token_ids"] for line in lines]

    assert outputs(1, "a") == outputs(1, "b")
    assert outputs(1, "a") != outputs(2, "c")


def test_input_truncated_len_keeps_the_first_tokens(tmp_path, tiny_llama_dir):
    dataset = '{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}\n'
    assert run_cli(tmp_path, tiny_llama_dir, dataset, "data_config.input_truncated_len=4") == 0
    (output,) = [json.loads(line) for line in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    assert output["prompt_tokens"] == 4


def test_a_record_that_needs_a_missing_chat_template_fails_alone(tmp_path, tiny_llama_dir):
    model_dir = tmp_path / "no_template"
    shutil.copytree(tiny_llama_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink()
    dataset = (
        '{"id": "chat", "messages": [{"role": "user", "content": "w3"}]}\n{"id": "ids", "prompt_token_ids": [5]}\n'
    )
    assert run_cli(tmp_path, model_dir, dataset) == 3  # some requests failed
    lines = [json.loads(line) for line in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert by_id["chat"]["finish_reason"] == "error" and "chat template" in by_id["chat"]["error"]
    assert by_id["ids"]["error"] is None and by_id["ids"]["output_token_ids"]


def test_max_model_len_beyond_the_model_fails_before_the_weights_load(tmp_path, tiny_llama_dir, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded although max_model_len was bad")

    monkeypatch.setattr("executor.core.model_worker.model_worker.get_model_loader", refuse)
    assert run_cli(tmp_path, tiny_llama_dir, '{"prompt": "w3"}\n', "scheduler_config.max_model_len=100000") == 2
    assert "max_position_embeddings 256" in capsys.readouterr().err


def test_batch_size_meaning_num_requests_runs_exactly_batch_size_requests(tmp_path, tiny_llama_dir):
    dataset = '{"id": "p", "prompt_token_ids": [5, 6]}\n{"id": "q", "prompt_token_ids": [7]}\n'
    overrides = ("scheduler_config.batch_size_meaning=num_requests", "scheduler_config.batch_size=3")
    assert run_cli(tmp_path, tiny_llama_dir, dataset, *overrides) == 0
    lines = [json.loads(line) for line in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    assert sorted(line["id"] for line in lines) == ["p", "p#1", "q"]


def test_a_cann_recipes_text_prompt_file_runs(tmp_path, tiny_llama_dir):
    prompts = write(tmp_path / "default_prompt.json", json.dumps({"text": ["w3 w4", "w5"]}, indent=4))
    overrides = (f"data_config.dataset_path={prompts}", "data_config.apply_chat_template=false")
    assert run_cli(tmp_path, tiny_llama_dir, "", *overrides) == 0
    lines = [json.loads(line) for line in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    assert sorted(line["prompt"] for line in lines) == ["w3 w4", "w5"]
