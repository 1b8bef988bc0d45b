"""Layers whose groups span data-parallel replicas, on 4 gloo processes started here, each rank a
replica of its own with its own number of tokens (one has none, as an idle replica's LM head): the
MoE block at attention TP 1 x MoE TP 2 x EP 2 (both MoE groups span replicas, and the shared experts
gather over MoE TP), the embedding and the LM head at TP 4. Each rank's output equals the same layer
in one process on that rank's tokens, eagerly and traced as in a graph step (every rank's rows padded
to one count); the torchrun tests (test_distributed.py, test_graphs_across_processes.py) cover world 2
end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from executor.core.config.comm_manager import CommManager, DistEnv
from executor.core.config.parallel_layout import ParallelLayout
from module.embedding import ParallelLMHead, VocabParallelEmbedding
from module.mlp import GatedMLP
from module.moe import FusedExperts, SoftmaxTopkRouter, SparseMoeBlock
from module.parallel_group import ModelParallel
from tests.backends import cpu_backend

WORLD_SIZE = 4
LAYOUT = ParallelLayout(world_size=WORLD_SIZE, attn_tp_size=1, moe_tp_size=2, embed_tp_size=4, lmhead_tp_size=4)
TOKENS_PER_RANK = [3, 0, 2, 1]
HIDDEN, EXPERTS, TOP_K, EXPERT_WIDTH, SHARED_WIDTH, VOCAB = 16, 4, 2, 8, 12, 32


def moe_block(parallel: ModelParallel) -> SparseMoeBlock:
    router = SoftmaxTopkRouter(HIDDEN, EXPERTS, TOP_K, norm_topk_prob=True)
    experts = FusedExperts(EXPERTS, HIDDEN, EXPERT_WIDTH, parallel.moe_tp, parallel.moe_ep, backend=cpu_backend())
    return SparseMoeBlock(router, experts, GatedMLP(HIDDEN, SHARED_WIDTH, tp=parallel.moe_tp, backend=cpu_backend()))


def load_moe_shards(block: SparseMoeBlock, whole: SparseMoeBlock) -> None:
    """Each rank's shards of `whole`'s weights, through the layers' own loaders."""
    block.gate.weight.data.copy_(whole.gate.weight)
    for expert in range(EXPERTS):
        gate, up = whole.experts.gate_up_proj[expert].chunk(2)
        block.experts.load_expert_weight(gate, expert, "gate_proj")
        block.experts.load_expert_weight(up, expert, "up_proj")
        block.experts.load_expert_weight(whole.experts.down_proj[expert], expert, "down_proj")
    shared, whole_shared = block.shared_experts, whole.shared_experts
    for index, half in enumerate(whole_shared.gate_up_proj.weight.chunk(2)):
        shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, half, index)
    shared.down_proj.weight_loader(shared.down_proj.weight, whole_shared.down_proj.weight)


def check_rank(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD_SIZE)
    try:
        parallel = CommManager(LAYOUT, DistEnv(rank, WORLD_SIZE, 0), "gloo", timeout_s=60).model_parallel()
        assert parallel.moe_tp.spans_replicas and parallel.moe_ep.spans_replicas and parallel.lmhead_tp.spans_replicas
        torch.manual_seed(0)  # the same whole layers on every rank
        whole_moe = moe_block(ModelParallel())
        for param in whole_moe.parameters():
            param.data.normal_(0, 0.3)
        whole_embedding, whole_head = VocabParallelEmbedding(VOCAB, HIDDEN), ParallelLMHead(VOCAB, HIDDEN)
        whole_embedding.weight.data.normal_()
        whole_head.weight.data.normal_()
        torch.manual_seed(1 + rank)  # each replica's own tokens
        hidden_states = torch.randn(TOKENS_PER_RANK[rank], HIDDEN)
        input_ids = torch.randint(0, VOCAB, (TOKENS_PER_RANK[rank],))

        block = moe_block(parallel)
        load_moe_shards(block, whole_moe)
        torch.testing.assert_close(block(hidden_states), whole_moe(hidden_states), atol=1e-5, rtol=1e-5)

        embedding = VocabParallelEmbedding(VOCAB, HIDDEN, parallel.embed_tp)
        embedding.weight_loader(embedding.weight, whole_embedding.weight)
        torch.testing.assert_close(embedding(input_ids), whole_embedding(input_ids))

        head = ParallelLMHead(VOCAB, HIDDEN, parallel.lmhead_tp)
        head.weight_loader(head.weight, whole_head.weight)
        rows = torch.arange(TOKENS_PER_RANK[rank])
        torch.testing.assert_close(head(hidden_states, rows), whole_head(hidden_states, rows), atol=1e-5, rtol=1e-5)
        assert head(hidden_states, rows[:0]).shape == (0, VOCAB)  # no rank samples: every rank returns early
        check_in_graph(block, whole_moe, head, whole_head, hidden_states)
    finally:
        dist.destroy_process_group()


def check_in_graph(
    block: SparseMoeBlock,
    whole_moe: SparseMoeBlock,
    head: ParallelLMHead,
    whole_head: ParallelLMHead,
    hidden_states: torch.Tensor,
) -> None:
    """Traced by dynamo, as in a graph step: every rank pads its rows to the same bucket, the gathers
    take them all with no count exchange (functional collectives), and each rank's own rows equal
    the whole layer's."""
    own = hidden_states.shape[0]
    padded = torch.cat([hidden_states, hidden_states.new_zeros(max(TOKENS_PER_RANK) - own, HIDDEN)])
    rows = torch.arange(padded.shape[0])
    graph_block = torch.compile(block, backend="eager", fullgraph=True)
    graph_head = torch.compile(head, backend="eager", fullgraph=True)
    tolerance = {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(graph_block(padded)[:own], whole_moe(hidden_states), **tolerance)
    torch.testing.assert_close(graph_head(padded, rows)[:own], whole_head(hidden_states, rows[:own]), **tolerance)


@pytest.mark.slow  # four processes
def test_moe_embedding_and_lm_head_across_replicas_equal_one_process_on_each_ranks_tokens(tmp_path):
    mp.spawn(check_rank, args=(str(tmp_path / "init"),), nprocs=WORLD_SIZE, join=True)
