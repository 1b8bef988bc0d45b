"""Prompt datasets: find the JSONL file a run names, validate every line, turn records into token ids.

cann-recipes' own prompt file format, one JSON object {"text": "..."} or {"text": ["...", ...]}
(its dataset/default_prompt.json), is read too: a file ending in .json is taken to be one.

A line whose shape is wrong (not JSON, unknown keys, no prompt, a bad or duplicate id) fails the
run before the model loads, with the file and line number. A well-formed line whose prompt value
is unusable (empty, not integers, token ids outside the vocabulary) becomes a record that carries
its error: that request fails alone, with the reason in outputs.jsonl, and the others run.
dataset/README.md describes the format.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from executor.types_.structured_output import GUIDED_FIELDS, parse_structured_output

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DATASET_DIR = Path(__file__).resolve().parents[2] / "dataset"

_PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
# Per-line overrides of the run's SamplingParams, with the JSON type each must have.
SAMPLING_FIELDS: dict[str, type] = {
    "max_new_tokens": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "seed": int,
    "min_p": float,
    "repetition_penalty": float,
    "frequency_penalty": float,
    "presence_penalty": float,
    "logprobs": int,
    "prompt_logprobs": int,
    "ignore_eos": bool,
    "stop_token_ids": list,
    "bad_words": list,
}
# What the output must match (vLLM's names): one of them becomes SamplingParams.structured_output.
_STRUCTURED_FIELDS = (*GUIDED_FIELDS, "structured_outputs")
_ALLOWED_KEYS = frozenset(("id", *_PROMPT_FIELDS, *SAMPLING_FIELDS, *_STRUCTURED_FIELDS))


class DatasetError(ValueError):
    """A dataset that cannot be found, read or used; the message names the file (and line)."""


@dataclass(slots=True)
class PromptRecord:
    """One prompt as the dataset gives it: exactly one of prompt, messages, prompt_token_ids is set,
    or none and `error` says why the line cannot be served (the request then fails alone)."""

    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    # SamplingParams fields this line overrides (types checked here, ranges when the request is made).
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    # sha256 of the line's JSON object without its id: what a resumed run matches its requests on
    content_hash: str = field(default="", compare=False)
    where: str = field(default="", compare=False)  # "file.jsonl:7", to name the line in messages

    def __post_init__(self) -> None:
        num_set = sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids))
        expected = 0 if self.error else 1
        assert num_set == expected, f"record {self.id!r}: {expected} prompt field(s) must be set, got {num_set}"


def resolve_dataset_path(dataset: str, dataset_path: str | None, dataset_dir: Path) -> Path:
    """data_config.dataset_path wins when given; else data_config.dataset names a file in dataset_dir."""
    if dataset_path:
        path = Path(dataset_path).expanduser()
        if not path.is_file():
            raise DatasetError(f"dataset_path {str(path)!r} does not exist or is not a file")
        return path
    name = dataset.strip()
    if not name or "/" in name or "\\" in name:
        raise DatasetError(
            f"dataset must be the name of a file in {dataset_dir}, got {dataset!r}; "
            "use dataset_path for a file elsewhere"
        )
    file_names = [name] if name.endswith((".jsonl", ".json")) else [f"{name}.jsonl", f"{name}.json"]
    for file_name in file_names:
        if (dataset_dir / file_name).is_file():
            return dataset_dir / file_name
    found = sorted(p.name for p in dataset_dir.glob("*.json*")) if dataset_dir.is_dir() else []
    available = [p.rsplit(".", 1)[0] for p in found if p.endswith((".jsonl", ".json"))]
    raise DatasetError(
        f"unknown dataset {dataset!r}: no {' or '.join(file_names)} in {dataset_dir}; "
        f"available: {', '.join(available) or 'none'}"
    )


def load_prompts(path: Path) -> list[PromptRecord]:
    """Read and validate a JSONL prompt file (blank lines are skipped, a malformed line is an
    error), or a .json file in cann-recipes' {"text": ...} format."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read dataset: {exc.strerror or exc}") from None
    if path.suffix == ".json":
        return _load_text_prompts(data, path)
    raw_lines = data.split(b"\n")
    records: list[PromptRecord] = []
    line_of_id: dict[str, int] = {}
    for line_no, raw_line in enumerate(raw_lines, start=1):
        try:
            line = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DatasetError(f"{path}:{line_no}: not UTF-8 (byte 0x{raw_line[exc.start]:02x})") from None
        if not line.strip():
            continue
        try:
            record = _parse_record(line, default_id=str(len(records)))
        except ValueError as exc:  # json.JSONDecodeError is a ValueError too
            raise DatasetError(f"{path}:{line_no}: {exc}") from None
        except RecursionError:
            raise DatasetError(f"{path}:{line_no}: JSON nested too deeply") from None
        record.where = f"{path.name}:{line_no}"
        if record.error:
            record.error = f"{record.where}: {record.error}"
        if record.id in line_of_id:
            raise DatasetError(
                f"{path}:{line_no}: duplicate id {record.id!r} (first used on line {line_of_id[record.id]})"
            )
        line_of_id[record.id] = line_no
        records.append(record)
    if not records:
        raise DatasetError(f"{path}: dataset has no records")
    return records


def _load_text_prompts(data: bytes, path: Path) -> list[PromptRecord]:
    """cann-recipes' prompt file: {"text": "a prompt"} or {"text": ["a prompt", ...]}; ids 0, 1, ..."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    except ValueError as exc:
        raise DatasetError(f"{path}: invalid JSON: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise DatasetError(f"{path}: JSON nested too deeply") from None
    if not isinstance(obj, dict) or set(obj) != {"text"}:
        got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DatasetError(f'{path}: a .json dataset must be one object {{"text": ...}}, got {got}')
    texts = obj["text"] if isinstance(obj["text"], list) else [obj["text"]]
    if not texts:
        raise DatasetError(f"{path}: dataset has no records")
    records = []
    for index, text in enumerate(texts):
        content_hash = hashlib.sha256(json.dumps({"prompt": text}, sort_keys=True).encode()).hexdigest()
        try:
            record = PromptRecord(id=str(index), prompt=_parse_prompt(text), content_hash=content_hash)
        except ValueError as exc:
            record = PromptRecord(id=str(index), error=f"{path.name} text[{index}]: {exc}", content_hash=content_hash)
        record.where = f"{path.name} text[{index}]"
        records.append(record)
    return records


def repeat_to_count(records: list[PromptRecord], count: int) -> list[PromptRecord]:
    """cann-recipes' batch_size meaning: exactly `count` requests, the records repeated in order
    (or cut). A repeat gets the id `<id>#<n>`, so that ids stay unique."""
    repeated = []
    for index in range(count):
        record, copy = records[index % len(records)], index // len(records)
        repeated.append(replace(record, id=f"{record.id}#{copy}") if copy else record)
    return repeated


def _parse_record(line: str, default_id: str) -> PromptRecord:
    """One line to a PromptRecord. A line of the wrong shape raises ValueError (the caller adds
    file:line); an unusable prompt value gives a record with `error` set."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON: {exc.msg} at column {exc.colno}") from None
    except ValueError:  # Python refuses to parse integers of more than sys.get_int_max_str_digits() digits
        raise ValueError("invalid JSON: a number has too many digits") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _ALLOWED_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(_ALLOWED_KEYS)}")
    present = [f for f in _PROMPT_FIELDS if f in obj]
    if len(present) != 1:
        found = f"found {present}" if present else "found none"
        raise ValueError(f"expected exactly one of {list(_PROMPT_FIELDS)}, {found}")
    record_id = _parse_id(obj["id"]) if "id" in obj else default_id
    content = {key: value for key, value in obj.items() if key != "id"}
    content_hash = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    field_name = present[0]
    try:
        fields = {field_name: _PARSERS[field_name](obj[field_name])}
        overrides = _parse_sampling_overrides(obj)
    except ValueError as exc:
        return PromptRecord(id=record_id, error=str(exc), content_hash=content_hash)
    return PromptRecord(id=record_id, **fields, sampling_overrides=overrides, content_hash=content_hash)


def _parse_prompt(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"'prompt' must be a non-empty string, got {_describe(value)}")
    _check_encodable(value, "'prompt'")
    return value


def _parse_token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"'prompt_token_ids' must be a non-empty list of ints, got {_describe(value)}")
    for index, token_id in enumerate(value):
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"'prompt_token_ids'[{index}] must be a non-negative int, got {_describe(token_id)}")
    return value


def _parse_sampling_overrides(obj: dict[str, Any]) -> dict[str, Any]:
    """The line's sampling keys, each of its JSON type (an int is a fine float; a bool is no number)."""
    overrides: dict[str, Any] = {}
    for key, expected in SAMPLING_FIELDS.items():
        if key not in obj:
            continue
        value = obj[key]
        numeric = (int, float) if expected is float else expected
        if (isinstance(value, bool) and expected is not bool) or not isinstance(value, numeric):
            raise ValueError(f"{key!r} must be {expected.__name__}, got {_describe(value)}")
        if key == "stop_token_ids" and not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ValueError(f"'stop_token_ids' must be a list of ints, got {_describe(value)}")
        if key == "bad_words" and not all(isinstance(word, str) and word.strip() for word in value):
            raise ValueError(f"'bad_words' must be a list of non-empty strings, got {_describe(value)}")
        overrides[key] = tuple(value) if key in ("stop_token_ids", "bad_words") else value
    structured_output = parse_structured_output(obj)
    if structured_output is not None:
        overrides["structured_output"] = structured_output
    return overrides


def _parse_id(value: Any) -> str:
    # bool is an int subclass; `"id": true` is a mistake, not the id "True".
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ValueError(f"'id' must be a non-empty string or an int, got {_describe(value)}")
    return str(value)


def _parse_messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"'messages' must be a non-empty list of {{role, content}}, got {_describe(value)}")
    for index, message in enumerate(value):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ValueError(
                f"'messages'[{index}] must be an object with exactly 'role' and 'content', got {message!r}"
            )
        if not isinstance(message["role"], str) or not message["role"]:
            raise ValueError(f"'messages'[{index}].role must be a non-empty string, got {message['role']!r}")
        if not isinstance(message["content"], str):
            content = message["content"]
            raise ValueError(f"'messages'[{index}].content must be a string, got {_describe(content)}")
        _check_encodable(message["role"] + message["content"], f"'messages'[{index}]")
    return value


def _check_encodable(text: str, where: str) -> None:
    """JSON can spell lone surrogates ("\\ud800") that no tokenizer or UTF-8 file can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} holds a lone surrogate, which is not valid Unicode") from None


_PARSERS = {"prompt": _parse_prompt, "messages": _parse_messages, "prompt_token_ids": _parse_token_ids}


def check_token_ids(records: list[PromptRecord], vocab_size: int) -> list[PromptRecord]:
    """Records whose given token ids fall outside [0, vocab_size) turn into records that fail alone."""
    checked = []
    for record in records:
        token_ids = record.prompt_token_ids or []
        bad = next((i for i, token_id in enumerate(token_ids) if token_id >= vocab_size), None)
        if bad is not None:
            error = (
                f"{record.where or record.id}: 'prompt_token_ids'[{bad}] = {_describe(token_ids[bad])} is outside "
                f"the model's vocabulary [0, {vocab_size})"
            )
            record = replace(record, prompt_token_ids=None, error=error)
        checked.append(record)
    return checked


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def tokenize_record(record: PromptRecord, tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool) -> list[int]:
    """Token ids for one record: given ids as they are, messages always through the chat template,
    text through the chat template (as one user message) only when apply_chat_template is True.

    Plain text uses `tokenizer.encode(text)` with its default add_special_tokens=True, so the
    tokenizer adds what the model saw in pre-training and nothing more: some tokenizers prepend BOS,
    GPT-2 style BPE ones add nothing. The chat template path tokenizes with
    add_special_tokens=False (transformers does this itself), because templates that need BOS
    write `{{ bos_token }}` themselves; BOS therefore appears once either way.
    """
    if record.prompt_token_ids is not None:
        return list(record.prompt_token_ids)
    if record.messages is not None:
        messages = record.messages
    elif apply_chat_template:
        messages = [{"role": "user", "content": record.prompt}]
    else:
        return list(tokenizer.encode(record.prompt))
    if getattr(tokenizer, "chat_template", None) is None:
        why = "it has messages" if record.messages is not None else "apply_chat_template is on"
        raise DatasetError(f"record {record.id!r}: the tokenizer has no chat template, and {why}")
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (return_dict=True by default); 4.x returned the ids.
    token_ids = out["input_ids"] if isinstance(out, Mapping) else out
    return [int(token_id) for token_id in token_ids]
