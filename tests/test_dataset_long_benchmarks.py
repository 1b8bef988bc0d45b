"""LongBench / InfiniteBench: which files are read, which tasks, the templates filled, the cuts,
and the one-line error when the files are not there. The sample lines are written here, in each
benchmark's own line format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from executor.core.config.sections import DataConfig
from executor.offline.dataset import DatasetError, PromptRecord, tokenize_record
from executor.offline.long_benchmarks import (
    LONGBENCH,
    LongContextRequest,
    benchmark_request,
    load_benchmark_records,
)
from tests.factories import tiny_tokenizer


def longbench_line(context: str, question: str, task: str = "narrativeqa") -> dict[str, object]:
    """One line as LongBench's data.zip holds them."""
    return {
        "input": question,
        "context": context,
        "answers": ["an answer"],
        "length": len(context.split()),
        "dataset": task,
        "language": "en",
        "all_classes": None,
        "_id": "0f3c9a",
    }


def write_task(folder: Path, task: str, *lines: dict[str, object]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{task}.jsonl"
    path.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
    return path


def request_for(folder: Path, dataset: str = "LongBench", max_new_tokens: int = 32, **data: object):
    defaults: dict[str, object] = {"input_truncated_len": 0, "dataset_path": str(folder)}
    config = DataConfig(dataset=dataset, **(defaults | data))
    request = benchmark_request(config, max_new_tokens, folder.parent)
    assert request is not None
    return request


def no_tokenizer():
    raise AssertionError("the tokenizer is loaded only to cut")


# --- files and tasks --------------------------------------------------------------------------------


def test_other_datasets_are_not_benchmarks(tmp_path: Path) -> None:
    assert benchmark_request(DataConfig(dataset="default"), 32, tmp_path) is None


def test_cann_recipes_reads_every_longbench_task_and_its_longbench_e_twin_and_infinitebench_longbook_qa(
    tmp_path: Path,
) -> None:
    longbench = request_for(tmp_path / "lb")
    assert len(longbench.tasks) == 34 and longbench.tasks[:2] == ("narrativeqa", "qasper")
    assert longbench.tasks[-1] == "repobench-p_e"
    assert request_for(tmp_path / "ib", dataset="InfiniteBench").tasks == ("longbook_qa_eng",)


def test_the_folder_defaults_to_dataset_slash_the_benchmark_name(tmp_path: Path) -> None:
    request = benchmark_request(DataConfig(dataset="InfiniteBench"), 32, tmp_path)
    assert request is not None and request.folder == tmp_path / "InfiniteBench"


def test_missing_files_are_one_line_naming_the_folder_the_files_and_where_they_come_from(tmp_path: Path) -> None:
    write_task(tmp_path / "lb", "qasper", longbench_line("c", "q", "qasper"))
    with pytest.raises(DatasetError) as error:
        load_benchmark_records(request_for(tmp_path / "lb"), no_tokenizer)
    message = str(error.value)
    assert "\n" not in message
    assert "33 of 34" in message and str(tmp_path / "lb") in message
    assert "narrativeqa.jsonl" in message and "repobench-p_e.jsonl" in message and "qasper.jsonl," not in message
    assert "THUDM/LongBench" in message and "dataset_path" in message


def test_a_missing_infinitebench_folder_says_where_to_download_the_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"longbook_qa_eng\.jsonl.*xinrongzhang2022/InfiniteBench"):
        load_benchmark_records(request_for(tmp_path / "nope", dataset="InfiniteBench"), no_tokenizer)


def test_dataset_path_that_is_a_file_is_refused_for_a_benchmark(tmp_path: Path) -> None:
    file = tmp_path / "prompts.jsonl"
    file.write_text("{}\n")
    with pytest.raises(DatasetError, match="must be the folder"):
        load_benchmark_records(request_for(file), no_tokenizer)


def test_tasks_choose_the_files_and_longbench_e_uses_its_task_template(tmp_path: Path) -> None:
    folder = tmp_path / "lb"
    write_task(folder, "hotpotqa_e", longbench_line("Passage 1: w3", "Who?", "hotpotqa"))
    write_task(folder, "trec", longbench_line("ignored", "ignored", "trec"))
    records = load_benchmark_records(request_for(folder, tasks=["hotpotqa_e"], benchmark_prompt="task"), no_tokenizer)
    assert [r.id for r in records] == ["hotpotqa_e/0"]
    assert records[0].prompt == LONGBENCH.templates["hotpotqa"].format(context="Passage 1: w3", input="Who?")


def test_the_unpacked_data_subfolder_is_read(tmp_path: Path) -> None:
    write_task(tmp_path / "lb" / "data", "lcc", longbench_line("def f():\n", "", "lcc"))
    records = load_benchmark_records(request_for(tmp_path / "lb", tasks=["lcc"], benchmark_prompt="task"), no_tokenizer)
    assert records[0].prompt == "Please complete the code given below. \ndef f():\nNext line of code:\n"


def test_unknown_task_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"unknown InfiniteBench task\(s\) \['longbook'\].*longbook_qa_eng"):
        request_for(tmp_path, dataset="InfiniteBench", tasks=["longbook"])


def test_tasks_with_a_plain_dataset_are_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="only applies to LongBench and InfiniteBench"):
        benchmark_request(DataConfig(dataset="default", tasks=["passkey"]), 32, tmp_path)


def test_a_line_without_context_names_file_and_line(tmp_path: Path) -> None:
    folder = tmp_path / "ib"
    write_task(folder, "passkey", {"id": 0, "context": "x", "input": "q"}, {"id": 1, "input": "q"})
    with pytest.raises(DatasetError, match=r"passkey\.jsonl:2: .*'context'"):
        load_benchmark_records(request_for(folder, dataset="InfiniteBench", tasks=["passkey"]), no_tokenizer)


# --- templates ----------------------------------------------------------------------------------------


def test_the_task_template_fills_context_and_question(tmp_path: Path) -> None:
    folder = tmp_path / "lb"
    write_task(folder, "narrativeqa", longbench_line("Once upon a time.", "Who?"), longbench_line("The end.", "What?"))
    records = load_benchmark_records(request_for(folder, tasks=["narrativeqa"], benchmark_prompt="task"), no_tokenizer)
    assert [r.id for r in records] == ["narrativeqa/0", "narrativeqa/1"]
    prompt = records[0].prompt
    assert prompt.startswith("You are given a story, which can be either a novel or a movie script, and a question.")
    assert "Story: Once upon a time.\n\n" in prompt and prompt.endswith("Question: Who?\n\nAnswer:")
    assert records[0].where == "narrativeqa.jsonl:1" and records[0].content_hash != records[1].content_hash


def test_infinitebench_templates_take_options_function_calls_and_targets_from_the_line(tmp_path: Path) -> None:
    folder = tmp_path / "ib"
    options = ["Ann", "Bob", "Cy", "Di"]
    write_task(folder, "longbook_choice_eng", {"id": 0, "context": "A book.", "input": "Who?", "options": options})
    write_task(folder, "code_run", {"id": 0, "context": "def func_1(x): ...", "input": "What is func_1(-3)?"})
    write_task(folder, "math_find", {"id": 0, "context": "[3, 1, 2]", "input": "The largest number of the list"})
    tasks = ["longbook_choice_eng", "code_run", "math_find"]
    request = request_for(folder, dataset="InfiniteBench", tasks=tasks, benchmark_prompt="task")
    choice, code, math = (r.prompt for r in load_benchmark_records(request, no_tokenizer))
    assert "\n\nA book.\n\nQuestion: Who?\n\n" in choice and choice.endswith("A. Ann\nB. Bob\nC. Cy\nD. Di")
    assert "called named func_1.\n\n" in code and "return value of func_1(-3). Be concise." in code
    assert math == "What is the largest number in the following list?\n\n[3, 1, 2]\n\nThe largest number of the list"


def test_a_template_field_the_line_lacks_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "ib"
    write_task(folder, "code_debug", {"id": 0, "context": "code", "input": ""})
    request = request_for(folder, dataset="InfiniteBench", tasks=["code_debug"], benchmark_prompt="task")
    with pytest.raises(DatasetError, match=r"code_debug\.jsonl:1: .*'OPTION_A'"):
        load_benchmark_records(request, no_tokenizer)


def test_the_summary_prompt_is_cann_recipes_wrapper_around_the_context(tmp_path: Path) -> None:
    folder = tmp_path / "ib"
    write_task(folder, "longbook_qa_eng", {"id": 0, "context": "A long book.", "input": "ignored", "answer": ["x"]})
    (record,) = load_benchmark_records(request_for(folder, dataset="InfiniteBench", max_new_tokens=50), no_tokenizer)
    assert record.prompt.startswith(
        "Please read a part of the book below, and then give me the summary.\n[start of the book]\nA long book.[end"
    )
    assert record.prompt.endswith("then tell the story in 50 words.\n\n ") and "ignored" not in record.prompt


# --- cuts -----------------------------------------------------------------------------------------------


def _summary_of(folder: Path, words: int, limit: int, chat: bool) -> tuple[str, LongContextRequest]:
    context = " ".join(f"w{i}" for i in range(3, 3 + words))
    write_task(folder, "passkey", {"id": 0, "context": context, "input": "q"})
    request = request_for(
        folder, dataset="InfiniteBench", tasks=["passkey"], input_truncated_len=limit, apply_chat_template=chat
    )
    (record,) = load_benchmark_records(request, tiny_tokenizer)
    assert record.prompt is not None
    return record.prompt, request


@pytest.mark.parametrize("chat", [True, False])
def test_summary_keeps_the_contexts_head_in_what_the_wrapper_leaves(tmp_path: Path, chat: bool) -> None:
    """cann-recipes: the context's first input_truncated_len - len(wrapper) tokens, the wrapper
    measured as the run will tokenize it (through the chat template when it is on)."""
    tokenizer = tiny_tokenizer()
    wrapper, _ = _summary_of(tmp_path / "empty", 0, 0, chat)
    wrapper_len = len(tokenize_record(PromptRecord(id="w", prompt=wrapper), tokenizer, chat))
    prompt, _ = _summary_of(tmp_path / "cut", 100, wrapper_len + 10, chat)
    assert " ".join(f"w{i}" for i in range(3, 13)) + "[end of the book]" in prompt
    assert "w13" not in prompt


def test_summary_refuses_a_limit_the_wrapper_fills(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="leaves no room"):
        _summary_of(tmp_path, 10, 5, True)


@pytest.mark.parametrize("chat", [True, False])
def test_task_prompts_are_cut_in_the_middle_and_fit_the_limit_with_their_question(
    tmp_path: Path, smollm2_dir: Path, chat: bool
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    facts = " ".join(f"Fact {i}: the lamp in room {i} is {'red' if i % 2 else 'blue'}." for i in range(400))
    folder = tmp_path / "lb"
    write_task(folder, "multifieldqa_en", longbench_line(facts, "What colour is the lamp in room 7?"))
    limit = 300
    request = request_for(
        folder, tasks=["multifieldqa_en"], benchmark_prompt="task", input_truncated_len=limit, apply_chat_template=chat
    )
    (record,) = load_benchmark_records(request, lambda: tokenizer)
    assert record.prompt is not None
    assert record.prompt.startswith("Read the following text and answer briefly.\n\nFact 0: the lamp")
    assert record.prompt.endswith("Question: What colour is the lamp in room 7?\nAnswer:")
    assert "Fact 200:" not in record.prompt
    assert limit - 4 <= len(tokenize_record(record, tokenizer, chat)) <= limit


def test_a_prompt_within_the_limit_is_not_cut(tmp_path: Path, smollm2_dir: Path) -> None:
    folder = tmp_path / "lb"
    write_task(folder, "trec", longbench_line("Q: Why? Type: reason", "Q: When?", "trec"))
    request = request_for(folder, tasks=["trec"], benchmark_prompt="task", input_truncated_len=200)
    (record,) = load_benchmark_records(request, lambda: AutoTokenizer.from_pretrained(smollm2_dir))
    assert record.prompt == LONGBENCH.templates["trec"].format(context="Q: Why? Type: reason", input="Q: When?")


def test_a_cann_recipes_run_file_naming_infinitebench_reads_the_folder_and_cuts_with_the_models_tokenizer(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    from executor.core.config import load_config
    from executor.offline.__main__ import load_records

    context = " ".join(f"w{i}" for i in range(3, 200))
    write_task(tmp_path / "ib", "longbook_qa_eng", {"id": 0, "context": context, "input": "Who?", "answer": ["x"]})
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(
        f"model_config:\n  model_path: {tiny_llama_dir}\n"
        f'data_config:\n  dataset: "InfiniteBench"\n  dataset_path: {tmp_path / "ib"}\n  input_truncated_len: 96\n'
    )
    (record,) = load_records(load_config(run_yaml))
    assert record.id == "longbook_qa_eng/0" and record.prompt is not None
    assert record.prompt.startswith("Please read a part of the book below") and "w199" not in record.prompt
