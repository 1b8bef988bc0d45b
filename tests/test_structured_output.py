"""Structured output (xgrammar): the request fields that ask for it, the bitmask's two forms, the
verify rows' masks and the drafts the grammar cuts, and the real default model's outputs under a
set of schemas, a regex, a choice and a grammar, every one of which must parse and validate."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from executor.core.sampler.constraints import ConstraintStats
from executor.core.sampler.structured_output import (
    GrammarStates,
    StructuredOutputCompiler,
    allocate_bitmask,
    apply_token_bitmask,
    apply_token_bitmask_torch,
    unpack_bitmask,
)
from executor.offline.dataset import PromptRecord, _parse_record
from executor.offline.metrics import summarize
from executor.offline.offline_inference import RunResult, merge_replicas, structured_output_summary
from executor.types_ import Request, SamplingParams
from executor.types_.structured_output import (
    StructuredOutputSpec,
    parse_structured_output,
    response_format_spec,
)
from tests.engine_harness import make_inference
from tests.factories import make_request

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}
COLOURS = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "shades": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 2,
            "maxItems": 4,
        },
    },
    "required": ["colour", "shades"],
    "additionalProperties": False,
}
DATE_REGEX = r"(yes|no), (19|20)[0-9]{2}-(0[1-9]|1[0-2])"
CHOICES = ["Paris", "London", "Berlin"]
YES_NO_GRAMMAR = 'root ::= ("yes" | "no") " because " [a-z ]{1,20} "."'

# (id, prompt, fields asking for the constraint)
CASES = [
    ("person", "Describe a person as JSON.", {"guided_json": PERSON}),
    ("colours", "Give a colour and some shades as JSON.", {"structured_outputs": {"json": COLOURS}}),
    ("date", "Answer yes or no, then a date.", {"guided_regex": DATE_REGEX}),
    ("capital", "What is the capital of France?", {"guided_choice": CHOICES}),
    ("grammar", "Is the sky blue?", {"guided_grammar": YES_NO_GRAMMAR}),
    (
        "object",
        "Reply with a JSON object with the keys name and colour of a cat.",
        {"structured_outputs": {"json_object": True}},
    ),
]


def check_output(case_id: str, text: str) -> None:
    """The output parses and validates against what its case asked for."""
    fields = next(fields for cid, _, fields in CASES if cid == case_id)
    if "guided_json" in fields or "json" in fields.get("structured_outputs", {}):
        schema = fields.get("guided_json") or fields["structured_outputs"]["json"]
        jsonschema.validate(json.loads(text), schema)
    elif "json_object" in fields.get("structured_outputs", {}):
        assert isinstance(json.loads(text), dict), text
    elif "guided_regex" in fields:
        assert re.fullmatch(fields["guided_regex"], text), text
    elif "guided_choice" in fields:
        assert text in fields["guided_choice"], text
    else:
        assert re.fullmatch(r"(yes|no) because [a-z ]{1,20}\.", text), text


def records(cases=CASES) -> list[PromptRecord]:
    return [
        _parse_record(json.dumps({"id": case_id, "messages": [{"role": "user", "content": prompt}]} | fields), "0")
        for case_id, prompt, fields in cases
    ]


# -- the request fields ----------------------------------------------------------------------------


def test_each_name_gives_its_kind_and_a_json_schema_is_kept_as_canonical_text():
    assert parse_structured_output({"guided_json": '{"b": 1, "a": 2}'}) == StructuredOutputSpec(
        "json", '{"a": 2, "b": 1}'
    )
    assert parse_structured_output({"guided_regex": "a|b"}) == StructuredOutputSpec("regex", "a|b")
    assert parse_structured_output({"guided_choice": ["x", "y"]}) == StructuredOutputSpec("choice", ("x", "y"))
    assert parse_structured_output({"structured_outputs": {"grammar": 'root ::= "a"'}}).kind == "grammar"
    assert parse_structured_output({"structured_outputs": {"json_object": True}}).kind == "json_object"
    assert parse_structured_output({"guided_regex": "", "bad_words": ["x"]}) is None
    assert response_format_spec({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}).kind == "json"
    assert response_format_spec({"type": "json_object"}).kind == "json_object"
    assert response_format_spec({"type": "text"}) is None


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "at most one of"),
        ({"guided_choice": "Paris"}, "'guided_choice' must be a non-empty list"),
        ({"guided_json": "{not json"}, "'guided_json' is not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
        ({"structured_outputs": {"schema": "a"}}, "unknown key"),
    ],
)
def test_a_malformed_field_is_refused_naming_the_key(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_structured_output(fields)


def test_a_dataset_line_with_a_malformed_field_fails_alone_naming_it():
    record = _parse_record('{"id": "a", "prompt": "x", "guided_choice": []}', "0")
    assert record.error is None and "structured_output" not in record.sampling_overrides  # empty: not asked
    record = _parse_record('{"id": "a", "prompt": "x", "guided_choice": [1]}', "0")
    assert record.error is not None and "'guided_choice'" in record.error


# -- the bitmask ----------------------------------------------------------------------------------


def test_the_torch_bitmask_equals_xgrammars_kernel_and_a_bit_by_bit_reference():
    import xgrammar

    generator = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's high bits name no token
    logits = torch.randn(5, vocab, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=generator, dtype=torch.int32)
    rows = [0, 2, 3]
    expected = logits.clone()
    for index, row in enumerate(rows):
        for token in range(vocab):
            if not (int(bitmask[index, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(apply_token_bitmask_torch(logits, bitmask, rows), expected)
    assert torch.equal(apply_token_bitmask(logits, bitmask, rows), expected)  # the CPU's: xgrammar's kernel
    full = allocate_bitmask(5, vocab)
    full[rows] = bitmask
    xgrammar_logits = logits.clone()
    xgrammar.apply_token_bitmask_inplace(xgrammar_logits, full, vocab_size=vocab)
    assert torch.equal(xgrammar_logits, expected)
    half = apply_token_bitmask_torch(logits.bfloat16(), bitmask, rows)
    assert torch.equal(half.isinf(), expected.isinf())
    assert unpack_bitmask(allocate_bitmask(1, vocab), vocab).all()


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return StructuredOutputCompiler(tokenizer, 49152, [tokenizer.eos_token_id])


def structured_request(spec: StructuredOutputSpec, output: list[int]) -> Request:
    request = Request("r", None, [1, 2, 3], SamplingParams(structured_output=spec))
    request.output_token_ids = list(output)
    return request


def test_a_schema_that_does_not_compile_gives_the_compilers_message(compiler):
    with pytest.raises(
        ValueError, match="regex does not compile: Regex parsing error at position 5: The parenthesis is not closed"
    ):
        compiler.compile(StructuredOutputSpec("regex", "(ab|"))
    with pytest.raises(ValueError, match="grammar does not compile: EBNF parser error"):
        compiler.compile(StructuredOutputSpec("grammar", 'root ::= "a" |'))


def test_each_verify_row_is_masked_by_the_grammar_after_the_drafts_before_it(compiler, tokenizer):
    """Row j of a request with drafts d: the bitmask a fresh matcher gives after the output and d[:j];
    a draft the grammar refuses leaves the rows after it unmasked (they are never kept)."""
    spec = StructuredOutputSpec("json", json.dumps(PERSON))
    tokens = tokenizer.encode('{"name": "Ann", "age": 30', add_special_tokens=False)
    output, drafts = tokens[:3], tokens[3:7]
    states = GrammarStates(compiler)
    request = structured_request(spec, output)
    bitmask, rows = states.fill_rows([request], [1 + len(drafts)], [drafts])
    assert rows == list(range(1 + len(drafts)))
    for j in range(1 + len(drafts)):
        matcher = compiler.matcher(spec)
        for token in output + drafts[:j]:
            assert matcher.accept_token(token)
        expected = allocate_bitmask(1, 49152)
        matcher.fill_next_token_bitmask(expected, 0)
        assert torch.equal(bitmask[j], expected[0]), j
    refused = tokenizer.encode("}", add_special_tokens=False)[0]  # no closing brace inside a string
    bitmask, _ = states.fill_rows([request], [3], [[refused, drafts[0]]])
    assert not torch.equal(bitmask[0], allocate_bitmask(1, 49152)[0])
    assert torch.equal(bitmask[1:], allocate_bitmask(2, 49152))
    # the matcher gave back every draft: the next step sees the output alone
    again, _ = states.fill_rows([request], [1], [[]])
    assert torch.equal(again[0], bitmask[0])


def test_drafts_are_cut_at_the_first_token_the_grammar_refuses(compiler, tokenizer):
    spec = StructuredOutputSpec("choice", tuple(CHOICES))
    paris = tokenizer.encode("Paris", add_special_tokens=False)
    london = tokenizer.encode("London", add_special_tokens=False)
    states = GrammarStates(compiler)
    request = structured_request(spec, [])
    assert states.valid_drafts(request, [], [paris[0], 7, 8]) == [paris[0]]
    assert states.valid_drafts(request, [london[0]], [paris[0]]) == []  # after what the step emits
    eos = tokenizer.eos_token_id
    assert states.valid_drafts(request, [], [*paris, eos]) == [*paris, eos]
    assert states.valid_drafts(request, [], [*paris, eos, 5]) == [*paris, eos]  # nothing after the end


# -- the real default model -------------------------------------------------------------------------


def generate(smollm2_dir, speculative_config=None, cases=CASES, **model_config) -> tuple[dict[str, list[int]], dict]:
    inference = make_inference(
        smollm2_dir,
        model_config=model_config,
        speculative_config=speculative_config,
        max_new_tokens=64,
        batch_size=4,
        graph_buckets=[4],
    )
    result = inference.generate(records(cases))
    texts = {
        r.request_id: inference.tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in result.requests
    }
    for request in result.requests:
        assert request.error is None, request.error
        assert request.finish_reason.value == "stop", (request.request_id, texts[request.request_id])
        check_output(request.request_id, texts[request.request_id])
    return {r.request_id: r.output_token_ids for r in result.requests}, result.summary


@pytest.fixture(scope="module")
def plain_outputs(smollm2_dir):
    return generate(smollm2_dir)


@pytest.mark.slow
def test_every_structured_output_parses_and_validates(plain_outputs):
    outputs, summary = plain_outputs  # generate() checks each output against its case
    structured = summary["structured_output"]
    assert sorted(structured["requests"]) == sorted(case_id for case_id, _, _ in CASES)
    assert set(structured["compile_ms"]) == set(outputs) and structured["masked_steps"] > 0


@pytest.mark.slow
def test_a_schema_that_does_not_compile_fails_its_request_alone(smollm2_dir):
    inference = make_inference(smollm2_dir, max_new_tokens=8, batch_size=4)
    bad = _parse_record('{"id": "bad", "prompt": "x", "guided_regex": "(ab|"}', "0")
    result = inference.generate([bad, *records(CASES[3:4])])
    failed, served = result.requests
    assert failed.error is not None and "regex does not compile: Regex parsing error" in failed.error
    assert failed.error.startswith("record 'bad': ")
    assert served.error is None and served.output_token_ids


@pytest.mark.slow
def test_greedy_structured_output_is_the_same_with_ngram_drafts(smollm2_dir, plain_outputs):
    outputs, _ = plain_outputs
    with_drafts, summary = generate(smollm2_dir, {"method": "ngram", "num_speculative_tokens": 3})
    assert with_drafts == outputs
    assert summary["speculative"]["draft_tokens"] > 0


@pytest.fixture(scope="module")
def smollm2_mtp_dir(smollm2_dir, tmp_path_factory):
    """SmolLM2 with an MTP head trained for a few steps (scripts/train_mtp_head.py): poor drafts,
    some of which the grammar refuses, which is what the test needs."""
    from scripts import train_mtp_head

    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for _, prompt, _ in CASES))
    output = tmp_path_factory.mktemp("mtp") / "SmolLM2-MTP"
    args = ["--model", str(smollm2_dir), "--prompts", str(prompts), "--output", str(output)]
    train_mtp_head.main([*args, "--steps", "4", "--max-new-tokens", "16"])
    return output


@pytest.mark.slow
def test_greedy_structured_output_is_the_same_with_mtp_drafts(smollm2_mtp_dir, plain_outputs):
    outputs, _ = plain_outputs
    with_drafts, summary = generate(smollm2_mtp_dir, {"method": "mtp", "num_speculative_tokens": 2})
    assert with_drafts == outputs
    assert summary["speculative"]["draft_tokens"] > 0
    assert summary["structured_output"]["drafts_cut"] > 0


@pytest.mark.slow
@pytest.mark.long  # a graph compile: past CI's budget (the mask is applied outside the graph, as in eager)
def test_greedy_structured_output_is_the_same_in_ge_graph_with_ngram_drafts(smollm2_dir, plain_outputs):
    """The mask is applied after the graph, on the sampled rows' logits; decode and verify buckets
    of 4 requests (4 and 4x4)."""
    outputs, _ = plain_outputs
    with_graphs, summary = generate(smollm2_dir, {"method": "ngram", "num_speculative_tokens": 3}, exe_mode="ge_graph")
    assert with_graphs == outputs
    assert sum(summary["graph"]["graph_steps_per_bucket"].values()) > 0


def test_the_data_parallel_runs_summary_names_every_replicas_structured_requests_and_adds_their_mask_time():
    """merge_replicas: summary.json of a run over several DP replicas has `structured_output` as one
    process's would: the constrained requests in prompt order, every grammar's compile time, the
    masking time and steps added up over the replicas (a replica without any adds nothing)."""
    regex = parse_structured_output({"guided_regex": "a|b"})

    def replica(constrained: dict[str, float], plain: list[str], stats: ConstraintStats) -> RunResult:
        requests = [make_request(i, structured_output=regex) for i in constrained]
        for request in requests:
            request.grammar_compile_ms = constrained[request.request_id]
        requests += [make_request(i, bad_words=("x",)) for i in plain]
        summary = summarize(requests, [], 0.0, 1.0)
        if (structured := structured_output_summary(requests, stats)) is not None:
            summary["structured_output"] = structured
        return RunResult(requests, [], [], summary)

    replicas = [
        replica({"c": 2.0, "a": 1.0}, [], ConstraintStats(mask_ms=6.0, masked_steps=3, masked_rows=5, drafts_cut=1)),
        replica({"b": 4.0}, ["d"], ConstraintStats(mask_ms=2.0, masked_steps=1, masked_rows=1, draft_cut_ms=0.5)),
        replica({}, ["e"], ConstraintStats()),
        replica({}, [], ConstraintStats()),
    ]
    merged = merge_replicas(replicas, ["a", "b", "c", "d", "e"]).summary["structured_output"]
    assert merged["requests"] == ["a", "b", "c"] and merged["bad_words_requests"] == ["d", "e"]
    assert merged["compile_ms"] == {"a": 1.0, "b": 4.0, "c": 2.0} and merged["compile_ms_max"] == 4.0
    assert (merged["mask_ms"], merged["masked_steps"], merged["masked_rows"]) == (8.0, 4, 6)
    assert (merged["draft_cut_ms"], merged["drafts_cut"], merged["mask_ms_per_step"]) == (0.5, 1, 2.0)
    unconstrained = merge_replicas(replicas[3:], []).summary
    assert "structured_output" not in unconstrained
