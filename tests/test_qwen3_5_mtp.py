"""The MTP module of Qwen3.5, Qwen3.5-MoE and Qwen3-Next (mtp_forward / mtp_compute_logits) on the
paged path against a direct reference, and MTP speculative decoding through the whole engine.

transformers defines no MTP forward for these models (it skips the checkpoints' `mtp.*`). The
layout is the released checkpoints' (as vLLM's qwen3_next_mtp loads them): pre_fc_norm_embedding
and pre_fc_norm_hidden (zero-centred RMSNorms) over the embedding and the main model's final hidden
state, fc over their concatenation, embedding first, one full-attention decoder layer `mtp.layers.0`
and the closing norm `mtp.norm`. The reference runs the decoder layer as transformers' (the extra,
full-attention layer of a deeper random transformers model, whose forward runs only the first
num_hidden_layers, so that it is the main model) with a causal mask, the rest in plain torch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from executor.offline.__main__ import main as offline_main
from module.mtp import MTPLayerMixin
from ops.attention.metadata import ScheduledSequence
from tests.engine_harness import ENGINE_CONFIG
from tests.factories import tiny_tokenizer
from tests.paged_harness import (
    PagedModel,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)
from tests.test_deepseek_v3_mtp import paged_chain
from tests.test_qwen3_5_parity import (
    CANN_RECIPES_TINY_OVERRIDES,
    FULL,
    LOOPING_EMBEDDINGS,
    ROOT,
    greedy_outputs,
    load_qwen3_5,
    qwen3_5_config,
    repetitive_records,
    save_checkpoint,
    speculative_run,
)
from tests.test_tiny_configs import greedy_tokens

PROMPT_LENS = [6, 11, 1]
BLOCK_SIZE = 4
TOLERANCE = 1e-4
MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")


def save_mtp_checkpoint(
    path: Path, config: transformers.PretrainedConfig, echo: bool = False, redraw: dict | None = None
) -> torch.nn.Module:
    """A model folder for `config` with one MTP module as Qwen's checkpoints hold it, and transformers'
    model with its weights: `mtp.layers.0` is the extra full-attention layer of a deeper random
    transformers model (saved under its own name, then renamed), plus random norms and fc. With
    `echo`, the module proposes the token it reads again (with tied embeddings): fc passes the normed
    embedding on, the layer adds nothing (o_proj and down_proj zero), the norms are plain."""
    num_layers = config.num_hidden_layers
    deeper = copy.deepcopy(config)
    deeper.num_hidden_layers = num_layers + 1
    deeper.layer_types = [*config.layer_types, FULL]
    model = save_checkpoint(path, deeper, redraw)
    model.config.num_hidden_layers = num_layers
    hidden, layer_prefix = config.hidden_size, f"model.layers.{num_layers}."
    tensors = {
        name.replace(layer_prefix, "mtp.layers.0.", 1) if name.startswith(layer_prefix) else name: tensor
        for name, tensor in load_file(str(path / "model.safetensors")).items()
    } | {
        "mtp.pre_fc_norm_embedding.weight": 0.1 * torch.randn(hidden),  # zero-centred, as stored
        "mtp.pre_fc_norm_hidden.weight": 0.1 * torch.randn(hidden),
        "mtp.fc.weight": 0.1 * torch.randn(hidden, 2 * hidden),
        "mtp.norm.weight": 0.1 * torch.randn(hidden),
    }
    if echo:
        tensors |= {name: torch.zeros_like(tensors[name]) for name in tensors if "norm" in name and "mtp." in name}
        tensors["mtp.fc.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
        for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config.mtp_num_hidden_layers = 1
    config.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=MODEL_TYPES)
def setup(request, tmp_path_factory):
    config = qwen3_5_config(request.param)
    path = tmp_path_factory.mktemp(f"{request.param}_mtp")
    hf_model = save_mtp_checkpoint(path, config)
    checkpoint = load_file(str(path / "model.safetensors"))
    return config, hf_model, checkpoint, path


def zero_centred_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (1 + weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def reference(hf_model, checkpoint, tokens: list[int], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP module over the first seq_len positions: row t reads tokens[t + 1] and the main model's
    final hidden state at t. -> (hidden [S, H], logits [S, V])."""
    config, eps = hf_model.config, hf_model.config.rms_norm_eps
    previous = hf_model.model(torch.tensor([tokens[:seq_len]])).last_hidden_state
    embeds = hf_model.model.embed_tokens(torch.tensor([tokens[1 : 1 + seq_len]]))
    mixed = torch.cat(
        (
            zero_centred_norm(embeds, checkpoint["mtp.pre_fc_norm_embedding.weight"], eps),
            zero_centred_norm(previous, checkpoint["mtp.pre_fc_norm_hidden.weight"], eps),
        ),
        dim=-1,
    )
    hidden_states = F.linear(mixed, checkpoint["mtp.fc.weight"])
    positions = torch.arange(seq_len)[None]
    causal_mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)[None, None]
    hidden_states = hf_model.model.layers[config.num_hidden_layers](
        hidden_states,
        position_embeddings=hf_model.model.rotary_emb(hidden_states, positions),
        attention_mask=causal_mask,
        position_ids=positions,
    )[0]
    return hidden_states, hf_model.lm_head(zero_centred_norm(hidden_states, checkpoint["mtp.norm.weight"], eps))


def max_mtp_diff(hf_model, checkpoint, ours: PagedModel) -> float:
    """Max-abs difference of the MTP's hidden states and logits from the reference, over a packed
    prefill of prompts of different lengths and then one decode step over the module's cache."""
    tokens = random_prompts([n + 2 for n in PROMPT_LENS], seed=7)
    blocks = [ours.allocate(n + 1) for n in PROMPT_LENS]
    prefill = [ScheduledSequence(t[:n], 0, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]
    decode = [ScheduledSequence([t[n]], n, [b]) for t, n, b in zip(tokens, PROMPT_LENS, blocks, strict=True)]
    diffs = []
    [(hidden, logits)] = paged_chain(ours, prefill, tokens)
    start = 0
    for request_tokens, seq_len in zip(tokens, PROMPT_LENS, strict=True):
        ref_hidden, ref_logits = reference(hf_model, checkpoint, request_tokens, seq_len)
        diffs += [(hidden[start : start + seq_len] - ref_hidden).abs().max()]
        diffs += [(logits[start : start + seq_len] - ref_logits).abs().max()]
        start += seq_len
    [(hidden, logits)] = paged_chain(ours, decode, tokens)
    for row, (request_tokens, seq_len) in enumerate(zip(tokens, PROMPT_LENS, strict=True)):
        ref_hidden, ref_logits = reference(hf_model, checkpoint, request_tokens, seq_len + 1)
        diffs += [(hidden[row] - ref_hidden[-1]).abs().max(), (logits[row] - ref_logits[-1]).abs().max()]
    return max(float(d) for d in diffs)


def test_the_mtp_layer_is_full_attention_of_the_models_kind(setup):
    config, hf_model, _, path = setup
    ours = load_qwen3_5(path, config)
    assert ours.num_mtp_layers == 1 and len(ours.model.layers) == config.num_hidden_layers
    layer = ours.mtp_layer(0)
    reference_layer = hf_model.model.layers[config.num_hidden_layers]
    assert not layer.is_linear
    assert type(layer.mlp).__name__.endswith("MoeBlock") == hasattr(reference_layer.mlp, "experts")


def test_mtp_prefill_and_decode_match_the_direct_reference(setup):
    config, hf_model, checkpoint, path = setup
    assert max_mtp_diff(hf_model, checkpoint, PagedModel(load_qwen3_5(path, config), BLOCK_SIZE)) <= TOLERANCE


def swapped_concatenation(layer: MTPLayerMixin) -> None:
    """fc over cat(hidden, embedding): DeepSeek's order reversed."""
    enorm, hnorm = layer.enorm, layer.hnorm
    layer.enorm, layer.hnorm = hnorm, enorm

    def predict(inputs_embeds, previous_hidden_states, rotary, forward_metadata):
        return MTPLayerMixin.predict(layer, previous_hidden_states, inputs_embeds, rotary, forward_metadata)

    layer.predict = predict


def no_embedding_norm(layer: MTPLayerMixin) -> None:
    layer.enorm = torch.nn.Identity()


def no_hidden_norm(layer: MTPLayerMixin) -> None:
    layer.hnorm = torch.nn.Identity()


def norms_not_zero_centred(layer: MTPLayerMixin) -> None:
    """The stored weights as they are (w, not 1 + w)."""
    with torch.no_grad():
        for norm in (layer.enorm, layer.hnorm):
            norm.weight -= 1


@pytest.mark.parametrize("mutation", [swapped_concatenation, no_embedding_norm, no_hidden_norm, norms_not_zero_centred])
def test_each_part_broken_breaks_the_parity(mutation: Callable[[MTPLayerMixin], None], tmp_path):
    config = qwen3_5_config("qwen3_5_text")
    hf_model = save_mtp_checkpoint(tmp_path, config)
    ours = load_qwen3_5(tmp_path, config)
    mutation(ours.mtp_layer(0))
    assert max_mtp_diff(hf_model, load_file(str(tmp_path / "model.safetensors")), PagedModel(ours, BLOCK_SIZE)) > 1e-2


def test_without_the_config_key_the_checkpoints_mtp_tensors_are_skipped(setup):
    """As transformers skips them: mtp_num_hidden_layers 0 loads the main model alone."""
    config, _, _, path = setup
    plain = copy.deepcopy(config)
    plain.mtp_num_hidden_layers = 0
    model = load_qwen3_5(path, plain)
    assert model.num_mtp_layers == 0 and not any(name.startswith("mtp") for name, _ in model.named_parameters())


def test_more_than_one_mtp_layer_is_refused():
    with pytest.raises(ValueError, match="mtp_num_hidden_layers must be 0 or 1"):
        load_qwen3_5(Path("unused"), qwen3_5_config("qwen3_5_text", mtp_num_hidden_layers=2))


@pytest.fixture(scope="module")
def looping_mtp_model(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A model like tests/test_qwen3_5_parity.py's looping one (tied embeddings drawn large, so that it
    repeats tokens) with an MTP module that proposes its input token again: drafts accepted in part."""
    path = tmp_path_factory.mktemp("looping_qwen3_5_mtp")
    config = qwen3_5_config("qwen3_5_text", **ENGINE_CONFIG, tie_word_embeddings=True)
    hf_model = save_mtp_checkpoint(path, config, echo=True, redraw=LOOPING_EMBEDDINGS)
    tiny_tokenizer().save_pretrained(path)
    return path, hf_model


@pytest.mark.parametrize("num_speculative_tokens", [1, 2])
def test_mtp_speculation_gives_greedy_output(looping_mtp_model, num_speculative_tokens):
    """MTP drafts, verify steps over the recurrent layers' per-position states, and transformers'
    greedy output token for token."""
    path, hf_model = looping_mtp_model
    records = repetitive_records()
    result = speculative_run(path, records, method="mtp", num_speculative_tokens=num_speculative_tokens)
    stats = result.summary["speculative"]
    assert stats["draft_tokens"] > 0 and 0 < stats["accept_rate"] < 1  # drafts accepted and rejected
    assert [request.output_token_ids for request in result.requests] == greedy_outputs(hf_model, records)


@pytest.mark.parametrize("folder", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_the_tiny_random_yaml_decodes_the_same_with_next_n_1(folder, monkeypatch):
    """The tiny configs carry mtp_num_hidden_layers 1, as the released ones: next_n 1 (their random MTP
    layer drafting) leaves the greedy tokens as they are."""
    monkeypatch.chdir(ROOT)
    yaml = ROOT / "models" / folder / "config" / "tiny_random.yaml"
    plain, _ = greedy_tokens(yaml)
    speculative, summary = greedy_tokens(yaml, "model_config.next_n=1")
    assert summary["speculative"]["draft_tokens"] > 0
    assert speculative == plain


def test_cann_recipes_qwen3_5_yaml_runs_with_next_n_1(tmp_path, monkeypatch):
    """cann-recipes' qwen3.5 files set no next_n (their loader skips mtp.*); ours with next_n 1 runs
    on the tiny MoE model, whose config has an MTP layer."""
    monkeypatch.chdir(ROOT)
    output_dir = tmp_path / "run"
    overrides = [*CANN_RECIPES_TINY_OVERRIDES, "model_config.next_n=1", f"model_config.output_path={output_dir}"]
    yaml = ROOT / "tests" / "data" / "cann_recipes" / "qwen3_5.yaml"
    assert offline_main(["--yaml", str(yaml), *(arg for o in overrides for arg in ("--set", o))]) == 0
    assert len((output_dir / "outputs.jsonl").read_text().splitlines()) == 2
