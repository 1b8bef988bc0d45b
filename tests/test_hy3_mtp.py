"""Hy3's MTP module (mtp_forward / mtp_compute_logits) on the paged path against a direct reference:
the same checkpoint tensors applied with plain torch to whole sequences, no paging.

transformers' HYV3ForCausalLM defines no MTP module (it ignores model.layers.80.*, the released
checkpoints' one). cann-recipes' models/hy3 code shows its layout: DeepSeek's (enorm, hnorm and
eh_proj over the embedding and the main model's final hidden state, then one decoder layer, sparse)
with the closing norm named final_layernorm instead of shared_head.norm. The reference runs the
decoder block as transformers' HYV3DecoderLayer (the checkpoint's layer N loaded into a deeper
transformers model, whose block parity tests/test_hy3_parity.py establishes) with a causal mask.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from models.hy3 import Hy3ForCausalLM
from models.hy3.model import Hy3MoE
from ops.attention.metadata import ScheduledSequence
from tests.backends import cpu_backend
from tests.factories import hy3_config
from tests.paged_harness import (
    PagedModel,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)
from tests.test_deepseek_v3_mtp import paged_chain, rms_norm
from tests.test_hy3_parity import load_ours, save_checkpoint

PROMPT_LENS = [6, 11, 1]
BLOCK_SIZE = 4
TOLERANCE = 1e-4


def save_mtp_checkpoint(path: Path, config: transformers.HYV3Config) -> torch.nn.Module:
    """A model folder for `config` with one MTP module as Hy3's checkpoints hold it, and transformers'
    model with its weights: the module's block is the extra, sparse layer of a deeper random
    transformers model whose forward runs only the first num_hidden_layers (so it is the main model),
    plus random enorm, hnorm, eh_proj and final_layernorm under model.layers.N."""
    num_layers = config.num_hidden_layers
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = num_layers + 1
    deeper.mlp_layer_types = [*config.mlp_layer_types, "sparse"]
    model = save_checkpoint(path, deeper)
    model.config.num_hidden_layers = num_layers
    hidden, prefix = config.hidden_size, f"model.layers.{num_layers}."
    tensors = load_file(str(path / "model.safetensors")) | {
        prefix + "enorm.weight": 1 + 0.1 * torch.randn(hidden),
        prefix + "hnorm.weight": 1 + 0.1 * torch.randn(hidden),
        prefix + "eh_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
        prefix + "final_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.num_nextn_predict_layers = 1
    config.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = hy3_config()
    path = tmp_path_factory.mktemp("hy3_mtp")
    hf_model = save_mtp_checkpoint(path, config)
    checkpoint = load_file(str(path / "model.safetensors"))
    return config, hf_model, checkpoint, PagedModel(load_ours(path, config), BLOCK_SIZE)


@torch.no_grad()
def reference_mtp(hf_model, checkpoint, token_ids: list[int], previous_hidden_states: torch.Tensor):
    """The MTP module over a whole sequence: row t reads token_ids[t] (the token after the one that
    produced previous_hidden_states[t]) at position t. -> (hidden [S, H], logits [S, V])."""
    config = hf_model.config
    index, eps = config.num_hidden_layers, config.rms_norm_eps
    weight = {name: checkpoint[f"model.layers.{index}.{name}.weight"] for name in ("enorm", "hnorm", "eh_proj")}
    embeds = hf_model.model.embed_tokens(torch.tensor([token_ids]))
    mixed = torch.cat(
        (rms_norm(embeds, weight["enorm"], eps), rms_norm(previous_hidden_states[None], weight["hnorm"], eps)), -1
    )
    hidden_states = F.linear(mixed, weight["eh_proj"])
    seq_len = len(token_ids)
    positions = torch.arange(seq_len)[None]
    causal_mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
    hidden_states = hf_model.model.layers[index](
        hidden_states,
        attention_mask=causal_mask,
        position_ids=positions,
        position_embeddings=hf_model.model.rotary_emb(hidden_states, positions),
    )[0]
    head_norm = checkpoint[f"model.layers.{index}.final_layernorm.weight"]
    return hidden_states, hf_model.lm_head(rms_norm(hidden_states, head_norm, eps))


def reference(hf_model, checkpoint, tokens: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The module over the first seq_len positions: the main model's final hidden states, tokens shifted by one."""
    with torch.no_grad():
        previous = hf_model.model(torch.tensor([tokens[:seq_len]])).last_hidden_state[0]
    return reference_mtp(hf_model, checkpoint, tokens[1 : 1 + seq_len], previous)


def test_the_mtp_module_is_built_sparse_outside_the_main_forward(setup):
    config, _, _, ours = setup
    assert ours.model.num_mtp_layers == 1
    assert isinstance(ours.model.mtp_layer(0).mlp, Hy3MoE)
    assert len(ours.model.model.layers) == config.num_hidden_layers


def test_mtp_prefill_and_decode_match_the_direct_reference(setup):
    _, hf_model, checkpoint, ours = setup
    # each request: its prompt, then the tokens the MTP module reads past it (one decode step more)
    tokens = random_prompts([n + 2 for n in PROMPT_LENS], seed=7)
    blocks = [ours.allocate(n + 1) for n in PROMPT_LENS]
    prefill = [ScheduledSequence(t[:n], 0, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]
    decode = [ScheduledSequence([t[n]], n, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]

    [(hidden, logits)] = paged_chain(ours, prefill, tokens)
    start = 0
    for request_tokens, seq_len in zip(tokens, PROMPT_LENS, strict=True):
        ref_hidden, ref_logits = reference(hf_model, checkpoint, request_tokens, seq_len)
        assert (hidden[start : start + seq_len] - ref_hidden).abs().max() <= TOLERANCE
        assert (logits[start : start + seq_len] - ref_logits).abs().max() <= TOLERANCE
        start += seq_len

    [(hidden, logits)] = paged_chain(ours, decode, tokens)  # one row per request, over the module's cache
    for row, (request_tokens, seq_len) in enumerate(zip(tokens, PROMPT_LENS, strict=True)):
        ref_hidden, ref_logits = reference(hf_model, checkpoint, request_tokens, seq_len + 1)
        assert (hidden[row] - ref_hidden[-1]).abs().max() <= TOLERANCE
        assert (logits[row] - ref_logits[-1]).abs().max() <= TOLERANCE


def test_the_closing_norm_is_the_checkpoints_final_layernorm(setup):
    """The checkpoint's final_layernorm fills the module's shared_head.norm (DeepSeek's name, module/mtp.py's)."""
    config, hf_model, checkpoint, ours = setup
    norm = ours.model.mtp_layer(0).shared_head.norm.weight
    assert torch.equal(norm, checkpoint[f"model.layers.{config.num_hidden_layers}.final_layernorm.weight"])


def test_without_the_config_key_the_checkpoints_mtp_tensors_are_skipped(setup):
    """As transformers skips them: a config without num_nextn_predict_layers loads the main model alone."""
    config, _, checkpoint, _ = setup
    plain = copy.deepcopy(config)
    plain.num_nextn_predict_layers = 0
    model = Hy3ForCausalLM(plain, backend=cpu_backend())
    assert model.num_mtp_layers == 0
    assert model.load_weights(checkpoint.items()) == {name for name, _ in model.named_parameters()}
