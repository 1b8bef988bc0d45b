"""DeepSeek sparse attention's decode cost at a short and a long context with the same top-k.

Times the two DSA ops of one decode step directly (ops/sparse_attention.py, the CPU record's forms),
on caches filled at every slot of every request: the indexer (scores over every cached token, then
top-k) and the sparse MLA attention (over the k selected tokens only), in CPU time on one thread.
Medians over repeats, the contexts taken in turn. The
indexer's time grows with the context; the attention's should not, since it gathers k latents per
query whatever the context.

    python benchmarks/dsa_decode_cost.py --contexts 1024 8192 --topk 512
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from ops.attention.metadata import ScheduledSequence, TorchAttentionMetadata, TorchMetadataBuilder, build_step_layout
from ops.backend import Backend, make_backend

BLOCK_SIZE = 128


def decode_metadata(batch: int, context: int) -> TorchAttentionMetadata:
    """One decode row per request, each with `context` tokens in its own consecutive blocks."""
    blocks_per_request = -(-context // BLOCK_SIZE)
    sequences = [
        ScheduledSequence([0], context - 1, [list(range(1 + r * blocks_per_request, 1 + (r + 1) * blocks_per_request))])
        for r in range(batch)
    ]
    layout = build_step_layout(sequences, block_size=BLOCK_SIZE, max_blocks_per_request=blocks_per_request)
    return TorchMetadataBuilder(torch.device("cpu")).build(layout)


def timed_ms(run: Callable[[], object]) -> float:
    """The CPU time `run` takes, not the wall time: on a shared machine other processes' load would
    otherwise be measured too (one thread, so the two are the same on an idle one)."""
    start = time.process_time()
    run()
    return (time.process_time() - start) * 1e3


def decode_ops(
    args: argparse.Namespace, ops: Backend, context: int
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(the indexer, the sparse attention) of one decode step over caches filled at every slot of
    `batch` requests of `context` tokens each."""
    metadata = decode_metadata(args.batch, context)
    tables = metadata.groups[0]
    num_blocks = 1 + args.batch * -(-context // BLOCK_SIZE)
    index_cache = torch.randn(num_blocks, BLOCK_SIZE, args.index_head_dim)
    latent_cache = torch.randn(num_blocks, BLOCK_SIZE, args.kv_lora_rank + args.rope_dim)
    index_query = torch.randn(args.batch, args.index_heads, args.index_head_dim)
    weights = torch.randn(args.batch, args.index_heads)
    scale = args.index_head_dim**-0.5

    def indexer() -> torch.Tensor:
        return ops.indexer_topk(index_query, weights, index_cache, tables.block_table, metadata, scale, args.topk)

    selection = indexer()
    q_nope = torch.randn(args.batch, args.heads, args.nope_dim)
    q_pe = torch.randn(args.batch, args.heads, args.rope_dim)
    kv_b_weight = torch.randn(args.heads * (args.nope_dim + args.v_dim), args.kv_lora_rank) * 0.05

    def attention() -> torch.Tensor:
        return ops.sparse_mla_attention(
            q_nope, q_pe, latent_cache, kv_b_weight, tables.block_table, selection, metadata, 0.07
        )

    attention()  # warm-up
    return indexer, attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--topk", type=int, default=512, help="index_topk (below the shortest context)")
    parser.add_argument("--batch", type=int, default=4, help="decode rows, one per request")
    parser.add_argument("--heads", type=int, default=16, help="MLA heads (DeepSeek-V3.2: 128)")
    parser.add_argument("--index-heads", type=int, default=64)
    parser.add_argument("--index-head-dim", type=int, default=128)
    parser.add_argument("--kv-lora-rank", type=int, default=512)
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--nope-dim", type=int, default=128)
    parser.add_argument("--v-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    ops = make_backend("cpu", "eager", torch.float32)
    print(
        f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}; batch {args.batch}, "
        f"top-k {args.topk}, MLA {args.heads} heads (latent {args.kv_lora_rank} + rope {args.rope_dim}), "
        f"indexer {args.index_heads} heads x {args.index_head_dim}; fp32, CPU time, medians of {args.repeats}"
    )
    print(f"{'context':>8} {'indexer ms':>11} {'sparse MLA ms':>14}")
    runs = {context: decode_ops(args, ops, context) for context in args.contexts}
    samples: dict[int, tuple[list[float], list[float]]] = {context: ([], []) for context in args.contexts}
    for repeat in range(args.repeats):  # the contexts alternate, so a drift over the run hits both alike
        for context in args.contexts if repeat % 2 == 0 else reversed(args.contexts):
            for run, times in zip(runs[context], samples[context], strict=True):
                times.append(timed_ms(run))
    for context, (indexer_ms, attention_ms) in samples.items():
        print(f"{context:>8} {statistics.median(indexer_ms):>11.3f} {statistics.median(attention_ms):>14.3f}")


if __name__ == "__main__":
    main()
