"""benchmarks/bench_serve.py's pure parts: its flags, the prompt file, the load generator's command
line and result, the ratios and targets, the table, and that a server process is always stopped.
No model and no server runs here."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.offline.dataset import PromptRecord

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_serve  # noqa: E402


def test_defaults_are_the_issue_workload():
    args = bench_serve.parse_args([])
    assert args.concurrency == [1, 8, 32]
    assert (args.num_prompts, args.num_prompts_c1, args.max_new_tokens) == (64, 16, 64)
    assert args.dtypes == ["float32"] and args.dataset == "chat64" and args.backend == "openai"
    assert bench_serve.num_prompts_at(1, args) == 16
    assert bench_serve.num_prompts_at(8, args) == bench_serve.num_prompts_at(32, args) == 64
    assert args.vllm_python.endswith("vllm-venv/bin/python")


def test_flags_are_checked(capsys):
    args = bench_serve.parse_args(["--concurrency", "2", "4", "--dtypes", "float32", "bfloat16", "--set", "a.b=1"])
    assert args.concurrency == [2, 4] and args.dtypes == ["float32", "bfloat16"] and args.overrides == ["a.b=1"]
    for bad in (["--concurrency", "0"], ["--num-prompts", "0"], ["--skip-offline", "--skip-ours", "--skip-vllm"]):
        with pytest.raises(SystemExit):
            bench_serve.parse_args(bad)
    assert "must be at least 1" in capsys.readouterr().err


class _ChatTokenizer:
    """apply_chat_template as ChatML writes it."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"


def test_chat_text_is_the_records_prompt_through_the_template():
    tokenizer = _ChatTokenizer()
    assert bench_serve.chat_text(PromptRecord("a", prompt="Hi!"), tokenizer) == (
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    assert bench_serve.chat_text(PromptRecord("b", messages=messages), tokenizer).startswith("<|im_start|>system\n")
    with pytest.raises(ValueError, match="'c'"):
        bench_serve.chat_text(PromptRecord("c", prompt_token_ids=[1, 2]), tokenizer)


def test_prompt_file_is_the_custom_datasets_jsonl(tmp_path):
    texts = ["<|im_start|>user\nHi!<|im_end|>\n", 'quote " and newline\n and ünïcode']
    path = bench_serve.write_prompt_file(texts, tmp_path / "sub" / "p.jsonl", 64)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == [{"prompt": t, "output_tokens": 64} for t in texts]
    assert "ünïcode" in lines[1]  # written as it is, not escaped


def test_load_command_is_greedy_eos_ignored_and_bounded(tmp_path):
    args = bench_serve.parse_args(["--vllm-python", "/v/bin/python"])
    command = bench_serve.load_command(args, 18205, "/models/m", tmp_path / "p.jsonl", 1, "ours_float32")
    assert command[:2] == ["/v/bin/python", str(bench_serve.CLIENT)]

    def value(flag):
        return command[command.index(flag) + 1]

    assert value("--base-url") == "http://127.0.0.1:18205" and value("--endpoint") == "/v1/completions"
    assert (value("--num-prompts"), value("--max-concurrency"), value("--temperature")) == ("16", "1", "0")
    assert value("--custom-output-len") == "64" and value("--dataset-name") == "custom"
    assert value("--model") == "default" and value("--tokenizer") == "/models/m"
    assert {"--ignore-eos", "--disable-shuffle", "--skip-chat-template"} <= set(command)
    assert value("--metric-percentiles") == "50,99"
    chat = bench_serve.parse_args(["--backend", "openai-chat"])
    command = bench_serve.load_command(chat, 18205, "/m", tmp_path / "p.jsonl", 32, "x")
    assert command[command.index("--endpoint") + 1] == "/v1/chat/completions"
    assert command[command.index("--num-prompts") + 1] == "64"


def test_servers_listen_on_loopback_in_the_port_range():
    args = bench_serve.parse_args(["--set", "model_config.exe_mode=ge_graph", "--vllm-arg=--enforce-eager"])
    ours = bench_serve.ours_server_command(args, "bfloat16", 18201)
    assert ours[1:3] == ["-m", "executor.online"]
    assert ours[ours.index("--host") + 1] == "127.0.0.1" and ours[ours.index("--port") + 1] == "18201"
    assert ours[-4:] == ["--set", "model_config.dtype=bfloat16", "--set", "model_config.exe_mode=ge_graph"]
    vllm = bench_serve.vllm_server_command(args, "float32", 18202, "/models/m", 1024, 32)
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert vllm[vllm.index("--served-model-name") + 1] == "default"
    assert (vllm[vllm.index("--dtype") + 1], vllm[vllm.index("--max-num-seqs") + 1]) == ("float32", "32")
    assert vllm[-1] == "--enforce-eager"
    taken = set(range(18200, 18210))
    port = bench_serve.free_port(taken)
    assert 18210 <= port < 18300 and port in taken


def test_load_result_is_read_from_the_last_result_line():
    result = {
        "completed": 15,
        "failed": 1,
        "total_output_tokens": 960,
        "duration": 12.0,
        "output_throughput": 80.0,
        "p50_ttft_ms": 100.0,
        "p99_ttft_ms": 300.0,
        "p50_tpot_ms": 20.0,
        "p99_tpot_ms": 25.0,
        "output_lens": [64] * 15 + [0],
        "generated_texts_sha256": "ab",
        "first_errors": ["boom"],
    }
    stdout = 'log line\nBENCH_RESULT {"completed": 0}\nmore\nBENCH_RESULT ' + json.dumps(result) + "\n"
    figures = bench_serve.figures_from_load(bench_serve.parse_load_output(stdout), 8, 64)
    assert figures == {
        "concurrency": 8,
        "output_tok_s": 80.0,
        "ttft_p50_ms": 100.0,
        "ttft_p99_ms": 300.0,
        "tpot_p50_ms": 20.0,
        "tpot_p99_ms": 25.0,
        "requests": 16,
        "failed": 1,
        "output_tokens": 960,
        "duration_s": 12.0,
        "short_outputs": 1,
        "texts_sha256": "ab",
        "first_errors": ["boom"],
    }
    with pytest.raises(ValueError, match="no BENCH_RESULT"):
        bench_serve.parse_load_output("nothing here\n")


def _row(concurrency, tok_s, tpot_p99, ttft_p99=100.0):
    return {
        "concurrency": concurrency,
        "requests": 64,
        "output_tok_s": tok_s,
        "ttft_p50_ms": ttft_p99 / 2,
        "ttft_p99_ms": ttft_p99,
        "tpot_p50_ms": tpot_p99 * 0.9,
        "tpot_p99_ms": tpot_p99,
    }


def _results():
    return {
        "offline": {
            "float32": {
                "batch_size": 32,
                "requests": 64,
                "output_tok_s": 200.0,
                "ttft_p50_ms": 1.0,
                "ttft_p99_ms": 2.0,
                "tpot_p50_ms": 3.0,
                "tpot_p99_ms": 4.0,
            }
        },
        "serve": {
            "ours": {"float32": [_row(1, 40.0, 30.0), _row(8, 120.0, 60.0), _row(32, 190.0, 150.0)]},
            "vllm": {"float32": [_row(1, 30.0, 35.0), _row(8, 100.0, 70.0), _row(32, 180.0, 140.0, 400.0)]},
        },
    }


def test_ratios_and_targets():
    comparison = bench_serve.compare(_results())["float32"]
    first, _, last = comparison["per_concurrency"]
    assert first["throughput_ours_over_vllm"] == pytest.approx(40 / 30)
    assert first["tpot_p99_ours_over_vllm"] == pytest.approx(30 / 35)
    assert first["throughput_at_least_vllm"] and first["tpot_p99_no_worse"]
    assert last["throughput_at_least_vllm"] and not last["tpot_p99_no_worse"]  # 150 ms against 140
    assert last["ttft_p99_ours_over_vllm"] == pytest.approx(100 / 400)
    assert comparison["ours_top_concurrency"] == 32
    assert comparison["ours_top_over_offline"] == pytest.approx(190 / 200)
    assert comparison["server_cost_target_met"] is True  # 0.95 >= 0.9
    assert comparison["vllm_targets_met"] is False  # one TPOT p99 worse is enough


def test_targets_not_measured_are_none_not_false():
    results = _results()
    del results["serve"]["vllm"]
    results["offline"]["float32"]["output_tok_s"] = 250.0
    comparison = bench_serve.compare(results)["float32"]
    assert comparison["vllm_targets_met"] is None
    assert comparison["server_cost_target_met"] is False  # 190 / 250 = 0.76
    assert (
        bench_serve.compare({"serve": {"vllm": {"bfloat16": [_row(8, 1.0, 1.0)]}}})["bfloat16"][
            "server_cost_target_met"
        ]
        is None
    )


def test_table_has_every_row_and_says_which_targets_are_met():
    results = _results()
    table = bench_serve.format_table(results, bench_serve.compare(results))
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 1 + 1 + 3 + 3  # header, offline, ours x3, vLLM x3
    assert "| ours (executor.online) | float32 | 32 | 64 | 190.0 | 50.0 | 100.0 | 135.0 | 150.0 |" in table
    assert "| ours offline (batch 32) | float32 | - | 64 | 200.0 |" in table
    assert "concurrency 1: ours / vLLM output tok/s 1.33x, TPOT p99 0.86x" in table
    assert "ours at concurrency 32 / ours offline: 0.95x (target >= 0.9: met)" in table
    assert "every concurrency: NOT met" in table


def test_a_server_that_exits_early_is_reported_with_its_log(tmp_path):
    command = [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"exited \(3\) before it served:\nbad flag"):
        with bench_serve.running_server("fake", command, 18299, tmp_path / "log", ready_timeout_s=30):
            pass


def test_a_server_that_ignores_sigterm_is_killed_with_its_children():
    process = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; sleep 60 & echo ready; wait"], start_new_session=True, stdout=subprocess.PIPE
    )
    assert process.stdout.readline() == b"ready\n"  # TERM is ignored from here on, by the child too
    bench_serve.stop_process_group(process, grace_s=0.5)
    assert process.returncode == -9
    # the child (`sleep`) went with it: nothing of the group is left but, for a moment, a zombie
    for _ in range(50):
        states = subprocess.run(["ps", "-o", "stat=", "-g", str(process.pid)], capture_output=True, text=True)
        if all(state.startswith("Z") for state in states.stdout.split()):
            break
        time.sleep(0.1)
    assert all(state.startswith("Z") for state in states.stdout.split()), states.stdout
