"""models/qwen3_5, models/qwen3_5_moe and models/qwen3_next against transformers' Qwen3_5ForCausalLM,
Qwen3_5MoeForCausalLM (text models) and Qwen3NextForCausalLM with the same weights.

On the paged path (tests/paged_harness.py): prompts packed over NaN-filled caches and state slots,
prefill logits (fp32, max-abs-diff <= 1e-4) of prompts shorter and longer than the delta rule's
64-token chunk, a prefill split in two steps that carries the states, batched greedy decoding padded
to a graph bucket (padded rows on the null state slot). Mutation checks: without the state carried
from one step to the next, without the decay g or the write strength beta, or without the attention's
output gate, the logits part from transformers'. The whole engine with chunked prefill (chunks of 16
tokens inside the prompts) and a pool small enough to preempt, token for token against transformers'
greedy output per prompt; the states' bytes in the sizing; prefix caching off; n-gram speculation
(verify steps keeping the state after each position in the request's ring of slots) equal to
transformers' greedy output, and wrong without the per-position states; the tiny YAMLs and
cann-recipes' `qwen3.5` file end to end; ge_graph decode equal to eager (slow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from executor.core.config import ConfigError, build_config
from executor.offline.__main__ import main as offline_main
from executor.offline.offline_inference import OfflineInference
from models.qwen3_5 import Qwen3_5ForCausalLM
from models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from models.qwen3_next import Qwen3NextForCausalLM
from module.gated_delta_net import GatedDeltaNet
from ops.attention.metadata import AttentionMetadataBuilder, RecurrentStateTables, ScheduledSequence
from tests.backends import cpu_backend
from tests.engine_harness import (
    ENGINE_CONFIG,
    check_chunked_preempting_run,
    generate_random_prompts,
    hf_greedy,
    token_records,
)
from tests.factories import PARITY_SETTINGS, tiny_tokenizer
from tests.paged_harness import (
    PagedModel,
    PagedParityTests,
    hf_last_logits,
    load_ours,
    parity_models,
    random_prompts,
    save_random_model,
    single_thread,  # noqa: F401 (an autouse fixture)
)

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-4
# model_type -> (transformers' class, its config class, ours, our folder)
FAMILIES: dict[str, tuple[type, type, type, str]] = {
    "qwen3_5_text": (transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig, Qwen3_5ForCausalLM, "qwen3_5"),
    "qwen3_5_moe_text": (
        transformers.Qwen3_5MoeForCausalLM,
        transformers.Qwen3_5MoeTextConfig,
        Qwen3_5MoeForCausalLM,
        "qwen3_5_moe",
    ),
    "qwen3_next": (transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig, Qwen3NextForCausalLM, "qwen3_next"),
}
LINEAR, FULL = "linear_attention", "full_attention"
# name -> (model_type, config overrides, KV block size)
CONFIGS = {
    "dense_untied_grouped_value_heads": ("qwen3_5_text", {}, 4),
    "dense_tied_full_first_equal_heads": (
        "qwen3_5_text",
        {"tie_word_embeddings": True, "linear_num_value_heads": 2, "layer_types": [FULL, LINEAR, LINEAR, FULL]},
        16,
    ),
    "moe_untied": ("qwen3_5_moe_text", {}, 8),
    "next_dense_then_sparse_unnormalised": ("qwen3_next", {"norm_topk_prob": False}, 8),
}


def qwen3_5_config(model_type: str, **overrides: object) -> transformers.PretrainedConfig:
    """Four tiny layers (three Gated DeltaNet, then gated attention, unless overridden), GQA (4 heads
    over 2), head_dim 16 with a quarter under rope, DeltaNet key heads 2 and value heads 4 of 8 dims,
    a conv of width 4; for MoE 8 experts choosing 2 and a shared expert (Qwen3-Next: layer 0 dense)."""
    settings: dict[str, object] = dict(
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
    )
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    if model_type != "qwen3_5_moe_text":
        settings |= dict(intermediate_size=96)
    if model_type != "qwen3_5_text":
        settings |= experts
    if model_type == "qwen3_next":  # layer 0 dense, the others sparse
        settings |= dict(mlp_only_layers=[0], decoder_sparse_step=1)
    return FAMILIES[model_type][1](**(PARITY_SETTINGS | settings | overrides))


def save_checkpoint(
    path: Path, config: transformers.PretrainedConfig, redraw: dict[str, tuple[float, float]] | None = None
) -> torch.nn.Module:
    """transformers' model with random weights, the constant ones drawn too so that each must land:
    the zero-centred norms around 0, the DeltaNet's output norm around 1, dt_bias around 1 (and what
    `redraw` adds, as save_random_model's)."""
    constants = {"linear_attn.norm.weight": (1.0, 0.1), "norm.weight": (0.0, 0.1), "dt_bias": (1.0, 0.1)}
    return save_random_model(path, FAMILIES[config.model_type][0], config, redraw=(redraw or {}) | constants)


def load_qwen3_5(path: Path, config: transformers.PretrainedConfig) -> torch.nn.Module:
    return load_ours(FAMILIES[config.model_type][2], path, config)


@pytest.fixture(params=list(CONFIGS), scope="module")
def models(request, tmp_path_factory) -> tuple[torch.nn.Module, PagedModel]:
    model_type, overrides, block_size = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return parity_models(path, qwen3_5_config(model_type, **overrides), save_checkpoint, load_qwen3_5, block_size)


class TestPagedParity(PagedParityTests):
    """Prompts of 70 and 100 tokens cross the delta rule's 64-token chunk; the split prefill carries
    the conv and recurrent states from its first step to its second."""

    prefill_prompt_lens = (5, 17, 1, 70, 12)
    prefix_prompt_lens, prefix_splits = (13, 100), (7, 66)


def test_the_layers_are_those_transformers_builds():
    config = qwen3_5_config("qwen3_5_text", **CONFIGS["dense_tied_full_first_equal_heads"][1])
    ours = Qwen3_5ForCausalLM(config, backend=cpu_backend())
    assert [isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet) for layer in ours.model.layers] == [
        False,
        True,
        True,
        False,
    ]
    assert ours.model.rotary_emb.rotary_dim == 4  # a quarter of head_dim 16


# -- mutation checks: each mechanism, broken on purpose, must break the parity -------------------


def replace_delta_ops(model: torch.nn.Module, wrap: Callable[[Callable], Callable], names: tuple[str, ...]) -> None:
    """Every DeltaNet layer's ops `names` replaced by wrap(op)."""
    for layer in (m for m in model.modules() if isinstance(m, GatedDeltaNet)):
        layer.ops = dataclasses.replace(layer.ops, **{name: wrap(getattr(layer.ops, name)) for name in names})


RULES = ("chunk_gated_delta_rule", "recurrent_gated_delta_rule")


def no_state_carry(model: torch.nn.Module) -> None:
    """Every step starts each request's conv and recurrent states from zeros."""

    def wrap(op: Callable) -> Callable:
        def forgetting(*args: object) -> torch.Tensor:
            *head, tables, last = args  # every such op takes the tables second to last
            assert isinstance(tables, RecurrentStateTables)
            fresh = dataclasses.replace(tables, has_initial_state=torch.zeros_like(tables.has_initial_state))
            return op(*head, fresh, last)

        return forgetting

    replace_delta_ops(model, wrap, ("causal_conv1d_fn", "causal_conv1d_update", *RULES))


def no_decay(model: torch.nn.Module) -> None:
    """g = 0: the state never decays."""
    replace_delta_ops(model, lambda op: lambda q, k, v, g, *rest: op(q, k, v, torch.zeros_like(g), *rest), RULES)


def no_beta(model: torch.nn.Module) -> None:
    """beta = 1: every token overwrites what the state recalls for its key."""
    replace_delta_ops(
        model, lambda op: lambda q, k, v, g, beta, *rest: op(q, k, v, g, torch.ones_like(beta), *rest), RULES
    )


def no_output_gate(model: torch.nn.Module) -> None:
    """The full attention's output not multiplied by sigmoid(gate)."""
    for layer in model.model.layers:
        if not layer.is_linear:
            layer.self_attn.forward = _ungated_forward(layer.self_attn)


def _ungated_forward(attention: torch.nn.Module) -> Callable:
    def forward(hidden_states, rotary, forward_metadata):
        num_tokens = hidden_states.shape[0]
        q_size, kv_size = 2 * attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim
        query_gate, key, value = attention.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        query, _ = query_gate.view(num_tokens, attention.num_heads, 2 * attention.head_dim).chunk(2, dim=-1)
        query = attention.q_norm(query.contiguous())
        key = attention.k_norm(key.view(num_tokens, attention.num_kv_heads, attention.head_dim))
        query, key = attention.apply_partial_rotary(query, key, rotary)
        value = value.view(num_tokens, attention.num_kv_heads, attention.head_dim)
        return attention.o_proj(attention.attn(query, key, value, forward_metadata).flatten(1))

    return forward


def split_prefill_diff(
    hf_model: torch.nn.Module, ours: PagedModel, prompts: list[list[int]], splits: list[int]
) -> float:
    """The largest |ours - transformers'| over the last-token logits of `prompts` prefilled in two
    packed steps (the first `split` tokens, then the rest)."""
    blocks = [ours.allocate(len(p)) for p in prompts]
    ours.step([ScheduledSequence(p[:s], 0, [b]) for p, s, b in zip(prompts, splits, blocks, strict=True)])
    logits = ours.step([ScheduledSequence(p[s:], s, [b]) for p, s, b in zip(prompts, splits, blocks, strict=True)])
    return max((row - hf_last_logits(hf_model, p)).abs().max().item() for p, row in zip(prompts, logits, strict=True))


@pytest.mark.parametrize("mutation", [no_state_carry, no_decay, no_beta, no_output_gate])
def test_each_mechanism_broken_breaks_the_parity(mutation: Callable[[torch.nn.Module], None], tmp_path):
    model_type, overrides, block_size = CONFIGS["dense_untied_grouped_value_heads"]
    config = qwen3_5_config(model_type, **overrides)
    hf_model, ours = parity_models(tmp_path, config, save_checkpoint, load_qwen3_5, block_size)
    prompts, splits = random_prompts((13, 70), seed=2), [7, 66]
    assert split_prefill_diff(hf_model, ours, prompts, splits) <= TOLERANCE
    mutation(ours.model)
    assert split_prefill_diff(hf_model, ours, prompts, splits) > 100 * TOLERANCE


# -- the whole engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(FAMILIES))
def engine_run(request, tmp_path_factory):
    """The whole engine on a saved tiny checkpoint with prefill chunks of at most 16 tokens and 9
    usable blocks of 16 tokens for a batch of 7 whose requests need 3 to 5 each in the one paged
    group: prompts chunked (their states carried) and requests preempted (their states recomputed)."""
    model_type = request.param
    config = qwen3_5_config(model_type, **ENGINE_CONFIG)
    path = tmp_path_factory.mktemp(model_type)
    hf_model = save_checkpoint(path, config)
    folder = FAMILIES[model_type][3]
    run = generate_random_prompts(path, folder, max_prefill_tokens=16, num_blocks=10, max_model_len=128)
    return model_type, hf_model, *run


def test_engine_greedy_with_chunked_prefill_and_preemption_equals_transformers(engine_run):
    model_type, hf_model, inference, prompts, result = engine_run
    check_chunked_preempting_run(hf_model, inference, prompts, result, FAMILIES[model_type][2])


def test_the_states_are_sized_per_request_and_not_per_token(engine_run):
    model_type, hf_model, inference, _, _ = engine_run
    worker = inference.engine.worker
    config = hf_model.config
    num_linear = config.layer_types.count(LINEAR)
    groups = worker.kv_cache_groups
    assert [group.spec.kind.value for group in groups] == ["recurrent", "full"]
    conv_dim = (
        2 * config.linear_num_key_heads * config.linear_key_head_dim
        + config.linear_num_value_heads * config.linear_value_head_dim
    )
    state = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    assert worker.state_bytes_per_slot() == num_linear * (3 * conv_dim + state) * 4
    assert worker.kv_cache_bytes_per_block(16) == (4 - num_linear) * 16 * 2 * 2 * 16 * 4  # the full layer's K/V only
    manager = inference.engine.kv_cache_manager
    assert manager.managers[0].slot_pool.num_slots == 1 + 7  # the null slot and one per request of the batch
    assert manager.managers[0].slot_pool.num_free_slots == 7  # every request finished and gave its slot back


def test_prefix_caching_is_off_for_a_model_with_states(engine_run):
    _, _, inference, _, result = engine_run
    assert not inference.engine.kv_cache_manager.enable_prefix_caching
    assert result.summary["prefix_cache_queried_tokens"] == 0


def speculative_run(model_dir: Path, records: list, **speculative: object):
    config = build_config(
        {
            "model_config": {
                "model_path": str(model_dir),
                "model_name": "qwen3_5",
                "device": "cpu",
                "dtype": "float32",
            },
            "data_config": {"apply_chat_template": False},
            "scheduler_config": {"block_size": 16, "batch_size": 4, "num_blocks": 40, "max_model_len": 128},
            "speculative_config": speculative,
        },
        source="spec.yaml",
    )
    return OfflineInference(config, str(model_dir)).generate(records)


LOOPING_EMBEDDINGS = {"embed_tokens.weight": (0.0, 0.3)}


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny Qwen3.5 with tied embeddings drawn large (std 0.3) so that it tends to repeat tokens,
    in runs that its states decide: n-gram drafts are then accepted in part, which is what a test of
    the verify step's states needs (a plain random model rejects every draft)."""
    path = tmp_path_factory.mktemp("looping_qwen3_5")
    config = qwen3_5_config("qwen3_5_text", **ENGINE_CONFIG, tie_word_embeddings=True)
    hf_model = save_checkpoint(path, config, redraw=LOOPING_EMBEDDINGS)
    tiny_tokenizer().save_pretrained(path)
    return path, hf_model


def repetitive_records() -> list:
    """A phrase three times and then its first 1 to 4 tokens (n-grams recur, so drafts are proposed),
    each request stopping at its own step."""
    phrase = random_prompts([7], seed=11)[0]
    records = token_records([phrase * 3 + phrase[:cut] for cut in (1, 2, 3, 4)])
    for index, record in enumerate(records):
        record.sampling_overrides["max_new_tokens"] = 16 + 3 * index
    return records


def greedy_outputs(hf_model: torch.nn.Module, records: list) -> list[list[int]]:
    return [hf_greedy(hf_model, r.prompt_token_ids, r.sampling_overrides["max_new_tokens"]) for r in records]


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


def test_ngram_speculation_keeps_the_accepted_prefixs_state_and_gives_greedy_output(looping_model):
    """Verify steps of 1 + 3 tokens keep the state after each position in the request's 4 slots; the
    next step reads the accepted prefix's, so the output is transformers' greedy output."""
    path, hf_model = looping_model
    records = repetitive_records()
    result = speculative_run(path, records, **NGRAM)
    stats = result.summary["speculative"]
    assert stats["draft_tokens"] > 0 and 0 < stats["accept_rate"] < 1  # drafts accepted and rejected
    assert [request.output_token_ids for request in result.requests] == greedy_outputs(hf_model, records)


def test_speculation_is_wrong_without_the_states_kept_per_position(looping_model, monkeypatch):
    """The mutation: a verify step keeping only the state after its last draft, accepted or not."""
    path, hf_model = looping_model
    keeping_all = AttentionMetadataBuilder.state_tables

    def keeping_the_final_state_only(builder, layout, slots):
        tables = keeping_all(builder, layout, slots)
        tables.position_state_slots = None
        return tables

    monkeypatch.setattr(AttentionMetadataBuilder, "state_tables", keeping_the_final_state_only)
    records = repetitive_records()
    result = speculative_run(path, records, **NGRAM)
    assert [request.output_token_ids for request in result.requests] != greedy_outputs(hf_model, records)


def test_speculative_decoding_is_refused_where_a_recurrent_layer_keeps_no_position_states(looping_model, monkeypatch):
    monkeypatch.setattr(GatedDeltaNet, "keeps_position_states", False)
    with pytest.raises(ConfigError, match="do not keep their recurrent state after every draft position"):
        speculative_run(looping_model[0], repetitive_records(), **NGRAM)


# cann-recipes' qwen3_5.yaml on the tiny MoE model: its TP 4 and ge_graph set back to one CPU process
CANN_RECIPES_TINY_OVERRIDES = [
    "model_config.model_path=models/qwen3_5_moe/tiny_random",
    "model_config.with_ckpt=false",
    "model_config.exe_mode=eager",
    "model_config.device=cpu",
    "parallel_config.world_size=1",
    *(f"parallel_config.{key}=1" for key in ("attn_tp_size", "moe_tp_size", "embed_tp_size", "lmhead_tp_size")),
    "parallel_config.shared_tp_size=1",
    "data_config.num_prompts=2",
    "data_config.apply_chat_template=false",
    "scheduler_config.max_new_tokens=3",
]


def test_cann_recipes_qwen3_5_yaml_runs_on_the_tiny_moe_model(tmp_path, monkeypatch):
    """tests/data/cann_recipes/qwen3_5.yaml (cann-recipes' keys; model_name qwen3.5 finds
    models/qwen3_5_moe) in one process on CPU with the tiny random model: its TP 4 and ge_graph set
    back to what one CPU process runs."""
    monkeypatch.chdir(ROOT)
    output_dir = tmp_path / "run"
    overrides = [*CANN_RECIPES_TINY_OVERRIDES, f"model_config.output_path={output_dir}"]
    yaml = ROOT / "tests" / "data" / "cann_recipes" / "qwen3_5.yaml"
    assert offline_main(["--yaml", str(yaml), *(arg for o in overrides for arg in ("--set", o))]) == 0
    assert len((output_dir / "outputs.jsonl").read_text().splitlines()) == 2
