"""scripts/replay_drafts.py: a run's steps replayed over known tokens, as the engine steps them."""

from __future__ import annotations

import json

from executor.core.spec_decode.ngram import NgramProposer
from executor.types_ import AcceptCounts
from scripts import replay_drafts, train_eagle3
from scripts.replay_drafts import lookup_first, replay
from tests.conftest import save_tiny_llama
from tests.engine_harness import make_inference, token_records
from tests.paged_harness import random_prompts

PROMPT = [9, 8]
OUTPUT = [1, 2, 3, 4, 5, 6, 7]


def oracle(tokens: list[int]) -> list[int]:
    """Drafts that are always the model's next two tokens."""
    known = PROMPT + OUTPUT
    return known[len(tokens) : len(tokens) + 2]


def test_replay_steps_past_accepted_drafts_and_cuts_them_to_the_budget():
    # the prefill step emits 1; then 2 3 drafted and accepted (+4), 5 6 accepted (+7): two verifies
    counts = replay(PROMPT + OUTPUT, len(PROMPT), len(OUTPUT), oracle)
    assert (counts.verifies, counts.drafted, counts.accepted) == (2, [2, 2], [2, 2])
    # drafts always wrong: one token a verify, and none drafted when one token of the budget is left
    counts = replay(PROMPT + OUTPUT, len(PROMPT), len(OUTPUT), lambda tokens: [0, 0])
    assert (counts.verifies, counts.drafted, counts.accepted) == (5, [5, 4], [0, 0])
    # a lookup in front: "1 2" recurs, so after "... 1 2" its drafts are what followed, else the fallback's
    tokens = [1, 2, 3, 1, 2, 3, 1]
    source = lookup_first(NgramProposer(2, 2, 2), lambda known: [99])
    assert source(tokens[:5]) == [3, 1] and source(tokens[:3]) == [99]


def test_replayed_lookups_count_what_the_engines_ngram_run_counts(tiny_llama_dir):
    """The replay's stepping against the engine's own: method ngram's drafts depend on the tokens
    alone, so replaying them over the run's output must give the run's counts, position by position."""
    phrases = random_prompts([5, 4], seed=11)
    prompts = [phrases[0] * 3, phrases[1] * 2 + phrases[0], *random_prompts([7], seed=12)]
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    inference = make_inference(tiny_llama_dir, speculative_config=spec, max_new_tokens=24, ignore_eos=True)
    result = inference.generate(token_records(prompts))
    lookup = NgramProposer(2, 2, 4)
    replayed = AcceptCounts()
    for prompt, request in zip(prompts, result.requests, strict=True):
        replayed.add(replay(prompt + request.output_token_ids, len(prompt), 24, lookup.propose_for))
    assert replayed.num_drafted > 0
    assert replayed.per_position() == result.summary["speculative"]["per_position"]


def test_the_script_reports_each_prompt_and_both_sources(tmp_path, capsys):
    model_dir = save_tiny_llama(tmp_path / "tiny", num_hidden_layers=6)  # EAGLE-3 reads three layers
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i}"}) + "\n" for i in (3, 7, 30)))
    drafter, sequences = tmp_path / "drafter", tmp_path / "sequences.pt"
    args = [
        "--model",
        str(model_dir),
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--sequences",
        str(sequences),
    ]
    train_eagle3.main([*args, "--steps", "2", "--output", str(drafter)])
    capsys.readouterr()
    report = replay_drafts.main([*args, "--drafter", str(drafter), "--threads", "1"])
    assert json.loads(capsys.readouterr().out) == report
    assert len(report["prompts"]) == 3
    assert set(report["accept_length"]) == {"drafter", "lookup_then_drafter"}
    for item in report["prompts"]:
        assert 0 < item["generated_tokens"] <= 12 and 0 <= item["outside_draft_vocabulary"] <= item["generated_tokens"]
        assert len(item["teacher_forced_accept_rate_by_position"]) == 2
