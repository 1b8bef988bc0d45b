"""DeepSeek-V3's MTP modules (mtp_forward / mtp_compute_logits) on the paged path against a direct
reference: the same checkpoint tensors applied with plain torch to whole sequences, no paging.

transformers' DeepseekV3ForCausalLM has no MTP modules; the reference does enorm, hnorm, eh_proj,
shared_head.norm and the head itself, and runs each module's decoder block as transformers'
DeepseekV3DecoderLayer (the checkpoint's layer N + i loaded into a deeper transformers model,
whose block parity the other tests establish) with a causal mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ops.attention.metadata import ScheduledSequence
from tests.deepseek_v3_harness import load_ours, save_checkpoint
from tests.factories import deepseek_config
from tests.paged_harness import (
    PagedModel,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)

NUM_MTP = 2
PROMPT_LENS = [6, 11, 1]
BLOCK_SIZE = 4
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = deepseek_config(num_nextn_predict_layers=NUM_MTP)
    path = tmp_path_factory.mktemp("deepseek_v3_mtp")
    hf_model = save_checkpoint(path, config)
    checkpoint = load_file(str(path / "model.safetensors"))
    return config, hf_model, checkpoint, PagedModel(load_ours(path, config), BLOCK_SIZE)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference_mtp(hf_model, checkpoint, layer: int, token_ids: list[int], previous_hidden_states: torch.Tensor):
    """MTP module `layer` over a whole sequence: row t reads token_ids[t] (the token after the one
    that produced previous_hidden_states[t]) at position t. -> (hidden [S, H], logits [S, V])."""
    config = hf_model.config
    index = config.num_hidden_layers + layer
    weight = {name: checkpoint[f"model.layers.{index}.{name}.weight"] for name in ("enorm", "hnorm", "eh_proj")}
    eps = config.rms_norm_eps
    embeds = hf_model.model.embed_tokens(torch.tensor([token_ids]))
    hidden_states = F.linear(
        torch.cat(
            (rms_norm(embeds, weight["enorm"], eps), rms_norm(previous_hidden_states[None], weight["hnorm"], eps)), -1
        ),
        weight["eh_proj"],
    )
    seq_len = len(token_ids)
    positions = torch.arange(seq_len)[None]
    causal_mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
    hidden_states = hf_model.model.layers[index](
        hidden_states,
        attention_mask=causal_mask,
        position_ids=positions,
        position_embeddings=hf_model.model.rotary_emb(hidden_states, positions),
    )[0]
    head_norm = checkpoint[f"model.layers.{index}.shared_head.norm.weight"]
    return hidden_states, hf_model.lm_head(rms_norm(hidden_states, head_norm, eps))


@torch.no_grad()
def reference_chain(hf_model, checkpoint, tokens: list[int], seq_len: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden, logits) of every MTP module for the first seq_len positions of `tokens`: module 0 reads
    the main model's final hidden states and tokens shifted by one, module i module i-1's hidden
    states and tokens shifted by i + 1."""
    previous = hf_model.model(torch.tensor([tokens[:seq_len]])).last_hidden_state[0]
    outputs = []
    for layer in range(NUM_MTP):
        hidden_states, logits = reference_mtp(
            hf_model, checkpoint, layer, tokens[layer + 1 : layer + 1 + seq_len], previous
        )
        outputs.append((hidden_states, logits))
        previous = hidden_states
    return outputs


@torch.no_grad()
def paged_chain(ours: PagedModel, sequences: list[ScheduledSequence], tokens: list[list[int]]):
    """Our main forward then each MTP module on the same step (same block tables and slots, each
    module its own cache), module i fed each row's token i + 1 places on -> [(hidden, logits)]."""
    inputs = ours.inputs(sequences)
    model = ours.model
    previous = model(inputs.input_ids, inputs.positions, inputs.forward_metadata)
    all_rows = torch.arange(len(inputs.input_ids))
    outputs = []
    for layer in range(model.num_mtp_layers):
        input_ids = torch.tensor(
            [
                token
                for seq, request_tokens in zip(sequences, tokens, strict=True)
                for token in request_tokens[
                    seq.num_computed_tokens + layer + 1 : seq.num_computed_tokens + layer + 1 + len(seq.token_ids)
                ]
            ]
        )
        hidden_states = model.mtp_forward(layer, input_ids, inputs.positions, previous, inputs.forward_metadata)
        outputs.append((hidden_states, model.mtp_compute_logits(layer, hidden_states, all_rows)))
        previous = hidden_states
    return outputs


def test_model_builds_the_configured_mtp_modules_outside_the_main_forward(setup):
    config, _, _, ours = setup
    assert ours.model.num_mtp_layers == NUM_MTP
    assert len(ours.model.model.layers) == config.num_hidden_layers + NUM_MTP
    with pytest.raises(IndexError, match="MTP layer 2"):
        ours.model.mtp_layer(NUM_MTP)


def test_mtp_prefill_and_decode_match_the_direct_reference(setup):
    _, hf_model, checkpoint, ours = setup
    # each request: its prompt, then the tokens the MTP modules read past it (one decode step more)
    tokens = random_prompts([n + NUM_MTP + 1 for n in PROMPT_LENS], seed=7)
    blocks = [ours.allocate(n + 1) for n in PROMPT_LENS]
    prefill = [ScheduledSequence(t[:n], 0, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]
    decode = [ScheduledSequence([t[n]], n, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]

    start = 0
    prefill_outputs = paged_chain(ours, prefill, tokens)
    for request_tokens, seq_len in zip(tokens, PROMPT_LENS, strict=True):
        expected = reference_chain(hf_model, checkpoint, request_tokens, seq_len)
        for (hidden, logits), (ref_hidden, ref_logits) in zip(prefill_outputs, expected, strict=True):
            assert (hidden[start : start + seq_len] - ref_hidden).abs().max() <= TOLERANCE
            assert (logits[start : start + seq_len] - ref_logits).abs().max() <= TOLERANCE
        start += seq_len

    decode_outputs = paged_chain(ours, decode, tokens)  # one row per request, over the modules' caches
    for row, (request_tokens, seq_len) in enumerate(zip(tokens, PROMPT_LENS, strict=True)):
        expected = reference_chain(hf_model, checkpoint, request_tokens, seq_len + 1)
        for (hidden, logits), (ref_hidden, ref_logits) in zip(decode_outputs, expected, strict=True):
            assert (hidden[row] - ref_hidden[-1]).abs().max() <= TOLERANCE
            assert (logits[row] - ref_logits[-1]).abs().max() <= TOLERANCE
