"""Verify steps and MTP drafts in graphs: buckets of requests of 1 + k tokens each.

The pure parts first (no compiling): a verify step padded into token rows, its attention and its
recurrent states equal to the eager verify step's for every real token, whatever the padding holds;
the runner's bucket choice and the rows it gives back. Then (slow) whole runs in each CPU graph mode
with each proposer: greedy output equal to eager's, with the verify steps and the MTP passes counted
in the graphs' buckets.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from executor.core.config import build_config
from executor.core.model_worker.bucket_padding import pad_step, padded_token_rows
from executor.core.model_worker.graph_runner import NOT_DECODE, GraphRunner
from executor.offline.dataset import PromptRecord
from executor.offline.offline_inference import OfflineInference, RunResult
from executor.platform.graph_compilers import InductorCompiler
from ops import recurrent_ref
from ops.attention import reference
from ops.attention.metadata import (
    RecurrentStateTables,
    ScheduledSequence,
    TorchMetadataBuilder,
    build_model_inputs,
    build_step_layout,
)
from tests.conftest import save_tiny_llama
from tests.paged_harness import random_prompts
from tests.test_eagle3 import save_drafter
from tests.test_graph_runner import RecordingCompiler
from tests.test_qwen3_5_mtp import looping_mtp_model  # noqa: F401 (a fixture)
from tests.test_spec_decode import repetitive_records
from tests.test_spec_decode_mtp import deepseek_dir  # noqa: F401 (a fixture)

CPU = torch.device("cpu")
BUILDER = TorchMetadataBuilder(CPU)
BLOCK_SIZE, MAX_BLOCKS, TOKENS_PER_ROW = 4, 6, 4


def verify_layout(state_groups: tuple[int, ...] = ()):
    """Three requests verifying 3, 1 and 0 drafts (4, 2 and 1 tokens) after 5, 9 and 2 cached tokens;
    group 1 recurrent when `state_groups` says so (rings of 4 state slots)."""
    fed = [4, 2, 1]
    computed = [5, 9, 2]
    sequences = []
    for index, (count, start) in enumerate(zip(fed, computed, strict=True)):
        blocks = [1 + 3 * index + b for b in range(-(-(start + count) // BLOCK_SIZE))]
        ring = [1 + 4 * index + slot for slot in range(TOKENS_PER_ROW)]
        groups = [blocks] + ([ring] if state_groups else [])
        tokens = [20 + 10 * index + t for t in range(count)]
        sequences.append(ScheduledSequence(tokens, start, groups, num_sampled_rows=count))
    return build_step_layout(
        sequences, block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS, state_groups=state_groups
    )


def test_a_verify_step_pads_each_request_to_1_plus_k_tokens_each_a_decode_row():
    layout = verify_layout()
    padded = pad_step(layout, 4, TOKENS_PER_ROW)
    rows = padded_token_rows(layout, TOKENS_PER_ROW)
    assert rows == [0, 1, 2, 3, 4, 5, 8]
    assert padded.max_query_len == 1 and padded.num_rows == 16
    assert padded.input_ids[:8] == [20, 21, 22, 23, 30, 31, 0, 0] and padded.input_ids[8:] == [40] + [0] * 7
    assert padded.positions[:8] == [5, 6, 7, 8, 9, 10, 0, 0]
    assert padded.seq_lens[:9] == [6, 7, 8, 9, 10, 11, 1, 1, 3]  # each token sees up to itself
    assert padded.slot_mappings[0][:4] == layout.slot_mappings[0][:4]
    padding = [row for row in range(16) if row not in rows]
    assert all(padded.slot_mappings[0][row] == 0 for row in padding)  # padding writes the null slot only
    assert padded.logits_indices == rows  # every fed token is sampled in a verify step
    # every row of a request reads its blocks (a padding token, position 0 of them); a padding request, none
    for request in range(3):
        assert all(
            padded.block_ids[0][row] == layout.block_ids[0][request] for row in range(4 * request, 4 * request + 4)
        )
    assert all(padded.block_ids[0][row] == [] for row in range(12, 16))


def test_token_row_attention_equals_the_eager_verify_attention_whatever_padding_holds():
    """The K/V of a padded token goes to the null slot only, and no real token reads it: padding
    queries of NaN leave every real row equal to the per-request (eager) verify attention."""
    torch.manual_seed(0)
    layout = verify_layout()
    heads, kv_heads, dim = 4, 2, 8
    num_tokens = len(layout.input_ids)
    key_cache = torch.randn(16, BLOCK_SIZE, kv_heads, dim)
    value_cache = torch.randn(16, BLOCK_SIZE, kv_heads, dim)
    query, key, value = (
        torch.randn(num_tokens, heads, dim),
        torch.randn(num_tokens, kv_heads, dim),
        torch.randn(num_tokens, kv_heads, dim),
    )

    def attend(step_layout, q, k, v, caches):
        metadata = build_model_inputs(step_layout, BUILDER).forward_metadata
        group = metadata.groups[0]
        reference.write_kv_cache(k, v, *caches, group.slot_mapping)
        return reference.paged_attention(q, k, v, *caches, group.block_table, metadata, dim**-0.5)

    eager = attend(layout, query, key, value, (key_cache.clone(), value_cache.clone()))
    padded = pad_step(layout, 4, TOKENS_PER_ROW)
    rows = torch.tensor(padded_token_rows(layout, TOKENS_PER_ROW))

    def spread(x: torch.Tensor) -> torch.Tensor:
        out = torch.full((len(padded.input_ids), *x.shape[1:]), float("nan"))
        return out.index_copy(0, rows, x)

    caches = (key_cache.clone(), value_cache.clone())
    graph = attend(padded, spread(query), spread(key), spread(value), caches)
    torch.testing.assert_close(graph[rows], eager, rtol=1e-5, atol=1e-5)
    assert caches[0][0, 0].isnan().all()  # the padding's K/V went to the null block's slot 0


def test_recurrent_token_rows_keep_the_state_after_each_position_as_the_eager_verify_step():
    """The gated delta rule over token rows (1 + k per request, the graph's form) and over the packed
    rows (eager): the same outputs and the same states in every ring slot; padding states go to the
    null slot 0 only."""
    torch.manual_seed(1)
    layout = verify_layout(state_groups=(1,))
    padded = pad_step(layout, 4, TOKENS_PER_ROW)
    rows = torch.tensor(padded_token_rows(layout, TOKENS_PER_ROW))
    num_tokens, heads, k_dim, v_dim = len(layout.input_ids), 2, 4, 4
    inputs = [
        torch.randn(num_tokens, heads, k_dim),
        torch.randn(num_tokens, heads, k_dim),
        torch.randn(num_tokens, heads, v_dim),
        -torch.rand(num_tokens, heads),
        torch.rand(num_tokens, heads),
    ]
    cache = torch.randn(16, heads, k_dim, v_dim)
    eager_cache, graph_cache = cache.clone(), cache.clone()
    eager_tables = build_model_inputs(layout, BUILDER).forward_metadata.groups[1]
    eager = recurrent_ref.chunk_gated_delta_rule(*inputs, eager_cache, eager_tables)
    graph_tables = build_model_inputs(padded, BUILDER).forward_metadata.groups[1]
    assert isinstance(graph_tables, RecurrentStateTables) and graph_tables.tokens_per_row == TOKENS_PER_ROW
    spread = [torch.zeros(len(padded.input_ids), *x.shape[1:]).index_copy(0, rows, x) for x in inputs]
    graph = recurrent_ref.recurrent_gated_delta_rule(*spread, graph_cache, graph_tables)
    torch.testing.assert_close(graph[rows], eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(graph_cache[1:], eager_cache[1:], rtol=1e-5, atol=1e-5)


@pytest.fixture
def verify_runner() -> GraphRunner:
    runner = GraphRunner(
        torch.nn.Identity(),
        RecordingCompiler(),
        [1, 2, 4],
        BUILDER,
        BUILDER,
        num_cache_groups=1,
        max_blocks_per_request=MAX_BLOCKS,
        pin_host_buffers=False,
        tokens_per_verify_row=2,
    )
    runner.warm_up()
    return runner


def test_verify_steps_run_in_verify_buckets_and_give_their_rows_back_in_order(verify_runner):
    """Verify buckets of 1 + k = 2 tokens per request: those whose shapes a decode bucket has (1x2 is
    2 decode rows, 2x2 is 4) run its graph; 4x2 is compiled. Rows come back in the layout's order."""
    origins = verify_runner.stats()["bucket_origins"]
    assert origins["1x2"] == "the graph of bucket 2" and origins["2x2"] == "the graph of bucket 4"
    assert origins["4x2"] == "recorded" and len(verify_runner.compiler.runs) == 4  # 4, 2, 1 and 4x2's 8 rows
    sequences = [ScheduledSequence([7, 8], 5, [[1, 2]], 2), ScheduledSequence([9], 3, [[3]], 1)]
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS)
    hidden, logits = verify_runner.forward(layout)
    assert hidden[:, 0].tolist() == [7, 8, 9] and logits.shape == (3, 5)  # the recorder echoes each row's token
    assert verify_runner.compiler.runs[-1][2] == [7, 8, 9, 0]  # the second request padded within its 2 rows
    assert verify_runner.stats()["graph_steps_per_bucket"] == {"2x2": 1}
    three = build_step_layout(
        [ScheduledSequence([1, 2, 3], 5, [[1, 2]], 3)], block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS
    )
    assert verify_runner.forward(three) is None  # more tokens per request than a verify step: eager


def test_in_lock_step_the_replicas_agree_on_the_most_rows_and_tokens_per_row_and_a_decode_step_pads_to_1_plus_k():
    """agree_shape stands in for the MAX over the world of (rows, tokens per row), with the other
    replica's shape at each step: our decode step meets its verify step, our verify step its decode
    step of 3 rows, our idle forward its verify step, our decode step its prefill."""
    peer_shapes = iter([[1, 2], [3, 1], [2, 2], [NOT_DECODE, 1]])
    asked: list[list[int]] = []

    def agree_shape(shape: list[int]) -> list[int]:
        asked.append(shape)
        return [max(ours, theirs) for ours, theirs in zip(shape, next(peer_shapes), strict=True)]

    runner = GraphRunner(
        torch.nn.Identity(),
        RecordingCompiler(),
        [1, 2, 4],
        BUILDER,
        BUILDER,
        num_cache_groups=1,
        max_blocks_per_request=MAX_BLOCKS,
        pin_host_buffers=False,
        tokens_per_verify_row=2,
        agree_shape=agree_shape,
    )
    runner.warm_up()
    recorded = runner.compiler.runs

    def layout_of(*sequences: ScheduledSequence):
        return build_step_layout(list(sequences), block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS)

    decode = layout_of(ScheduledSequence([7], 5, [[1, 2]]), ScheduledSequence([9], 3, [[3]]))
    hidden, logits = runner.forward(decode)
    assert hidden[:, 0].tolist() == logits[:, 0].tolist() == [7, 9]  # each request's row, in the layout's order
    assert logits[decode.logits_indices, 0].tolist() == [7, 9]  # the rows the model runner samples
    assert recorded[-1][2] == [7, 0, 9, 0]  # each request's one token padded within its 2 rows
    assert recorded[-1][3] == [decode.slot_mappings[0][0], 0, decode.slot_mappings[0][1], 0]  # padding: null slot
    verify = layout_of(ScheduledSequence([7, 8], 5, [[1, 2]], 2))
    hidden, _ = runner.forward(verify)
    assert hidden[:, 0].tolist() == [7, 8] and recorded[-1][2] == [7, 8] + [0] * 6  # bucket 4x2: the peer's 3 rows
    idle = layout_of(ScheduledSequence([0], 0, [[0]], num_sampled_rows=0))  # ModelRunner.idle_forward's
    hidden, _ = runner.forward(idle)
    assert hidden.shape[0] == 1 and recorded[-1][3] == [0, 0, 0, 0]
    assert runner.forward(decode) is None  # the peer's prefill: eager everywhere
    assert asked == [[2, 1], [1, 2], [1, 1], [2, 1]]
    assert runner.stats()["graph_steps_per_bucket"] == {"2x2": 2, "4x2": 1}
    assert runner.stats()["eager_steps"] == 1


# --- whole runs, compiled -------------------------------------------------------------------------------

K = 2  # drafts per step: verify buckets 1x3 and 2x3


@pytest.fixture
def quick_inductor(monkeypatch):
    """Inductor without the CPU's frozen weights and GEMM autotuning (production ge_graph; minutes per
    bucket here, and tests/test_graph_modes.py covers them): the graphs' shapes and what they hold are
    the same."""
    monkeypatch.setattr(InductorCompiler, "inductor_options", lambda self: {})


def run(path, exe_mode: str, model_name: str = "", records=None, **speculative) -> RunResult:
    config = build_config(
        {
            "model_config": {"model_path": str(path), "model_name": model_name, "dtype": "float32", "device": "cpu"}
            | {"exe_mode": exe_mode},
            "data_config": {"apply_chat_template": False},
            "scheduler_config": {
                "block_size": 16,
                "batch_size": 2,  # steps of 2 requests, then 1 as they finish
                "num_blocks": 64,
                "max_model_len": 128,
                "graph_buckets": [1, 2],
            },
            "speculative_config": speculative,
        },
        source="test.yaml",
    )
    return OfflineInference(config, str(path)).generate(records or repetitive_records(4))


def outputs(result: RunResult) -> list[list[int]]:
    return [request.output_token_ids for request in result.requests]


def check_graph_run(result: RunResult, eager: RunResult, verify_buckets: int = 2) -> None:
    """Eager's output and drafts; verify steps in the verify buckets, some with fewer than k drafts."""
    assert outputs(result) == outputs(eager)
    assert result.summary["speculative"]["draft_tokens"] == eager.summary["speculative"]["draft_tokens"]
    graph = result.summary["graph"]
    verify_steps = sum(n for bucket, n in graph["graph_steps_per_bucket"].items() if "x" in bucket)
    assert verify_steps > 0 and graph["verify_buckets"] == [f"1x{1 + K}", f"2x{1 + K}"][:verify_buckets]
    assert any(s.num_draft_tokens < K * s.num_verified_requests for s in result.steps), "a request short of k drafts"


@pytest.mark.slow
@pytest.mark.parametrize("exe_mode", ["ge_graph", pytest.param("npugraph_ex", marks=pytest.mark.long)])
def test_ngram_and_draft_model_verify_steps_in_graphs_give_eager_output(
    exe_mode, tiny_llama_dir, tmp_path, quick_inductor
):
    draft_dir = save_tiny_llama(tmp_path / "draft", seed=0, num_hidden_layers=1)
    for speculative in (
        {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1},
        {"method": "draft_model", "num_speculative_tokens": K, "draft_model_path": str(draft_dir)},
    ):
        check_graph_run(run(tiny_llama_dir, exe_mode, **speculative), run(tiny_llama_dir, "eager", **speculative))


def check_mtp_graphs(
    result: RunResult, first_pass_of_several_rows: bool, method: str = "mtp", runner: str = "mtp0"
) -> None:
    """The drafting layer's passes (MTP layer 0's, or EAGLE-3's drafter's) ran in its graphs: the
    drafts after the first (and first passes of one valid row, where every draft was rejected) in its
    decode buckets; a first pass over several valid rows (drafts accepted) in its verify buckets."""
    steps = result.summary["graph"][method][runner]["graph_steps_per_bucket"]
    assert sum(n for bucket, n in steps.items() if "x" not in bucket) > 0
    assert (sum(n for bucket, n in steps.items() if "x" in bucket) > 0) == first_pass_of_several_rows


@pytest.mark.slow
@pytest.mark.long  # 60 s a compile: MTP in graphs stays in CI through the hybrid recurrent model's test
@pytest.mark.parametrize("exe_mode", ["ge_graph", "npugraph_ex"])
def test_mtp_on_deepseek_in_graphs_gives_eager_output_and_drafts(exe_mode, deepseek_dir, quick_inductor):  # noqa: F811
    speculative = {"method": "mtp", "num_speculative_tokens": K}
    eager = run(deepseek_dir, "eager", "deepseek_v3", **speculative)
    result = run(deepseek_dir, exe_mode, "deepseek_v3", **speculative)
    check_graph_run(result, eager)
    assert result.summary["speculative"]["accepted_tokens"] == 0  # a random MTP layer: one valid row per request
    check_mtp_graphs(result, first_pass_of_several_rows=False)


@pytest.mark.slow
def test_mtp_on_a_hybrid_recurrent_model_in_graphs_gives_eager_output(looping_mtp_model, quick_inductor):  # noqa: F811
    """Qwen3.5: verify buckets whose recurrent layers keep each request's ring of 1 + k states."""
    path, _ = looping_mtp_model
    speculative = {"method": "mtp", "num_speculative_tokens": K}
    eager = run(path, "eager", "qwen3_5", **speculative)
    result = run(path, "ge_graph", "qwen3_5", **speculative)
    check_graph_run(result, eager)
    assert result.summary["speculative"]["accepted_tokens"] > 0  # an echoing MTP layer: drafts accepted
    check_mtp_graphs(result, first_pass_of_several_rows=True)
    assert result.summary["graph"]["bucket_origins"][f"2x{1 + K}"] == "compiled"  # its own graph: per-request states


@pytest.mark.slow
@pytest.mark.long  # the target's and the drafter's buckets compiled: EAGLE-3 eager stays in CI (test_eagle3.py)
def test_eagle3_drafter_passes_in_graphs_give_eager_output_and_drafts(tiny_llama_dir, tmp_path, quick_inductor):
    target = transformers.LlamaConfig.from_pretrained(tiny_llama_dir)
    layers = {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    drafter = save_drafter(tmp_path / "drafter", target, seed=3, eagle_config=layers)
    speculative = {"method": "eagle3", "num_speculative_tokens": K, "draft_model_path": str(drafter)}
    records = [PromptRecord(str(i), prompt_token_ids=p) for i, p in enumerate(random_prompts([5, 17, 1, 9], seed=4))]
    off = run(tiny_llama_dir, "eager", records=records)
    eager = run(tiny_llama_dir, "eager", records=records, **speculative)
    result = run(tiny_llama_dir, "ge_graph", records=records, **speculative)
    assert outputs(result) == outputs(off)
    check_graph_run(result, eager)
    accepted = result.summary["speculative"]["accepted_tokens"]
    assert accepted == eager.summary["speculative"]["accepted_tokens"]
    check_mtp_graphs(result, first_pass_of_several_rows=accepted > 0, method="eagle3", runner="eagle3")
