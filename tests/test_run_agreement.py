"""`report --compare`'s accuracy half (executor/offline/run_agreement.py): identical requests, where
the others part, the logprob and prompt-logprob drift; on synthetic outputs with known answers, and on
an eager and a ge_graph run of the same prompts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from executor.offline import report
from executor.offline.results import ResultWriter
from executor.offline.run_agreement import compare_outputs, first_difference, shared_support_kl
from executor.offline.run_folder import plan_run
from tests.engine_harness import make_inference
from tests.test_graph_modes import shrinking_batch_records


def entry(token_id: int, logprob: float, top: list[tuple[int, float]]) -> dict:
    return {"token_id": token_id, "logprob": logprob, "top": [list(pair) for pair in top]}


def output(tokens: list[int], logprobs: list[float] | None = None, prompt: list | None = None, error=None) -> dict:
    return {
        "output_token_ids": tokens,
        "logprobs": None
        if logprobs is None
        else [entry(t, lp, [(t, lp)]) for t, lp in zip(tokens, logprobs, strict=True)],
        "prompt_logprobs": prompt,
        "error": error,
    }


def test_first_difference_counts_a_shorter_run_as_parting_where_it_ends():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_identical_parted_failed_and_unmatched_requests_are_counted_apart():
    before = {
        "same": output([4, 5, 6], [-0.1, -0.2, -0.3]),
        "parts": output([4, 5, 6, 7], [-0.1, -0.2, -0.3, -0.4]),
        "failed": output([], error="prompt too long"),
        "only_before": output([1]),
    }
    after = {
        "same": output([4, 5, 6], [-0.1, -0.25, -0.3]),
        "parts": output([4, 5, 9, 7], [-0.2, -0.2, -0.3, -0.4]),
        "failed": output([4]),
    }
    agreement = compare_outputs(before, after)
    assert (agreement.compared, agreement.identical, agreement.failed, agreement.unmatched) == (2, 1, 1, 1)
    assert agreement.first_difference == {"parts": 2}
    # drift over the shared prefixes only: 3 tokens of "same", 2 of "parts"
    assert agreement.output_logprobs.count == 5
    assert agreement.output_logprobs.largest == pytest.approx(0.1)
    assert agreement.output_logprobs.mean == pytest.approx(0.15 / 5)


def test_prompt_logprobs_give_top1_agreement_and_a_kl_that_is_zero_only_when_equal():
    same = [None, entry(7, -1.0, [(7, -1.0), (8, -2.0)]), entry(9, -0.5, [(9, -0.5), (3, -1.5)])]
    moved = [None, entry(7, -1.2, [(7, -1.2), (8, -1.1)]), entry(9, -0.5, [(9, -0.5), (3, -1.5)])]
    agreement = compare_outputs({"r": output([1], prompt=same)}, {"r": output([1], prompt=moved)})
    prompt = agreement.prompt
    assert prompt.positions == 2 and prompt.top1_equal == 1  # position 1's top token moved from 7 to 8
    assert prompt.given_token.largest == pytest.approx(0.2)
    assert prompt.mean_kl > 0
    assert compare_outputs({"r": output([1], prompt=same)}, {"r": output([1], prompt=same)}).prompt.mean_kl == 0


def test_shared_support_kl_is_the_kl_of_the_renormalized_lists():
    p = {1: math.log(0.5), 2: math.log(0.25), 3: math.log(0.25)}
    q = {1: math.log(0.25), 2: math.log(0.5), 4: math.log(0.25)}  # shared: 1 and 2, renormalized
    expected = (2 / 3) * math.log((2 / 3) / (1 / 3)) + (1 / 3) * math.log((1 / 3) / (2 / 3))
    assert shared_support_kl(p, q) == pytest.approx(expected)
    assert shared_support_kl(p, {9: 0.0}) == 0.0


def run_folder(model_dir: Path, out: Path, exe_mode: str) -> Path:
    records = shrinking_batch_records(seed=3, count=4)
    for record in records:
        record.sampling_overrides.update(logprobs=2, prompt_logprobs=2)
    inference = make_inference(
        model_dir, model_config={"exe_mode": exe_mode}, batch_size=4, graph_buckets=[4], num_blocks=64, max_model_len=96
    )
    writer = ResultWriter(plan_run(out, inference.config, records), inference.config)
    try:
        inference.generate(records, writer)
    finally:
        writer.close()
    return out


def test_compare_of_eager_and_ge_graph_prints_the_identical_count_and_the_drift(tiny_llama_dir, tmp_path, capsys):
    eager = run_folder(tiny_llama_dir, tmp_path / "eager", "eager")
    graph = run_folder(tiny_llama_dir, tmp_path / "ge_graph", "ge_graph")
    png = tmp_path / "compare.png"
    assert report.main(["--compare", str(eager), str(graph), "--out", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "4 of 4 requests give identical tokens" in printed
    assert "logprob drift" in printed and "prompt logprobs" in printed and "top-1 agreement 100.0%" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a finished run's folder is not written into
    assert report.main(["--compare", str(eager), str(graph), "--out", str(graph / "compare.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "inside the run folder" in err
    assert not (graph / "compare.png").exists()
