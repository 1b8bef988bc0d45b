"""The pure parts of graph modes, without compiling: bucket choice, padding, persistent buffers
reused across steps, the reasons a step runs eagerly, the compile cache's folders and keys."""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from executor.core.model_worker.bucket_padding import pad_step, padding_step
from executor.core.model_worker.graph_runner import NOT_DECODE, GraphRunner, copy_step
from executor.platform.compile_cache import CompileCache, graph_key
from executor.platform.graph_compilers import GraphCallable, GraphCompiler, GraphInputs
from executor.utils.graph_buckets import Bucket, default_buckets, pick_bucket, resolve_buckets
from executor.utils.tensor_tree import map_tensors, tensor_leaves, with_tensors
from ops.attention.metadata import (
    ModelInputs,
    ScheduledSequence,
    StepLayout,
    TorchMetadataBuilder,
    build_model_inputs,
    build_step_layout,
)
from tests.backends import cpu_backend
from tests.factories import llama_config

CPU = torch.device("cpu")
BUILDER = TorchMetadataBuilder(CPU)
BLOCK_SIZE, MAX_BLOCKS = 4, 8


@given(st.integers(1, 300))
def test_default_buckets_are_powers_of_two_to_8_then_multiples_of_16_then_the_batch_size(batch_size):
    buckets = default_buckets(batch_size)
    assert buckets == sorted(set(buckets)) and buckets[-1] == batch_size
    assert [b for b in buckets if b <= 8] == [b for b in (1, 2, 4, 8) if b < batch_size] + (
        [batch_size] if batch_size <= 8 else []
    )
    assert all(b % 16 == 0 for b in buckets[:-1] if b > 8)
    assert all(later - earlier <= 16 for earlier, later in zip(buckets, buckets[1:], strict=False))


@given(st.lists(st.integers(1, 64), min_size=1, max_size=8), st.integers(1, 80))
def test_pick_bucket_is_the_smallest_that_holds_the_rows(configured, rows):
    buckets = resolve_buckets(configured, batch_size=64)
    bucket = pick_bucket(rows, buckets)
    holding = [b for b in buckets if b >= rows]
    assert bucket == (min(holding) if holding else None)


def test_configured_buckets_win_over_the_default():
    assert resolve_buckets([8, 2, 8], batch_size=32) == [2, 8]
    assert resolve_buckets([], batch_size=32) == [1, 2, 4, 8, 16, 32]


def test_a_padding_only_step_reads_and_writes_nothing_but_the_null_block():
    inputs = build_model_inputs(padding_step(4, num_groups=2, max_blocks_per_request=MAX_BLOCKS), BUILDER)
    for group in inputs.forward_metadata.groups:
        assert group.slot_mapping.tolist() == [0] * 4
        assert group.block_table.shape == (4, MAX_BLOCKS) and not group.block_table.any()
    assert inputs.forward_metadata.seq_lens.tolist() == [1] * 4 and inputs.logits_indices.numel() == 0


def test_tensor_tree_round_trip_keeps_everything_but_the_tensors():
    inputs = decode_inputs([5, 9, 2])
    leaves = tensor_leaves(inputs.forward_args())
    assert len(leaves) == 6  # ids, positions, block table, slot mapping, seq_lens, rows per request
    doubled = with_tensors(inputs.forward_args(), [t * 2 for t in leaves])
    assert doubled[2].max_query_len == 1 and doubled[0].tolist() == [2 * t for t in inputs.input_ids.tolist()]
    assert map_tensors(inputs, lambda t: t).forward_metadata.seq_lens is inputs.forward_metadata.seq_lens


def decode_inputs(seq_lens: list[int], pad_to: int | None = None) -> ModelInputs:
    """A decode step of one request per entry, the request with n tokens of K/V in blocks 1, 2, ..."""
    sequences = [
        ScheduledSequence([10 + i], n - 1, [list(range(1 + 3 * i, 1 + 3 * i + -(-n // BLOCK_SIZE)))])
        for i, n in enumerate(seq_lens)
    ]
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS)
    return build_model_inputs(pad_step(layout, pad_to) if pad_to else layout, BUILDER)


def test_copy_step_refuses_inputs_of_another_shape():
    with pytest.raises(ValueError, match="shape of the bucket"):
        copy_step(decode_inputs([3, 4], pad_to=4), decode_inputs([3, 4, 5]))


class RecordingCompiler(GraphCompiler):
    """Stands in for a compiler: the 'graph' records which buffers it ran on and what they held."""

    name = "recording"

    def __init__(self) -> None:
        self.runs: list[tuple[int, int, list[int], list[int]]] = []

    def compile(self, model: torch.nn.Module, buffers: GraphInputs, bucket: str) -> GraphCallable:
        def run(inputs: GraphInputs) -> tuple[torch.Tensor, torch.Tensor]:
            input_ids, *_, forward_metadata = inputs.forward_args()
            self.runs.append(
                (bucket, input_ids.data_ptr(), input_ids.tolist(), forward_metadata.groups[0].slot_mapping.tolist())
            )
            rows = input_ids[:, None].float()  # each row's output is its input token, to see the rows come back
            return rows.expand(-1, 2), rows.expand(-1, 5)

        return GraphCallable(run, "recorded")


def make_runner(agree_shape=None, tokens_per_verify_row: int = 1) -> GraphRunner:
    runner = GraphRunner(
        torch.nn.Identity(),
        RecordingCompiler(),
        [2, 4],
        BUILDER,
        BUILDER,
        num_cache_groups=1,
        max_blocks_per_request=MAX_BLOCKS,
        pin_host_buffers=False,
        agree_shape=agree_shape,
        tokens_per_verify_row=tokens_per_verify_row,
    )
    runner.warm_up()
    return runner


@pytest.fixture
def runner() -> GraphRunner:
    return make_runner()


def layout_of(seq_lens: list[int]) -> StepLayout:
    sequences = [ScheduledSequence([10 + i], n - 1, [[1 + i] * -(-n // BLOCK_SIZE)]) for i, n in enumerate(seq_lens)]
    return build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=MAX_BLOCKS)


def test_steps_reuse_their_buckets_buffers_and_pad_with_the_null_slot(runner):
    compiler = runner.compiler
    compiler.runs.clear()
    for seq_lens in ([3, 5, 2], [4, 6, 3], [5]):
        hidden = runner.forward(layout_of(seq_lens))
        assert hidden is not None
    (b4_first, b4_second, b2) = compiler.runs
    assert b4_first[0] == b4_second[0] == "4" and b2[0] == "2"
    assert b4_first[1] == b4_second[1] == runner.graphs[Bucket(4)].buffers.inputs.input_ids.data_ptr()  # reused
    assert b4_second[2] == [10, 11, 12, 0] and b4_second[3][-1] == 0  # this step's tokens; padding -> slot 0
    assert b2[2] == [10, 0]
    assert runner.stats()["graph_steps_per_bucket"] == {"2": 1, "4": 2}


def test_a_step_no_bucket_holds_runs_eagerly_and_says_why_once(runner, caplog):
    with caplog.at_level(logging.WARNING):
        assert runner.forward(layout_of([3, 3, 3, 3, 3])) is None
        assert runner.forward(layout_of([4, 4, 4, 4, 4])) is None
    reasons = [r.getMessage() for r in caplog.records if "fits no graph bucket" in r.getMessage()]
    assert len(reasons) == 1 and "5 rows" in reasons[0] and "largest 4" in reasons[0]
    assert runner.eager_steps == 2


def test_a_prefill_runs_eagerly_without_a_warning(runner, caplog):
    prefill = build_step_layout([ScheduledSequence([1, 2, 3], 0, [[1]])], block_size=4, max_blocks_per_request=8)
    with caplog.at_level(logging.WARNING):
        assert runner.forward(prefill) is None
    assert not caplog.records


def test_a_verify_step_gives_its_tokens_rows_and_says_where_they_lie_in_the_bucket():
    """Request 0 feeds 2 of its 1 + 3 tokens, request 1 all 4: the graph ran them at rows 0-1 and
    4-7, where what a hook inside it kept lies (EAGLE-3's hidden states); None after a decode step,
    whose tokens lead the rows."""
    runner = make_runner(tokens_per_verify_row=4)
    verify = build_step_layout(
        [ScheduledSequence([10, 11], 2, [[1]]), ScheduledSequence([20, 21, 22, 23], 4, [[2, 3]])],
        block_size=BLOCK_SIZE,
        max_blocks_per_request=MAX_BLOCKS,
    )
    output = runner.forward(verify)
    assert output is not None and output[0][:, 0].tolist() == [10, 11, 20, 21, 22, 23]
    assert runner.token_rows == [0, 1, 4, 5, 6, 7]
    assert runner.forward(layout_of([3, 5])) is not None and runner.token_rows is None


def test_in_lock_step_the_largest_step_of_any_replica_picks_the_bucket_and_a_prefill_keeps_all_eager():
    """agree_shape stands in for the MAX over the world: the other replica's rows at each step."""
    other_rows = iter([3, 1, NOT_DECODE, 1, 5])
    asked: list[list[int]] = []

    def agree_shape(shape: list[int]) -> list[int]:
        asked.append(shape)
        return [max(shape[0], next(other_rows)), shape[1]]

    runner = make_runner(agree_shape)
    runner.compiler.runs.clear()
    prefill = build_step_layout([ScheduledSequence([1, 2, 3], 0, [[1]])], block_size=4, max_blocks_per_request=8)
    steps = [layout_of([5]), layout_of([5]), layout_of([5]), prefill, layout_of([5])]
    served = [runner.forward(layout) is not None for layout in steps]
    assert asked == [[1, 1], [1, 1], [1, 1], [NOT_DECODE, 1], [1, 1]]
    assert served == [True, True, False, False, False]  # the other's 3 rows, 1 row, its prefill, ours, 5 rows
    assert [run[0] for run in runner.compiler.runs] == ["4", "2"]  # a step of 1 row ran in the agreed buckets
    assert runner.compiler.runs[0][2] == [10, 0, 0, 0]
    assert runner.eager_steps == 3


def test_the_compile_cache_is_off_unless_enabled_and_keys_change_with_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("INFER_RECIPES_HOME", str(tmp_path / "home"))
    assert CompileCache.from_config(False, str(tmp_path)).folder("aoti") is None
    assert CompileCache.from_config(True, "").folder("aoti") == tmp_path / "home" / "compile_cache" / "aoti"
    assert CompileCache.from_config(True, str(tmp_path / "c")).folder("inductor") == tmp_path / "c" / "inductor"
    from models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(num_hidden_layers=1), backend=cpu_backend())
    assert graph_key(model, dtype="float32") == graph_key(model, dtype="float32")
    assert graph_key(model, dtype="float32") != graph_key(model, dtype="bfloat16")
    other = LlamaForCausalLM(llama_config(num_hidden_layers=2), backend=cpu_backend())
    assert graph_key(model, dtype="float32") != graph_key(other, dtype="float32")
