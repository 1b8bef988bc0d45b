"""LongCat-Flash's MTP module (mtp_forward / mtp_compute_logits) on the paged path against a direct
reference: the same checkpoint tensors applied with plain torch to whole sequences, no paging.

transformers' LongcatFlashForCausalLM defines no MTP (it skips model.mtp.*); the reference does the
MTP's own embedding, enorm, hnorm, eh_proj, the final norm and the shared LM head, and runs the
block's attention and MLP as transformers' LongcatFlashMLA and LongcatFlashMLP (whose parity in the
main layers tests/test_longcat_flash_parity.py establishes) with a causal mask. Speculative decoding
with it gives greedy output.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from models.longcat_flash import LongcatFlashForCausalLM
from ops.attention.metadata import ScheduledSequence
from tests.backends import cpu_backend
from tests.engine_harness import ENGINE_CONFIG, make_inference, token_records
from tests.factories import longcat_flash_config, tiny_tokenizer
from tests.longcat_flash_harness import MTPReference, add_mtp_module, load_ours, save_checkpoint
from tests.paged_harness import (
    PagedModel,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)

PROMPT_LENS = [6, 11, 1]
BLOCK_SIZE = 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = longcat_flash_config()
    path = tmp_path_factory.mktemp("longcat_flash_mtp")
    hf_model = save_checkpoint(path, config)
    reference = add_mtp_module(path, config)
    return path, config, hf_model, reference


@pytest.fixture
def ours(checkpoint) -> PagedModel:
    path, config, _, _ = checkpoint
    return PagedModel(load_ours(path, config), BLOCK_SIZE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference_mtp(hf_model, reference: MTPReference, token_ids: list[int], previous_hidden_states: torch.Tensor):
    """The MTP module over a whole sequence: row t reads token_ids[t] (the token after the one that
    produced previous_hidden_states[t]) at position t. -> (hidden [S, H], logits [S, V])."""
    eps = hf_model.config.rms_norm_eps
    tensor = {name.removeprefix("model.mtp.").removeprefix("layers.0."): t for name, t in reference.tensors.items()}
    embeds = F.embedding(torch.tensor(token_ids), tensor["embed_tokens.weight"])
    mixed = torch.cat(
        (
            rms_norm(embeds, tensor["enorm.m.weight"], eps),
            rms_norm(previous_hidden_states, tensor["hnorm.m.weight"], eps),
        ),
        dim=-1,
    )
    hidden_states = F.linear(mixed, tensor["eh_proj.weight"])[None]
    seq_len = len(token_ids)
    positions = torch.arange(seq_len)[None]
    causal_mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
    attention = reference.attention(
        rms_norm(hidden_states, tensor["input_layernorm.weight"], eps),
        position_embeddings=hf_model.model.rotary_emb(hidden_states, positions),
        attention_mask=causal_mask,
    )[0]
    hidden_states = hidden_states + attention
    post_attention = rms_norm(hidden_states, tensor["post_attention_layernorm.weight"], eps)
    hidden_states = hidden_states + reference.mlp(post_attention)
    hidden_states = hidden_states[0]
    return hidden_states, hf_model.lm_head(rms_norm(hidden_states, tensor["norm.weight"], eps))


@torch.no_grad()
def reference_for(hf_model, reference: MTPReference, tokens: list[int], seq_len: int):
    """(hidden, logits) of the MTP for the first seq_len positions of `tokens`: it reads the main
    model's final hidden states and the tokens one place on."""
    previous = hf_model.model(torch.tensor([tokens[:seq_len]])).last_hidden_state[0]
    return reference_mtp(hf_model, reference, tokens[1 : 1 + seq_len], previous)


@torch.no_grad()
def paged_mtp(ours: PagedModel, sequences: list[ScheduledSequence], tokens: list[list[int]]):
    """Our main forward then the MTP on the same step (same block tables and slots, its own cache),
    fed each row's next token -> (hidden, logits)."""
    inputs = ours.inputs(sequences)
    model = ours.model
    previous = model(inputs.input_ids, inputs.positions, inputs.forward_metadata)
    input_ids = torch.tensor(
        [
            token
            for seq, request_tokens in zip(sequences, tokens, strict=True)
            for token in request_tokens[seq.num_computed_tokens + 1 : seq.num_computed_tokens + 1 + len(seq.token_ids)]
        ]
    )
    hidden_states = model.mtp_forward(0, input_ids, inputs.positions, previous, inputs.forward_metadata)
    return hidden_states, model.mtp_compute_logits(0, hidden_states, torch.arange(len(input_ids)))


def max_mtp_diffs(hf_model, reference: MTPReference, ours: PagedModel) -> tuple[float, float]:
    """The largest |ours - reference| of the MTP's hidden states and logits, over a packed prefill of
    PROMPT_LENS and then one decode step per request over the MTP's cache."""
    tokens = random_prompts([n + 2 for n in PROMPT_LENS], seed=7)
    blocks = [ours.allocate(n + 1) for n in PROMPT_LENS]
    prefill = [ScheduledSequence(t[:n], 0, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]
    decode = [ScheduledSequence([t[n]], n, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]
    hidden_diff = logits_diff = 0.0
    hidden, logits = paged_mtp(ours, prefill, tokens)
    start = 0
    for request_tokens, seq_len in zip(tokens, PROMPT_LENS, strict=True):
        ref_hidden, ref_logits = reference_for(hf_model, reference, request_tokens, seq_len)
        hidden_diff = max(hidden_diff, (hidden[start : start + seq_len] - ref_hidden).abs().max().item())
        logits_diff = max(logits_diff, (logits[start : start + seq_len] - ref_logits).abs().max().item())
        start += seq_len
    hidden, logits = paged_mtp(ours, decode, tokens)
    for row, (request_tokens, seq_len) in enumerate(zip(tokens, PROMPT_LENS, strict=True)):
        ref_hidden, ref_logits = reference_for(hf_model, reference, request_tokens, seq_len + 1)
        hidden_diff = max(hidden_diff, (hidden[row] - ref_hidden[-1]).abs().max().item())
        logits_diff = max(logits_diff, (logits[row] - ref_logits[-1]).abs().max().item())
    return hidden_diff, logits_diff


def test_the_checkpoints_mtp_module_loads_under_longcat_names(checkpoint, ours):
    """Every parameter filled (load_ours asserts it), the MTP outside the main forward's layers."""
    _, config, _, _ = checkpoint
    assert ours.model.num_mtp_layers == 1
    assert len(ours.model.model.layers) == config.num_layers
    with pytest.raises(IndexError, match="MTP layer 1"):
        ours.model.mtp_layer(1)


def test_mtp_prefill_and_decode_match_the_direct_reference(checkpoint, ours):
    _, _, hf_model, reference = checkpoint
    hidden_diff, logits_diff = max_mtp_diffs(hf_model, reference, ours)
    assert hidden_diff <= TOLERANCE and logits_diff <= TOLERANCE


def main_embedding(model: LongcatFlashForCausalLM) -> None:
    """The MTP reads its tokens through the main model's embedding, as DeepSeek's does."""
    model.mtp_embedding = lambda layer: model.model.embed_tokens


def no_lora_scaling(model: LongcatFlashForCausalLM) -> None:
    """The MTP block's MLA as DeepSeek's: query and latent unscaled."""
    attention = model.mtp_layer(0).self_attn
    attention.q_lora_scale = attention.kv_lora_scale = 1.0


@pytest.mark.parametrize("mutation", [main_embedding, no_lora_scaling])
def test_breaking_the_mtp_breaks_its_parity(checkpoint, ours, mutation: Callable[[LongcatFlashForCausalLM], None]):
    _, _, hf_model, reference = checkpoint
    mutation(ours.model)
    assert max_mtp_diffs(hf_model, reference, ours)[1] > 100 * TOLERANCE


def test_more_than_one_mtp_module_is_refused():
    with pytest.raises(ValueError, match="config num_nextn_predict_layers 2"):
        LongcatFlashForCausalLM(longcat_flash_config(num_nextn_predict_layers=2), backend=cpu_backend())


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    config = longcat_flash_config(**ENGINE_CONFIG)
    path = tmp_path_factory.mktemp("tiny_longcat_flash_mtp")
    save_checkpoint(path, config)
    add_mtp_module(path, config)
    tiny_tokenizer().save_pretrained(path)
    return path


def greedy(path, next_n: int) -> tuple[list[list[int]], dict]:
    records = token_records(random_prompts([1, 5, 17, 33, 8], seed=5))
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 6 + 4 * index
    inference = make_inference(
        path,
        model_config={"model_name": "longcat_flash", "next_n": next_n},
        batch_size=4,
        max_prefill_tokens=24,  # the prompt of 33 tokens is prefilled in chunks
        max_new_tokens=40,
    )
    result = inference.generate(records)
    return [r.output_token_ids for r in result.requests], result.summary


def test_mtp_speculation_gives_greedy_output(engine_dir):
    expected, _ = greedy(engine_dir, 0)
    outputs, summary = greedy(engine_dir, 1)
    assert outputs == expected
    assert summary["speculative"]["draft_tokens"] > 0
