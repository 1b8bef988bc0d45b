"""What the parity tests of the KDA hybrids (Kimi-Linear, Ling 3) share: mutations that drop one of
KDA's mechanisms, the two-chunk prefill they must break, a ge_graph engine run against eager, and
n-gram speculation over the states (with Qwen3.5's repetitive prompts)."""

from __future__ import annotations

from pathlib import Path

import torch

from executor.core.config import build_config
from executor.offline.offline_inference import OfflineInference
from module.kda import KimiDeltaAttention
from ops.attention.metadata import ScheduledSequence
from tests.factories import tiny_tokenizer
from tests.paged_harness import PagedModel, hf_last_logits
from tests.test_qwen3_5_parity import NGRAM, greedy_outputs, repetitive_records


def kda_layers(model: torch.nn.Module) -> list[KimiDeltaAttention]:
    return [m for m in model.modules() if isinstance(m, KimiDeltaAttention)]


def no_state_carry(model: torch.nn.Module) -> None:
    """Every step starts each request's states from zeros, as if its earlier chunks had not run."""
    for layer in kda_layers(model):
        tables_of = layer.state_tables

        def fresh_tables(forward_metadata, tables_of=tables_of):
            tables = tables_of(forward_metadata)
            return type(tables)(tables.state_slots, torch.zeros_like(tables.has_initial_state), tables.query_ends_list)

        layer.state_tables = fresh_tables


def no_decay(model: torch.nn.Module) -> None:
    """The forget gate dropped: log decay 0, the state never forgets."""
    for layer in kda_layers(model):
        shape = (layer.num_heads, layer.head_dim)
        layer.forget_gate = lambda hidden, shape=shape: hidden.new_zeros(hidden.shape[0], *shape)


def no_beta(model: torch.nn.Module) -> None:
    """The delta rule's write strength dropped: beta 1 for every token."""
    for layer in kda_layers(model):
        layer.b_proj.weight.data.zero_()
        layer.b_proj.weight.data[:, 0] = 1e4


KDA_MUTATIONS = (no_state_carry, no_decay, no_beta)


def split_prefill_diff(hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]]) -> float:
    """The largest |ours - transformers'| over the last-token logits of `prompts` prefilled packed,
    each in two chunks (6 tokens, then the rest)."""
    blocks = [ours.allocate(len(p)) for p in prompts]
    ours.step([ScheduledSequence(p[:6], 0, [b]) for p, b in zip(prompts, blocks, strict=True)])
    logits = ours.step([ScheduledSequence(p[6:], 6, [b]) for p, b in zip(prompts, blocks, strict=True)])
    return max((row - hf_last_logits(hf_model, p)).abs().max().item() for p, row in zip(prompts, logits, strict=True))


def make_looping(hf_model: torch.nn.Module, path: Path) -> None:
    """Embeddings drawn large (std 0.3) and copied into the LM head, saved again to `path` with the
    tiny tokenizer: the model then tends to repeat tokens in runs its states decide, so n-gram drafts
    are accepted in part (a plain random model rejects every draft)."""
    with torch.no_grad():
        embeddings = hf_model.get_input_embeddings().weight
        embeddings.normal_(0.0, 0.3)
        hf_model.lm_head.weight.copy_(embeddings)
    hf_model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)


def ngram_outputs(
    hf_model: torch.nn.Module, path: Path, model_name: str
) -> tuple[dict, list[list[int]], list[list[int]]]:
    """n-gram speculation (3 drafts) on Qwen3.5's repetitive prompts -> (the speculative stats, our
    outputs, transformers' greedy outputs)."""
    config = build_config(
        {
            "model_config": {"model_path": str(path), "model_name": model_name, "device": "cpu", "dtype": "float32"},
            "data_config": {"apply_chat_template": False},
            "scheduler_config": {"block_size": 16, "batch_size": 4, "num_blocks": 40, "max_model_len": 128},
            "speculative_config": NGRAM,
        },
        source="spec.yaml",
    )
    records = repetitive_records()
    result = OfflineInference(config, str(path)).generate(records)
    outputs = [request.output_token_ids for request in result.requests]
    return result.summary["speculative"], outputs, greedy_outputs(hf_model, records)
