"""models/gpt_oss against transformers' GptOssForCausalLM with the same weights, on the paged path.

Prompts longer than the sliding window run packed together over scattered blocks of NaN-filled
caches; each prompt's logits (fp32, max-abs-diff <= 1e-4) and greedy tokens must equal
transformers' for that prompt alone. Every config mixes sliding and full layers and has nonzero
sinks and biases; they cover tied and untied embeddings, YaRN with and without `truncate`, GQA,
a clamp limit that the SwiGLU inputs pass, routing ties (duplicate router rows), and the whole
engine with one cache group per attention kind.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
import transformers
from safetensors.torch import save_file

import ops
from executor.core.engine.step_inputs import ScheduledSequence
from executor.core.types_ import AttentionKind
from executor.model_loader.default_loader import safetensors_weights
from executor.model_loader.errors import WeightLoadError
from models.gpt_oss import GptOssForCausalLM
from module.rotary import RotaryEmbedding
from ops.dispatch import OpTable
from ops.npu import NpuOps
from tests.conftest import tiny_tokenizer
from tests.deepseek_v3_harness import (
    VOCAB,
    PagedModel,
    hf_generate,
    hf_last_logits,
    random_prompts,
    single_thread,  # noqa: F401 (an autouse fixture)
)
from tests.engine_harness import hf_greedy, make_inference, token_records

TOLERANCE = 1e-4
WINDOW = 8


def yarn(truncate: bool) -> dict:
    """gpt-oss's released rope parameters (whose configs say truncate: false), or with truncate."""
    return {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": truncate,
        "original_max_position_embeddings": 4096,
        "rope_theta": 150000.0,
    }


def gpt_oss_config(**overrides: object) -> transformers.GptOssConfig:
    """Four layers (sliding, full, sliding, full), GQA, 4 experts of which 2 per token; overrides change any field."""
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=128,
        rope_parameters=yarn(truncate=False),
        initializer_range=0.1,  # peaked logits, so greedy choices are far from ties
        bos_token_id=None,
        eos_token_id=None,  # HF generate must not stop early
        pad_token_id=None,
        attn_implementation="eager",
    )
    settings.update(overrides)
    return transformers.GptOssConfig(**settings)


def save_checkpoint(path: Path, config: transformers.GptOssConfig, seed: int = 0) -> transformers.GptOssForCausalLM:
    """transformers' model with random weights, biases (zero from transformers' init) and sinks of
    order one, saved to `path` in its own format; returned for reference."""
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith("sinks"):
                param.normal_(0.0, 1.0)
    model.save_pretrained(path)
    return model


def load_ours(path: Path, config: transformers.GptOssConfig) -> GptOssForCausalLM:
    model = GptOssForCausalLM(config)
    filled = model.load_weights(safetensors_weights(path))
    assert filled == {name for name, _ in model.named_parameters()}
    return model.eval()


def test_yarn_truncate_changes_the_rope_frequencies_at_this_head_dim():
    """So that the two yarn configs below test two different tables."""
    untruncated = RotaryEmbedding(gpt_oss_config(), 16).cos_sin_cache
    truncated = RotaryEmbedding(gpt_oss_config(rope_parameters=yarn(truncate=True)), 16).cos_sin_cache
    assert (untruncated - truncated).abs().max() > 0.1


# name -> (GptOssConfig overrides, KV block size)
CONFIGS = {
    "untied_yarn": ({}, 4),
    "tied_yarn_truncated_mha": (
        {"tie_word_embeddings": True, "rope_parameters": yarn(truncate=True), "num_key_value_heads": 4},
        8,
    ),
    "clamped_three_of_eight_experts": (
        # SwiGLU inputs here are of order 0.3, so this limit clamps many of them.
        {"swiglu_limit": 0.2, "swiglu_alpha": 1.5, "num_local_experts": 8, "num_experts_per_tok": 3},
        16,
    ),
}
PREFILL_PROMPT_LENS = [5, 17, 1, 9, 30]
DECODE_PROMPT_LENS = [3, 11, 6, 1, 15, 8]
MAX_NEW_TOKENS = 16


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[transformers.GptOssForCausalLM, PagedModel]:
    ops.set_backend("torch")
    overrides, block_size = CONFIGS[request.param]
    config = gpt_oss_config(**overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_checkpoint(path, config)
    return hf_model, PagedModel(load_ours(path, config), block_size)


def test_packed_prefill_logits_match_hf_per_prompt(models):
    hf_model, ours = models
    prompts = random_prompts(PREFILL_PROMPT_LENS, seed=1)
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    assert logits.shape == (len(prompts), hf_model.config.vocab_size)
    for prompt, row in zip(prompts, logits, strict=True):
        assert (row - hf_last_logits(hf_model, prompt)).abs().max() <= TOLERANCE


def test_prefill_over_a_cached_prefix_longer_than_the_window_matches_hf(models):
    hf_model, ours = models
    prompts = random_prompts([21, 13], seed=2)
    splits = [12, 3]
    blocks = [ours.allocate(len(p)) for p in prompts]
    ours.step([ScheduledSequence(p[:s], 0, [b]) for p, s, b in zip(prompts, splits, blocks, strict=True)])
    logits = ours.step([ScheduledSequence(p[s:], s, [b]) for p, s, b in zip(prompts, splits, blocks, strict=True)])
    for prompt, row in zip(prompts, logits, strict=True):
        assert (row - hf_last_logits(hf_model, prompt)).abs().max() <= TOLERANCE


def test_batched_greedy_decoding_past_the_window_matches_hf_generate_per_prompt(models):
    """Decode steps padded to a bucket of 8 rows, as a graph would run them."""
    hf_model, ours = models
    prompts = random_prompts(DECODE_PROMPT_LENS, seed=3)
    outputs = ours.greedy(prompts, MAX_NEW_TOKENS, pad_to=8)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output == hf_generate(hf_model, prompt, MAX_NEW_TOKENS)


def test_sinks_change_the_logits_far_beyond_the_tolerance(models):
    """So that the parity above could not hold with sinks ignored."""
    hf_model, _ = models
    prompt = random_prompts([12], seed=6)[0]
    with_sinks = hf_last_logits(hf_model, prompt)
    sinks = [layer.self_attn.sinks for layer in hf_model.model.layers]
    saved = [s.detach().clone() for s in sinks]
    with torch.no_grad():
        for s in sinks:
            s.fill_(float("-inf"))  # exp(-inf) = 0: plain softmax
        without_sinks = hf_last_logits(hf_model, prompt)
        for s, value in zip(sinks, saved, strict=True):
            s.copy_(value)
    assert (with_sinks - without_sinks).abs().max() > 100 * TOLERANCE


# Router rows 0, 1 and 2 (and their biases) are equal, so every token's logits tie among those
# three experts and, with top_k 2, the cut falls inside the tie: one or two of them are chosen.
TIED_EXPERTS = [0, 1, 2]


@pytest.fixture(scope="module")
def tied_routing_models(tmp_path_factory) -> tuple[transformers.GptOssForCausalLM, PagedModel]:
    ops.set_backend("torch")
    config = gpt_oss_config(num_hidden_layers=2)
    path = tmp_path_factory.mktemp("tied_routing")
    hf_model = save_checkpoint(path, config)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            router = layer.mlp.router
            router.weight[TIED_EXPERTS] = router.weight[0].clone()
            router.bias[TIED_EXPERTS] = router.bias[0].clone()
    hf_model.save_pretrained(path)  # the same checkpoint with the tied routers
    return hf_model, PagedModel(load_ours(path, config), block_size=4)


def test_tied_router_rows_put_the_top_k_cut_inside_the_tie(tied_routing_models):
    hf_model, _ = tied_routing_models
    router = hf_model.model.layers[0].mlp.router
    logits, _, topk_ids = router(torch.randn(32, hf_model.config.hidden_size))
    assert (logits[:, TIED_EXPERTS] == logits[:, :1]).all()
    chosen_tied = torch.isin(topk_ids, torch.tensor(TIED_EXPERTS)).sum(-1)
    assert ((chosen_tied == 1) | (chosen_tied == 2)).all()  # never all three: the tie is broken every time


def test_routing_ties_break_as_in_transformers(tied_routing_models):
    hf_model, ours = tied_routing_models
    prompts = random_prompts([7, 4, 10], seed=4)
    logits = ours.step([ScheduledSequence(p, 0, [ours.allocate(len(p))]) for p in prompts])
    for prompt, row in zip(prompts, logits, strict=True):
        assert (row - hf_last_logits(hf_model, prompt)).abs().max() <= TOLERANCE
    outputs = ours.greedy(prompts, 8)
    assert outputs == [hf_generate(hf_model, p, 8) for p in prompts]


ENGINE_PROMPT_LENS = [1, 5, 17, 33, 8, 40, 3]


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory):
    """The whole engine (scheduler, KV cache manager, worker) on a saved tiny checkpoint."""
    ops.set_backend("torch")
    config = gpt_oss_config(max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = tmp_path_factory.mktemp("tiny_gpt_oss")
    hf_model = save_checkpoint(path, config)
    tiny_tokenizer().save_pretrained(path)
    inference = make_inference(path, model_config={"model_name": "gpt_oss"}, batch_size=len(ENGINE_PROMPT_LENS))
    prompts = random_prompts(ENGINE_PROMPT_LENS, seed=5)
    result = inference.generate(token_records(prompts))
    return hf_model, inference, prompts, result


def test_engine_greedy_equals_transformers_generate(engine_run):
    hf_model, _, prompts, result = engine_run
    assert [r.output_token_ids for r in result.requests] == [hf_greedy(hf_model, p, 32) for p in prompts]


def test_sliding_and_full_layers_get_a_cache_group_each(engine_run):
    _, inference, _, _ = engine_run
    groups = inference.engine.worker.kv_cache_groups
    assert [g.spec.kind for g in groups] == [AttentionKind.SLIDING_WINDOW, AttentionKind.FULL]
    assert [len(g.layer_names) for g in groups] == [2, 2] and groups[0].spec.sliding_window == WINDOW


def test_an_mxfp4_checkpoint_is_refused_by_name(tmp_path):
    config = gpt_oss_config(num_hidden_layers=2)
    name = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    save_file({name: torch.zeros(4, 32, 2, 16, dtype=torch.uint8)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=rf"{name}.*MXFP4.*bf16 checkpoint"):
        GptOssForCausalLM(config).load_weights(safetensors_weights(tmp_path))


def test_model_refuses_a_backend_without_its_ops_at_construction(monkeypatch):
    monkeypatch.setattr(ops.dispatch, "_current", OpTable("npu", "eager", NpuOps(types.ModuleType("torch_npu"))))
    with pytest.raises(NotImplementedError, match="paged_attention_with_sinks.*npu backend does not have"):
        GptOssForCausalLM(gpt_oss_config())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_nextn_predict_layers": 1}, "no MTP modules"),
        ({"layer_types": ["sliding_attention", "chunked_attention"], "num_hidden_layers": 2}, "chunked_attention"),
        ({"sliding_window": None}, "sliding_window None"),
    ],
)
def test_a_config_that_is_not_gpt_oss_as_built_here_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        GptOssForCausalLM(gpt_oss_config(**overrides))


def test_decode_forward_traces_as_one_graph_and_matches_eager(tmp_path):
    """What the graph modes need (fullgraph, static shapes): the experts' host read of their counts
    and the paged gathers with sinks stay inside opaque ops."""
    config = gpt_oss_config(num_hidden_layers=2)  # one sliding layer, one full
    save_checkpoint(tmp_path, config)
    ours = PagedModel(load_ours(tmp_path, config), block_size=4)
    prompts = random_prompts([3, 12, 5], seed=8)
    blocks = [ours.allocate(len(p) + 2) for p in prompts]
    tokens = ours.step([ScheduledSequence(p, 0, [b]) for p, b in zip(prompts, blocks, strict=True)]).argmax(-1)
    decode = [ScheduledSequence([t], len(p), [b]) for t, p, b in zip(tokens.tolist(), prompts, blocks, strict=True)]
    inputs = ours.inputs(decode, pad_to=4)
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    compiled = torch.compile(ours.model, backend=counter, fullgraph=True, dynamic=False)
    with torch.no_grad():
        traced = compiled(*inputs.forward_args())
        eager = ours.model(*inputs.forward_args())  # writes the same K/V to the same slots again
    torch._dynamo.reset()
    assert counter.frame_count == 1
    torch.testing.assert_close(traced, eager)
