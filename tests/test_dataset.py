"""Specification of the prompt dataset: where files are found, what a valid line is, how records tokenize."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from executor.offline.dataset import (
    DATASET_DIR,
    DatasetError,
    PromptRecord,
    check_token_ids,
    load_prompts,
    repeat_to_count,
    resolve_dataset_path,
    tokenize_record,
)
from tests.factories import word_tokenizer


def write_jsonl(path: Path, *lines: object) -> Path:
    """Objects are dumped as JSON; strings are written verbatim (for blank or broken lines)."""
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    path.write_text(text + "\n", encoding="utf-8")
    return path


# --- resolve_dataset_path -------------------------------------------------------------------------


def test_dataset_path_wins_over_dataset_name(tmp_path: Path) -> None:
    explicit = write_jsonl(tmp_path / "mine.jsonl", {"prompt": "hi"})
    write_jsonl(tmp_path / "default.jsonl", {"prompt": "hi"})
    assert resolve_dataset_path("default", str(explicit), tmp_path) == explicit


def test_missing_dataset_path_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="nope.jsonl"):
        resolve_dataset_path("default", str(tmp_path / "nope.jsonl"), tmp_path)


def test_dataset_name_resolves_with_or_without_suffix(tmp_path: Path) -> None:
    expected = write_jsonl(tmp_path / "default.jsonl", {"prompt": "hi"})
    assert resolve_dataset_path("default", None, tmp_path) == expected
    assert resolve_dataset_path("default.jsonl", None, tmp_path) == expected


def test_unknown_dataset_name_lists_the_available_ones(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "default.jsonl", {"prompt": "hi"})
    write_jsonl(tmp_path / "long.jsonl", {"prompt": "hi"})
    with pytest.raises(DatasetError, match="unknown dataset 'gsm8k'.*available: default, long"):
        resolve_dataset_path("gsm8k", None, tmp_path)


def test_dataset_name_that_is_a_path_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="use dataset_path"):
        resolve_dataset_path("../secret", None, tmp_path)


def test_shipped_default_dataset_is_found() -> None:
    assert resolve_dataset_path("default", None, DATASET_DIR) == DATASET_DIR / "default.jsonl"


# --- load_prompts: valid files --------------------------------------------------------------------


def test_each_prompt_kind_loads(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}]
    path = write_jsonl(
        tmp_path / "d.jsonl",
        {"prompt": "hello"},
        {"messages": messages},
        {"prompt_token_ids": [0, 5, 7]},
    )
    assert load_prompts(path) == [
        PromptRecord(id="0", prompt="hello"),
        PromptRecord(id="1", messages=messages),
        PromptRecord(id="2", prompt_token_ids=[0, 5, 7]),
    ]


def test_default_id_is_the_record_index_not_the_line_number(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", "", {"prompt": "a"}, "   ", {"prompt": "b"})
    assert [r.id for r in load_prompts(path)] == ["0", "1"]


def test_explicit_ids_may_be_strings_or_ints(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", {"id": "q-a", "prompt": "a"}, {"id": 42, "prompt": "b"})
    assert [r.id for r in load_prompts(path)] == ["q-a", "42"]


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", "", {"prompt": "a"}, "\t", "", {"prompt": "b"}, "")
    assert [r.prompt for r in load_prompts(path)] == ["a", "b"]


# --- load_prompts: errors name the file and the 1-based line --------------------------------------


def load_error(tmp_path: Path, *lines: object) -> str:
    path = write_jsonl(tmp_path / "bad.jsonl", *lines)
    with pytest.raises(DatasetError) as info:
        load_prompts(path)
    return str(info.value)


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"prompt": "ok"}, "", '{"prompt": "unterminated}')
    assert f"{tmp_path / 'bad.jsonl'}:3:" in message
    assert "invalid JSON" in message


def test_line_that_is_not_an_object_is_an_error(tmp_path: Path) -> None:
    assert "bad.jsonl:1: expected a JSON object, got list" in load_error(tmp_path, '["a prompt"]')


def test_line_with_no_prompt_field_is_an_error(tmp_path: Path) -> None:
    assert "bad.jsonl:1: expected exactly one of" in load_error(tmp_path, {"id": "x"})


def test_line_with_two_prompt_fields_is_an_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"prompt": "a", "prompt_token_ids": [1]})
    assert "bad.jsonl:1:" in message and "found ['prompt', 'prompt_token_ids']" in message


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    assert "bad.jsonl:1: unknown key(s) ['promt']" in load_error(tmp_path, {"prompt": "a", "promt": "b"})


def record_error(tmp_path: Path, line: object) -> str:
    """The error of a line that loads but fails alone; a good line after it still loads."""
    path = write_jsonl(tmp_path / "bad.jsonl", line, {"id": "fine", "prompt": "ok"})
    bad, fine = load_prompts(path)
    assert fine.error is None and fine.prompt == "ok"
    assert bad.error is not None and (bad.prompt, bad.messages, bad.prompt_token_ids) == (None, None, None)
    return bad.error


@pytest.mark.parametrize("prompt", ["", "   ", 7, None, ["a"]])
def test_prompt_must_be_a_non_empty_string(tmp_path: Path, prompt: object) -> None:
    assert "bad.jsonl:1: 'prompt' must be a non-empty string" in record_error(tmp_path, {"prompt": prompt})


def test_prompt_with_a_lone_surrogate_fails_alone(tmp_path: Path) -> None:
    assert "lone surrogate" in record_error(tmp_path, '{"prompt": "a \\ud800 b"}')


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        ["hi"],
        [{"role": "user"}],
        [{"role": "user", "content": "hi", "name": "x"}],
        [{"role": "", "content": "hi"}],
        [{"role": 1, "content": "hi"}],
        [{"role": "user", "content": ["hi"]}],
    ],
)
def test_messages_must_be_a_non_empty_list_of_role_and_content(tmp_path: Path, messages: object) -> None:
    assert "bad.jsonl:1: 'messages'" in record_error(tmp_path, {"messages": messages})


@pytest.mark.parametrize("token_ids", [[], [1, -1], [1, 2.0], [True], "1 2", [1, "2"], [1e400]])
def test_prompt_token_ids_must_be_non_negative_ints(tmp_path: Path, token_ids: object) -> None:
    assert "bad.jsonl:1: 'prompt_token_ids'" in record_error(tmp_path, {"prompt_token_ids": token_ids})


def test_token_ids_outside_the_vocabulary_fail_alone_naming_the_index() -> None:
    records = [
        PromptRecord(id="ok", prompt_token_ids=[0, 255]),
        PromptRecord(id="big", prompt_token_ids=[3, 256]),
        PromptRecord(id="huge", prompt_token_ids=[2**70]),
    ]
    ok, big, huge = check_token_ids(records, vocab_size=256)
    assert ok == records[0]
    assert big.error == "big: 'prompt_token_ids'[1] = int 256 is outside the model's vocabulary [0, 256)"
    assert big.prompt_token_ids is None and "[0]" in huge.error


def test_a_number_with_too_many_digits_is_a_clear_error(tmp_path: Path) -> None:
    assert "bad.jsonl:1: invalid JSON: a number has too many digits" in load_error(
        tmp_path, '{"prompt_token_ids": [' + "9" * 5000 + "]}"
    )


def test_a_line_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:2: not UTF-8"):
        load_prompts(path)


def test_content_hash_ignores_the_id_and_key_order_but_not_the_prompt(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "d.jsonl",
        '{"id": "a", "prompt": "x"}',
        '{"prompt": "x", "id": "b"}',
        '{"id": "c", "prompt": "y"}',
    )
    a, b, c = load_prompts(path)
    assert a.content_hash == b.content_hash != c.content_hash


@pytest.mark.parametrize("record_id", ["", True, 1.5, None, ["a"]])
def test_id_must_be_a_non_empty_string_or_an_int(tmp_path: Path, record_id: object) -> None:
    assert "bad.jsonl:1: 'id' must be" in load_error(tmp_path, {"id": record_id, "prompt": "a"})


def test_duplicate_ids_name_both_lines(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"id": "a", "prompt": "x"}, {"prompt": "y"}, "", {"id": "a", "prompt": "z"})
    assert "bad.jsonl:4: duplicate id 'a' (first used on line 1)" in message


def test_explicit_id_clashing_with_a_default_id_is_a_duplicate(tmp_path: Path) -> None:
    message = load_error(tmp_path, {"prompt": "x"}, {"id": 0, "prompt": "y"})
    assert "bad.jsonl:2: duplicate id '0' (first used on line 1)" in message


def test_empty_dataset_names_the_file(tmp_path: Path) -> None:
    message = load_error(tmp_path, "", "  ")
    assert f"{tmp_path / 'bad.jsonl'}: dataset has no records" in message


def test_missing_file_is_a_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="absent.jsonl: cannot read"):
        load_prompts(tmp_path / "absent.jsonl")


# --- the shipped dataset --------------------------------------------------------------------------


def test_shipped_default_dataset_loads_with_unique_ids() -> None:
    records = load_prompts(DATASET_DIR / "default.jsonl")
    assert len(records) >= 32
    assert len({r.id for r in records}) == len(records)
    assert any(r.messages is not None for r in records)


# --- tokenize_record ------------------------------------------------------------------------------

VOCAB = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "hello", "world", "how", "are", "you"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ID = {word: index for index, word in enumerate(VOCAB)}


def tiny_tokenizer(chat_template: str | None = CHAT_TEMPLATE):
    """A whitespace word-level tokenizer that prepends BOS on encode, as Llama's does; built offline."""
    return word_tokenizer(
        ID,
        chat_template,
        prepend_bos=True,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
    )


def test_prompt_token_ids_are_returned_as_given() -> None:
    record = PromptRecord(id="0", prompt_token_ids=[9, 8, 7])
    assert tokenize_record(record, tiny_tokenizer(), apply_chat_template=True) == [9, 8, 7]


def test_text_without_chat_template_is_encoded_with_the_tokenizers_default_specials() -> None:
    record = PromptRecord(id="0", prompt="hello world")
    expected = [ID["<s>"], ID["hello"], ID["world"]]
    assert tokenize_record(record, tiny_tokenizer(), apply_chat_template=False) == expected


def test_text_with_chat_template_becomes_one_user_message_with_a_single_bos() -> None:
    record = PromptRecord(id="0", prompt="hello world")
    token_ids = tokenize_record(record, tiny_tokenizer(), apply_chat_template=True)
    assert token_ids == [ID[w] for w in ["<s>", "<|user|>", "hello", "world", "<|end|>", "<|assistant|>"]]
    assert all(type(t) is int for t in token_ids)


def test_messages_always_go_through_the_chat_template() -> None:
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "how are you"},
        {"role": "user", "content": "world"},
    ]
    record = PromptRecord(id="chat", messages=messages)
    expected_words = [
        "<s>", "<|user|>", "hello", "<|end|>", "<|assistant|>", "how", "are", "you", "<|end|>",
        "<|user|>", "world", "<|end|>", "<|assistant|>",
    ]  # fmt: skip
    expected = [ID[w] for w in expected_words]
    assert tokenize_record(record, tiny_tokenizer(), apply_chat_template=False) == expected
    assert tokenize_record(record, tiny_tokenizer(), apply_chat_template=True) == expected


def test_messages_without_a_chat_template_name_the_record() -> None:
    record = PromptRecord(id="chat-7", messages=[{"role": "user", "content": "hello"}])
    with pytest.raises(DatasetError, match="record 'chat-7'.*no chat template"):
        tokenize_record(record, tiny_tokenizer(chat_template=None), apply_chat_template=False)


def test_text_needing_a_missing_chat_template_names_the_record() -> None:
    record = PromptRecord(id="q3", prompt="hello")
    with pytest.raises(DatasetError, match="record 'q3'.*no chat template"):
        tokenize_record(record, tiny_tokenizer(chat_template=None), apply_chat_template=True)


def test_plain_text_works_with_a_tokenizer_that_has_no_chat_template() -> None:
    record = PromptRecord(id="q3", prompt="hello")
    tokenizer = tiny_tokenizer(chat_template=None)
    assert tokenize_record(record, tokenizer, apply_chat_template=False) == [ID["<s>"], ID["hello"]]


def test_a_line_overrides_sampling_parameters_with_values_of_their_type(tmp_path: Path) -> None:
    overrides = {"max_new_tokens": 4, "temperature": 0, "top_p": 1, "min_p": 0.1, "repetition_penalty": 1.2}
    overrides |= {"frequency_penalty": -0.5, "presence_penalty": 1, "logprobs": 3, "prompt_logprobs": 0, "seed": 9}
    path = write_jsonl(tmp_path / "p.jsonl", {"prompt": "hi", "stop_token_ids": [13, 7], **overrides})
    (record,) = load_prompts(path)
    assert record.sampling_overrides == overrides | {"stop_token_ids": (13, 7)}


@pytest.mark.parametrize(
    "override, words",
    [
        ({"max_new_tokens": 2.5}, "'max_new_tokens' must be int"),
        ({"temperature": "hot"}, "'temperature' must be float"),
        ({"ignore_eos": 1}, "'ignore_eos' must be bool"),
        ({"top_k": True}, "'top_k' must be int"),
        ({"min_p": "0.1"}, "'min_p' must be float"),
        ({"logprobs": 1.5}, "'logprobs' must be int"),
        ({"logprobs": None}, "'logprobs' must be int"),
        ({"prompt_logprobs": 2.0}, "'prompt_logprobs' must be int"),
        ({"stop_token_ids": [1, "x"]}, "'stop_token_ids' must be a list of ints"),
    ],
)
def test_a_sampling_value_of_the_wrong_type_fails_its_line_alone(tmp_path: Path, override: dict, words: str) -> None:
    assert words in record_error(tmp_path, {"prompt": "hi", **override})


# --- cann-recipes' prompt file and batch_size meaning ----------------------------------------------


@pytest.mark.parametrize(("text", "prompts"), [("one prompt", ["one prompt"]), (["a", "b c"], ["a", "b c"])])
def test_cann_recipes_text_file_gives_one_record_per_text(tmp_path, text, prompts):
    path = tmp_path / "default_prompt.json"
    path.write_text(json.dumps({"text": text}, indent=4))
    records = load_prompts(path)
    assert [(r.id, r.prompt) for r in records] == [(str(i), p) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("obj", [{"prompt": "x"}, {"text": "x", "extra": 1}, ["x"], {"text": []}])
def test_a_json_dataset_that_is_not_cann_recipes_text_format_is_an_error(tmp_path, obj):
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(DatasetError, match="prompts.json"):
        load_prompts(path)


def test_dataset_name_finds_a_json_file_when_no_jsonl_has_the_name(tmp_path):
    (tmp_path / "default_prompt.json").write_text('{"text": "x"}')
    assert resolve_dataset_path("default_prompt", None, tmp_path) == tmp_path / "default_prompt.json"
    with pytest.raises(DatasetError, match="available: default_prompt"):
        resolve_dataset_path("nope", None, tmp_path)


def test_repeat_to_count_cycles_the_records_with_unique_ids_or_cuts_them():
    records = [PromptRecord(id="a", prompt="x"), PromptRecord(id="b", prompt="y")]
    assert [r.id for r in repeat_to_count(records, 5)] == ["a", "b", "a#1", "b#1", "a#2"]
    assert [r.prompt for r in repeat_to_count(records, 3)] == ["x", "y", "x"]
    assert [r.id for r in repeat_to_count(records, 1)] == ["a"]


def test_chat64_is_the_throughput_workload_of_64_chat_prompts_of_20_to_220_tokens(smollm2_dir):
    """benchmarks/bench_vs_transformers.py --dataset chat64: the workload of the speed goals."""
    from transformers import AutoTokenizer

    records = load_prompts(DATASET_DIR / "chat64.jsonl")
    assert len(records) == 64 and len({record.id for record in records}) == 64
    assert all(record.error is None and record.prompt_token_ids is None for record in records)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    lengths = [len(tokenize_record(record, tokenizer, apply_chat_template=True)) for record in records]
    assert 20 <= min(lengths) and max(lengths) <= 220


def test_the_drafters_training_prompts_are_disjoint_from_the_benchmarked_ones() -> None:
    """spec_train.jsonl trains the SmolLM2 drafters; the speculation benchmarks run default.jsonl and
    chat64.jsonl, so no prompt (user turn) of theirs may be one the drafters saw, nor may one repeat."""

    def user_texts(name: str) -> list[str]:
        texts = []
        for record in load_prompts(DATASET_DIR / name):
            turns = [m["content"] for m in record.messages or [] if m["role"] == "user"]
            texts += [" ".join(text.lower().split()) for text in [record.prompt or "", *turns] if text]
        return texts

    training = user_texts("spec_train.jsonl")
    assert len(training) == len(set(training)) == 2391
    assert not set(training) & set(user_texts("default.jsonl") + user_texts("chat64.jsonl"))
