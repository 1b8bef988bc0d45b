"""cann-recipes' long-context data sets, `data_config.dataset: LongBench` or `InfiniteBench`, read
from the benchmarks' own JSONL files in a folder the user fills (they are not shipped).

cann-recipes (executor/utils/data_utils.py) reads every LongBench task and LongBench-E variant, or
InfiniteBench's longbook_qa_eng, takes each line's `context` alone, cuts its tokens from the head
to input_truncated_len less its wrapper's length and puts the rest in a fixed "read a part of the
book ... summarize it" wrapper. That is `benchmark_prompt: summary`, the default, so its YAML
files give the prompts they gave there. `benchmark_prompt: task` instead fills the template the
benchmark's repository gives for the task (LongBench's config/dataset2prompt.json, InfiniteBench's
src/prompt.py) and cuts the middle of the prompt, as their prediction scripts do. Scoring is not
done here. docs/configuration.md ("Long-context benchmarks") has the user's side.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from executor.core.config.sections import DataConfig
from executor.offline.dataset import DatasetError, PromptRecord, tokenize_record

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_QA_PASSAGES = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other "
    "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. "
    "Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULES = (
    "Answer the question as concisely as you can, using a single phrase or sentence if possible. If the "
    'question cannot be answered based on the information in the article, write "unanswerable". If the '
    'question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.'
)
# LongBench's config/dataset2prompt.json, task by task (its typo "asconcisely" in narrativeqa is
# the benchmark's and stays: the prompts must be the ones its scores were measured with).
_LONGBENCH_TEMPLATES = MappingProxyType(
    {
        "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. "
        "Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any "
        "explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you "
        "can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
        "qasper": f"You are given a scientific article and a question. {_QASPER_RULES}\n\nArticle: {{context}}\n\n "
        f"{_QASPER_RULES.replace('Answer the question', 'Answer the question based on the above article')}"
        "\n\nQuestion: {input}\n\nAnswer:",
        "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
        "question based on the above text, only give me the answer and do not output any other words.\n\n"
        "Question: {input}\nAnswer:",
        "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，"
        "只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
        "hotpotqa": _QA_PASSAGES,
        "2wikimqa": _QA_PASSAGES,
        "musique": _QA_PASSAGES,
        "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n"
        "请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
        "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
        "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above "
        "meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
        "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
        "{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",
        "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
        "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "{context}\n{input}",
        "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any "
        "other words. The following are some examples.\n\n{context}\n\n{input}",
        "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
        "{context}\n\n{input}",
        "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
        "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. "
        "Please carefully read these paragraphs and determine how many unique paragraphs there are after "
        "removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}"
        "\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
        "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine "
        "which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be like "
        '"Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',
        "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}"
        '\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
        "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
        "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
    }
)
# The tasks LongBench-E has again, over even lengths: files <task>_e.jsonl, the task's template.
_LONGBENCH_E = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)

_BOOK_OPTIONS = "A. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}"
_HIDDEN_INFO = "There is an important info hidden inside a lot of irrelevant text. Find it"
# InfiniteBench's src/prompt.py, its gpt4_templates (the chat-model set; no base-model cues such as
# "The pass key is"), task by task; the data files are <task>.jsonl.
_INFINITEBENCH_TEMPLATES = MappingProxyType(
    {
        "passkey": f"{_HIDDEN_INFO} and memorize them. I will quiz you about the important information there."
        "\n\n{context}\n\n{input}",
        "number_string": f"{_HIDDEN_INFO}. I will quiz you about the important information there.\n\n"
        "{context}\n\n{input}",
        "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n"
        "{context}\n\n{input}",
        "longbook_sum_eng": "Summarize the following book.\n\n{context}",
        "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {question}\n\n"
        "Only one of the following options is correct, tell me the answer using one single letter (A, B, C, or D). "
        f"Don't say anything else.\n{_BOOK_OPTIONS}",
        "longbook_qa_eng": "Read the book below and answer a question.\n\n{context}\n\nQuestion: {question}\n\n"
        "Be very concise.",
        "longbook_qa_chn": "请根据以下书籍回答我的问题。\n\n{context}\n\n问题：{question}\n请尽量简短地回答。",
        "longdialogue_qa_eng": "Below is a dialogue script where one random occurrence of a character name is "
        'replaced with "$$MASK$$", and you should try to guess who that character is.\n\nThe dialogue:\n\n---\n\n'
        '{context}\n\n---\n\nEnd of dialogue.\n\nWhich character is most likely "$$MASK$$"? Just say the name used '
        "by the scriptwriter (before the colon marks) of one single character and nothing else.",
        "math_find": "{prefix}\n\n{context}\n\n{input}",
        "math_calc": "Compute the intermediate values in the following long expression.\n\n{context}",
        "code_run": "Following is a set of Python functions. There is a function called named {func}.\n\n{context}"
        "\n\nPlease give me the exact number of the return value of {func_call}. Be concise. Your response must "
        "end with the final returned value.",
        "code_debug": "There is ONLY ONE function in the large project that is deliberately made to include an "
        "obvious error. Please find the function that contains the most obvious errors. I will give you four "
        "options to narrow your scope. You can inspect the options and think. Eventually, tell me the answer "
        f"using one single letter (A, B, C, or D).\n\n{{context}}\n\nWhich funtion has deliberate error?\n"
        f"{_BOOK_OPTIONS}\n\nYou should first find the functions in the options. Repeat their content, inspect "
        "through code, and at last give me your answer for the function that has the deliberate and obvious error "
        "in A, B, C, or D.",
    }
)

# cann-recipes' wrapper around a long-context text (build_dataset_input), the same for every task.
_SUMMARY_PREFIX = "Please read a part of the book below, and then give me the summary.\n[start of the book]\n"
_SUMMARY_SUFFIX = (
    "[end of the book]\n\nNow you have read it. Please summarize it for me. First, tell me the title and the "
    "author, and then tell the story in {max_new_tokens} words.\n\n "
)
_FIT_ROUNDS = 4  # re-cuts of a middle-cut prompt whose decoded text tokenizes longer than its budget


@dataclass(frozen=True, slots=True)
class Benchmark:
    """One long-context benchmark: its tasks' templates, cann-recipes' choice of them, and where
    its files come from (for the message when they are missing)."""

    name: str
    templates: Mapping[str, str]  # task (file stem) -> the benchmark's prompt template
    default_tasks: tuple[str, ...]  # the tasks cann-recipes reads
    download: str
    subfolders: tuple[str, ...] = ("",)  # where in the folder task files may lie


LONGBENCH = Benchmark(
    name="LongBench",
    templates=MappingProxyType(
        dict(_LONGBENCH_TEMPLATES) | {f"{task}_e": _LONGBENCH_TEMPLATES[task] for task in _LONGBENCH_E}
    ),
    default_tasks=(*_LONGBENCH_TEMPLATES, *(f"{task}_e" for task in _LONGBENCH_E)),
    download="unpack data.zip of huggingface.co/datasets/THUDM/LongBench there (its data/ folder is read too)",
    subfolders=("", "data"),
)
INFINITEBENCH = Benchmark(
    name="InfiniteBench",
    templates=_INFINITEBENCH_TEMPLATES,
    default_tasks=("longbook_qa_eng",),
    download="download them from huggingface.co/datasets/xinrongzhang2022/InfiniteBench into it",
)
BENCHMARKS = MappingProxyType({b.name: b for b in (LONGBENCH, INFINITEBENCH)})


@dataclass(frozen=True, slots=True)
class LongContextRequest:
    """What building a benchmark's prompts needs from the run's config."""

    benchmark: Benchmark
    folder: Path
    tasks: tuple[str, ...]
    style: str  # "summary" (cann-recipes' wrapper) or "task" (the benchmark's template)
    input_truncated_len: int  # 0 = no cut
    apply_chat_template: bool
    max_new_tokens: int  # cann-recipes' wrapper names it
    num_prompts: int = 0  # build only the first N prompts (tokenizing every example is slow); 0 = all


def benchmark_request(data_config: DataConfig, max_new_tokens: int, dataset_dir: Path) -> LongContextRequest | None:
    """The request data_config makes when its dataset is LongBench or InfiniteBench, else None.
    The folder is data_config.dataset_path, or dataset/<name> as in cann-recipes."""
    benchmark = BENCHMARKS.get(data_config.dataset.strip())
    if benchmark is None:
        if data_config.tasks:
            raise DatasetError(
                f"data_config.tasks only applies to {' and '.join(BENCHMARKS)}, not dataset {data_config.dataset!r}"
            )
        return None
    unknown = [task for task in data_config.tasks if task not in benchmark.templates]
    if unknown:
        raise DatasetError(
            f"unknown {benchmark.name} task(s) {unknown} in data_config.tasks; known: {', '.join(benchmark.templates)}"
        )
    folder = Path(data_config.dataset_path).expanduser() if data_config.dataset_path else dataset_dir / benchmark.name
    return LongContextRequest(
        benchmark=benchmark,
        folder=folder,
        tasks=tuple(dict.fromkeys(data_config.tasks)) or benchmark.default_tasks,
        style=data_config.benchmark_prompt,
        input_truncated_len=data_config.input_truncated_len,
        apply_chat_template=data_config.apply_chat_template,
        max_new_tokens=max_new_tokens,
        num_prompts=data_config.num_prompts,
    )


def task_files(request: LongContextRequest) -> dict[str, Path]:
    """Each task's file, <task>.jsonl in the folder (or a subfolder the benchmark unpacks to); one
    DatasetError line naming every missing file, where they go and where they come from."""
    benchmark, folder = request.benchmark, request.folder
    if folder.exists() and not folder.is_dir():
        raise DatasetError(
            f"{benchmark.name}: data_config.dataset_path {str(folder)!r} must be the folder of its files"
        )
    found: dict[str, Path] = {}
    for task in request.tasks:
        candidates = (folder / sub / f"{task}.jsonl" for sub in benchmark.subfolders)
        path = next((path for path in candidates if path.is_file()), None)
        if path is not None:
            found[task] = path
    missing = [f"{task}.jsonl" for task in request.tasks if task not in found]
    if missing:
        raise DatasetError(
            f"{benchmark.name}: {len(missing)} of {len(request.tasks)} task file(s) missing in {folder}: "
            f"{', '.join(missing)}; {benchmark.download}, or point data_config.dataset_path at the folder that "
            "holds them (data_config.tasks chooses the tasks)"
        )
    return found


def read_examples(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; a line that is not a JSON object is an error."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: cannot read: {exc}") from None
    examples = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise DatasetError(f"{path}:{line_no}: invalid JSON: {' '.join(str(exc).split())}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("context"), str):
            raise DatasetError(f"{path}:{line_no}: expected a JSON object with a string 'context'")
        examples.append((line_no, obj))
    if not examples:
        raise DatasetError(f"{path}: no examples")
    return examples


def template_fields(example: dict[str, Any]) -> dict[str, str]:
    """The names the templates use, from a line's own fields; InfiniteBench's code_run and math_find
    templates name a function call and a target that its scripts take out of `input`."""
    question = str(example.get("input", ""))
    fields = {"context": example["context"], "input": question, "question": question}
    options = example.get("options")
    if isinstance(options, list) and len(options) >= 4:
        fields |= {f"OPTION_{letter}": str(option) for letter, option in zip("ABCD", options, strict=False)}
    if call := re.search(r"func_[0-9]+\(-?[0-9]+\)", question):
        fields |= {"func_call": call.group(0), "func": call.group(0).split("(")[0]}
    if target := re.search(r"The .+ of", question):
        fields["prefix"] = f"What is {target.group(0).lower()[:-3]} in the following list?"
    return fields


def fill_template(template: str, example: dict[str, Any], where: str) -> str:
    try:
        return template.format(**template_fields(example))
    except KeyError as exc:
        raise DatasetError(
            f"{where}: the task's template needs {exc.args[0]!r}, which this line does not give"
        ) from None


def summary_prompt(
    context: str, request: LongContextRequest, tokenizer: PreTrainedTokenizerBase | None, where: str
) -> str:
    """cann-recipes' prompt: the context's first input_truncated_len - (wrapper's tokens) tokens,
    decoded, inside its summarize-the-book wrapper."""
    suffix = _SUMMARY_SUFFIX.format(max_new_tokens=request.max_new_tokens)
    if not request.input_truncated_len:
        return _SUMMARY_PREFIX + context + suffix
    assert tokenizer is not None, "a cut needs the tokenizer"
    wrapper = PromptRecord(id=where, prompt=_SUMMARY_PREFIX + suffix)
    wrapper_len = len(tokenize_record(wrapper, tokenizer, request.apply_chat_template))
    budget = request.input_truncated_len - wrapper_len
    if budget <= 0:
        raise DatasetError(
            f"input_truncated_len {request.input_truncated_len} leaves no room for the text: cann-recipes' "
            f"{request.benchmark.name} wrapper alone is {wrapper_len} tokens"
        )
    kept = tokenizer(context)["input_ids"][:budget]
    return _SUMMARY_PREFIX + tokenizer.decode(kept, skip_special_tokens=True) + suffix


def middle_cut_prompt(
    prompt: str, request: LongContextRequest, tokenizer: PreTrainedTokenizerBase | None, where: str
) -> str:
    """The benchmarks' own cut: a prompt longer than the budget keeps its first and last halves of
    it (instructions and question sit at both ends). The budget is input_truncated_len less the chat
    template's tokens, re-cut while the decoded text tokenizes longer, so the run's own head cut to
    input_truncated_len never takes the question off the end."""
    limit = request.input_truncated_len
    if not limit:
        return prompt
    assert tokenizer is not None, "a cut needs the tokenizer"
    empty = PromptRecord(id=where, prompt="")
    budget = limit - len(tokenize_record(empty, tokenizer, request.apply_chat_template))
    token_ids = tokenizer.encode(prompt)
    cut = prompt
    for _ in range(_FIT_ROUNDS):
        if budget < 2:
            raise DatasetError(f"{where}: input_truncated_len {limit} leaves no room for the prompt")
        if len(token_ids) <= budget:
            return cut
        half = budget // 2
        head = tokenizer.decode(token_ids[:half], skip_special_tokens=True)
        cut = head + tokenizer.decode(token_ids[-half:], skip_special_tokens=True)
        excess = (
            len(tokenize_record(PromptRecord(id=where, prompt=cut), tokenizer, request.apply_chat_template)) - limit
        )
        if excess <= 0:
            return cut
        budget -= excess
    return cut


def load_benchmark_records(
    request: LongContextRequest, tokenizer_factory: Callable[[], PreTrainedTokenizerBase]
) -> list[PromptRecord]:
    """Every example of the chosen tasks, in task order, as prompt records with ids <task>/<n>.
    The files are checked before the tokenizer (needed only to cut) is loaded."""
    files = task_files(request)
    examples = [
        (task, index, line_no, example)
        for task, path in files.items()
        for index, (line_no, example) in enumerate(read_examples(path))
    ]
    tokenizer = tokenizer_factory() if request.input_truncated_len else None
    records = []
    for task, index, line_no, example in examples[: request.num_prompts or None]:
        where = f"{files[task].name}:{line_no}"
        if request.style == "summary":
            prompt = summary_prompt(example["context"], request, tokenizer, where)
        else:
            filled = fill_template(request.benchmark.templates[task], example, f"{files[task]}:{line_no}")
            prompt = middle_cut_prompt(filled, request, tokenizer, where)
        content_hash = hashlib.sha256(json.dumps({"prompt": prompt}, sort_keys=True).encode()).hexdigest()
        records.append(PromptRecord(id=f"{task}/{index}", prompt=prompt, content_hash=content_hash, where=where))
    return records
