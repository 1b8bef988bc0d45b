"""The EAGLE-3 drafter (models/llama/eagle3.py) loaded from a checkpoint in the layout vLLM's
eagle3 drafters are published in, against a plain-torch reference of the same weights written out
here: fc over the target's three layers, the one decoder layer over [norm(embedding), norm(hidden)],
norm, the reduced-vocabulary LM head and d2t. Ours runs sequences packed over NaN-filled paged KV
caches, as the engine does, and rows after cached rows (chain drafting) attend to the cache."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from executor.core.config import ConfigError, build_config
from executor.core.spec_decode.eagle3 import Eagle3Proposer, load_eagle3_drafter
from executor.core.spec_decode.proposer import ProposalContext
from executor.model_loader.quantization_config import online_scheme
from executor.offline.dataset import DATASET_DIR, PromptRecord, load_prompts
from models.llama.eagle3 import aux_hidden_state_layers
from module.attention import Attention
from ops import quant_math
from ops.attention.metadata import ScheduledSequence, TorchMetadataBuilder, build_model_inputs, build_step_layout
from tests.backends import cpu_backend
from tests.engine_harness import load_hf_model, make_inference
from tests.factories import TINY_VOCAB, llama_config
from tests.paged_harness import random_prompts, single_thread  # noqa: F401 (single_thread: an autouse fixture)

NUM_TARGET_LAYERS = 6
DRAFT_VOCAB = 40
BLOCK_SIZE = 4
NUM_BLOCKS = 64


def draft_config(target: transformers.LlamaConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": target.max_position_embeddings,
        "rope_theta": 10000.0,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB,
        "tie_word_embeddings": False,
    }


def random_drafter_tensors(target: transformers.LlamaConfig, seed: int) -> dict[str, torch.Tensor]:
    """An EAGLE-3 checkpoint's tensors under vLLM's names, norms away from 1 so that each matters."""
    generator = torch.Generator().manual_seed(seed)
    hidden, heads, kv_heads, inter = target.hidden_size, 4, 2, 96
    head_dim = hidden // heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.1

    tensors = {
        "fc.weight": randn(hidden, 3 * hidden),
        "midlayer.self_attn.q_proj.weight": randn(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": randn(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": randn(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": randn(inter, hidden),
        "midlayer.mlp.up_proj.weight": randn(inter, hidden),
        "midlayer.mlp.down_proj.weight": randn(hidden, inter),
        "lm_head.weight": randn(DRAFT_VOCAB, hidden) * 10,
    }
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{norm}.weight"] = 1 + 0.3 * torch.randn(hidden, generator=generator)
    target_ids = torch.tensor(sorted(random.Random(seed).sample(range(TINY_VOCAB), DRAFT_VOCAB)))
    tensors["d2t"] = target_ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(TINY_VOCAB, dtype=torch.bool)
    t2d[target_ids] = True
    tensors["t2d"] = t2d
    return tensors


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotate-half rope on [T, H, D]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@torch.no_grad()
def reference_eagle3(
    weights: dict[str, torch.Tensor],
    embeds: torch.Tensor,
    first_hidden: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence alone, causal over its rows: row j takes the embedding of its token and hidden
    state `first_hidden[j]` -> (hidden states before norm, target token ids of the greedy drafts)."""
    w = weights
    heads, kv_heads = 4, 2
    head_dim = embeds.shape[-1] // heads
    mixed = torch.cat(
        [
            rms_norm(embeds, w["midlayer.input_layernorm.weight"], eps),
            rms_norm(first_hidden, w["midlayer.hidden_norm.weight"], eps),
        ],
        dim=-1,
    )
    q = (mixed @ w["midlayer.self_attn.q_proj.weight"].T).view(-1, heads, head_dim)
    k = (mixed @ w["midlayer.self_attn.k_proj.weight"].T).view(-1, kv_heads, head_dim)
    v = (mixed @ w["midlayer.self_attn.v_proj.weight"].T).view(-1, kv_heads, head_dim)
    q, k = rope(q, positions, 10000.0), rope(k, positions, 10000.0)
    k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    attention = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    residual = first_hidden + attention.transpose(0, 1).flatten(1) @ w["midlayer.self_attn.o_proj.weight"].T
    normed = rms_norm(residual, w["midlayer.post_attention_layernorm.weight"], eps)
    mlp = (F.silu(normed @ w["midlayer.mlp.gate_proj.weight"].T) * (normed @ w["midlayer.mlp.up_proj.weight"].T)) @ w[
        "midlayer.mlp.down_proj.weight"
    ].T
    hidden = mlp + residual
    logits = rms_norm(hidden, w["norm.weight"], eps) @ w["lm_head.weight"].T
    draft_ids = logits.argmax(-1)
    return hidden, logits, draft_ids + w["d2t"][draft_ids]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target_config = llama_config(num_hidden_layers=NUM_TARGET_LAYERS, num_key_value_heads=2)
    torch.manual_seed(0)
    hf_target = transformers.LlamaForCausalLM(target_config).eval()
    weights = random_drafter_tensors(target_config, seed=1)
    folder = tmp_path_factory.mktemp("eagle3")
    (folder / "config.json").write_text(json.dumps(draft_config(target_config)))
    save_file(weights, str(folder / "model.safetensors"))
    loaded = load_eagle3_drafter(str(folder), target_config, "llama", backend=cpu_backend())
    drafter, layers = loaded.module, loaded.aux_layers
    for attention in (m for m in drafter.modules() if isinstance(m, Attention)):
        shape = (NUM_BLOCKS, BLOCK_SIZE, 2, target_config.hidden_size // 4)
        attention.bind_kv_cache({"key": torch.full(shape, float("nan")), "value": torch.full(shape, float("nan"))}, 0)
    return hf_target, weights, drafter, layers


def test_the_published_layout_loads_and_the_default_layers_are_vllms(setup):
    _, weights, drafter, layers = setup
    assert layers == (2, NUM_TARGET_LAYERS // 2, NUM_TARGET_LAYERS - 3)
    assert torch.equal(drafter.d2t, weights["d2t"])
    assert torch.equal(drafter.fc.weight, weights["fc.weight"])
    q_rows = weights["midlayer.self_attn.q_proj.weight"].shape[0]
    assert torch.equal(drafter.midlayer.self_attn.qkv_proj.weight[:q_rows], weights["midlayer.self_attn.q_proj.weight"])
    assert aux_hidden_state_layers(transformers.PretrainedConfig(eagle_aux_hidden_state_layer_ids=[1, 3, 4]), 6) == (
        1,
        3,
        4,
    )
    with pytest.raises(ValueError, match="three target layers"):
        aux_hidden_state_layers(transformers.PretrainedConfig(eagle_aux_hidden_state_layer_ids=[1, 9, 4]), 6)


def aux_hidden(hf_target, token_ids: list[int], layers: tuple[int, int, int]) -> torch.Tensor:
    """[L, 3 x hidden]: the target's residual stream at the input of each of `layers` (HF's
    hidden_states[i] is the input of layer i)."""
    with torch.no_grad():
        states = hf_target(torch.tensor([token_ids]), output_hidden_states=True).hidden_states
    return torch.cat([states[layer][0] for layer in layers], dim=-1)


@torch.no_grad()
def test_packed_drafter_rows_and_chained_rows_match_the_reference(setup):
    """First pass: rows 0..n-2 of each sequence (token t_{j+1}, fc of the target's layers at j);
    second pass (one draft step of the chain): each sequence's next row, its hidden state the
    first pass's last prenorm output, attending to the first pass's cached K/V."""
    hf_target, weights, drafter, layers = setup
    eps = hf_target.config.rms_norm_eps
    sequences = random_prompts([6, 13, 2, 9], seed=2)
    free = random.Random(0).sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)
    blocks = []
    for sequence in sequences:
        count = -(-(len(sequence) + 1) // BLOCK_SIZE)
        blocks.append(free[:count])
        free = free[count:]
    builder = TorchMetadataBuilder(torch.device("cpu"))
    embed = hf_target.model.embed_tokens
    first = [
        ScheduledSequence(s[1:], 0, [b], num_sampled_rows=len(s) - 1) for s, b in zip(sequences, blocks, strict=True)
    ]
    inputs = build_model_inputs(build_step_layout(first, block_size=BLOCK_SIZE, max_blocks_per_request=16), builder)
    target_hidden = torch.cat([drafter.combine_hidden_states(aux_hidden(hf_target, s, layers)[:-1]) for s in sequences])
    embeds = embed(inputs.input_ids)
    hidden = drafter(embeds, inputs.positions, target_hidden, inputs.forward_metadata)
    logits = drafter.compute_logits(hidden, inputs.logits_indices)
    drafts = drafter.target_token_ids(logits.argmax(-1))
    rows = [len(s) - 1 for s in sequences]
    last_rows = torch.tensor(rows).cumsum(0) - 1
    chained_tokens = drafts[last_rows]
    second = [
        ScheduledSequence([int(token)], len(s) - 1, [b], num_sampled_rows=1)
        for s, b, token in zip(sequences, blocks, chained_tokens, strict=True)
    ]
    inputs2 = build_model_inputs(build_step_layout(second, block_size=BLOCK_SIZE, max_blocks_per_request=16), builder)
    embeds2 = embed(inputs2.input_ids)
    hidden2 = drafter(embeds2, inputs2.positions, hidden[last_rows], inputs2.forward_metadata)
    drafts2 = drafter.target_token_ids(drafter.compute_logits(hidden2, inputs2.logits_indices).argmax(-1))
    assert set(drafts.tolist()) <= set((torch.arange(DRAFT_VOCAB) + weights["d2t"]).tolist())

    for index, (sequence, our_hidden, our_logits, our_drafts) in enumerate(
        zip(sequences, hidden.split(rows), logits.split(rows), drafts.split(rows), strict=True)
    ):
        combined = drafter.combine_hidden_states(aux_hidden(hf_target, sequence, layers)[:-1])
        expected_fc = aux_hidden(hf_target, sequence, layers)[:-1] @ weights["fc.weight"].T
        assert (combined - expected_fc).abs().max() <= 1e-5
        tokens = torch.tensor([*sequence[1:], int(chained_tokens[index])])
        # the chain's row feeds back the first pass's prenorm output at the sequence's last row
        expected_hidden, expected_logits, expected_drafts = reference_eagle3(
            weights,
            embed(tokens),
            torch.cat([expected_fc, our_hidden[-1:]]),
            torch.arange(len(tokens)),
            eps,
        )
        assert (our_hidden - expected_hidden[:-1]).abs().max() <= 1e-4
        assert (our_logits - expected_logits[:-1]).abs().max() <= 1e-4
        assert torch.equal(our_drafts, expected_drafts[:-1])
        assert (hidden2[index] - expected_hidden[-1]).abs().max() <= 1e-4
        assert int(drafts2[index]) == int(expected_drafts[-1])


@torch.no_grad()
def test_the_training_time_test_unrolls_the_chain_the_proposer_runs(setup):
    """scripts/train_eagle3.py's step s at row j equals the drafter in plain torch after a first pass
    over rows 0..j and s chain steps, each feeding back its own prenorm output with the next token."""
    from scripts.train_eagle3 import TrainableEagle3

    hf_target, _, _, layers = setup
    drafter = TrainableEagle3(hf_target, torch.arange(DRAFT_VOCAB) * 3)
    generator = torch.Generator().manual_seed(6)
    for parameter in drafter.parameters():  # away from the init's symmetric halves and unit norms
        parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    weights = drafter.checkpoint_tensors(TINY_VOCAB)
    tokens = random_prompts([12], seed=5)[0]
    aux = aux_hidden(hf_target, tokens[:-1], layers)
    depth, embed, eps = 3, hf_target.model.embed_tokens, hf_target.config.rms_norm_eps
    logits = drafter(hf_target, torch.tensor(tokens), aux, depth)
    for row in range(len(tokens) - 1):
        hidden = aux[: row + 1] @ weights["fc.weight"].T
        for step in range(min(depth, len(tokens) - 1 - row)):
            row_tokens = torch.tensor(tokens[1 : row + 2 + step])
            output, expected, _ = reference_eagle3(
                weights, embed(row_tokens), hidden, torch.arange(len(row_tokens)), eps
            )
            assert (logits[step][row] - expected[-1]).abs().max() <= 1e-4, (row, step)
            hidden = torch.cat([hidden, output[-1:]])


@torch.no_grad()
def test_the_training_targets_are_the_target_models_logits_over_the_draft_vocabulary(setup):
    """scripts/train_eagle3.py's teacher logits, from only the LM head's draft-vocabulary rows, equal the
    full head's logits at those tokens, row j + 1's hidden state giving row j's."""
    from scripts.train_eagle3 import target_logits
    from scripts.train_mtp_head import Sequence

    hf_target = setup[0]
    draft_token_ids = torch.arange(DRAFT_VOCAB) * 3
    hidden_states = torch.randn(11, hf_target.config.hidden_size, generator=torch.Generator().manual_seed(7))
    sequence = Sequence(torch.tensor(random_prompts([12], seed=5)[0]), 4, hidden_states)
    logits = target_logits(hf_target.lm_head.weight[draft_token_ids], sequence)
    torch.testing.assert_close(logits, hf_target.lm_head(hidden_states[1:])[:, draft_token_ids])


# -- in the engine ----------------------------------------------------------------------------------


def save_drafter(folder, target: transformers.LlamaConfig, seed: int, **config_overrides: object):
    """A random EAGLE-3 drafter folder for `target` in vLLM's layout."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(draft_config(target) | config_overrides))
    save_file(random_drafter_tensors(target, seed), str(folder / "model.safetensors"))
    return folder


def engine_outputs(model_dir, records, speculative_config=None, **model_config):
    inference = make_inference(
        model_dir, model_config=model_config, speculative_config=speculative_config, max_new_tokens=16
    )
    result = inference.generate(records)
    return [r.output_token_ids for r in result.requests], result.summary


def test_method_eagle3_needs_a_drafter_folder():
    with pytest.raises(ConfigError, match="draft_model_path in t.yaml is required with method eagle3"):
        build_config({"speculative_config": {"method": "eagle3", "num_speculative_tokens": 2}}, source="t.yaml")
    with pytest.raises(ConfigError, match="npugraph_ex"):
        build_config(
            {
                "model_config": {"exe_mode": "npugraph_ex"},
                "speculative_config": {"method": "eagle3", "num_speculative_tokens": 2, "draft_model_path": "x"},
            },
            source="t.yaml",
        )
    with pytest.raises(ConfigError, match="eagle3 in t.yaml does not run with parallel_config.cp_size 2"):
        build_config(
            {
                "parallel_config": {"world_size": 2, "cp_size": 2},
                "speculative_config": {"method": "eagle3", "num_speculative_tokens": 2, "draft_model_path": "x"},
            },
            source="t.yaml",
        )


def test_a_folder_that_holds_no_eagle3_drafter_is_refused_naming_it(tiny_llama_dir):
    spec = {"method": "eagle3", "num_speculative_tokens": 2, "draft_model_path": str(tiny_llama_dir)}
    with pytest.raises(ConfigError, match=r"draft_model_path in test.yaml: .*config.json: architectures .* no EAGLE-3"):
        make_inference(tiny_llama_dir, speculative_config=spec)


def test_greedy_output_with_a_random_drafter_equals_speculation_off(tiny_llama_dir, tmp_path):
    """Drafts of a random drafter are mostly rejected: the verify path with rejections, the drafter's
    K/V after them, and lookahead slots; every token must still be greedy decoding's."""
    target = transformers.LlamaConfig.from_pretrained(tiny_llama_dir)
    drafter = save_drafter(
        tmp_path / "drafter", target, seed=3, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    )
    records = [PromptRecord(str(i), prompt_token_ids=p) for i, p in enumerate(random_prompts([5, 17, 1, 9], seed=4))]
    off, _ = engine_outputs(tiny_llama_dir, records)
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "draft_model_path": str(drafter)}
    on, summary = engine_outputs(tiny_llama_dir, records, spec)
    assert on == off
    assert summary["speculative"]["method"] == "eagle3" and summary["speculative"]["draft_tokens"] > 0
    assert len(summary["speculative"]["per_position"]) == 3
    # quantized at load, Q8_0's blocks: int8 rows at the drafter's few rows (q8_dot_linear.cpp)
    on, summary = engine_outputs(tiny_llama_dir, records, spec | {"quantization": "w8a16_g32+lm_head"})
    assert on == off
    assert summary["speculative"]["quantization"] == "w8a16_g32+lm_head"


@pytest.mark.parametrize("exe_mode", ["eager", "ge_graph"])
def test_prompt_lookup_in_front_of_the_drafter_keeps_greedy_output(tiny_llama_dir, tmp_path, exe_mode):
    """speculative_config.prompt_lookup with EAGLE-3: prompts that repeat themselves give lookups, the
    rest the drafter's chain; every token is still greedy decoding's, in the graph mode too, and
    summary.json counts the looked-up verifies apart."""
    target = transformers.LlamaConfig.from_pretrained(tiny_llama_dir)
    drafter = save_drafter(
        tmp_path / "drafter", target, seed=3, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    )
    phrases = random_prompts([6, 5, 7], seed=8)
    prompts = [phrases[0] * 3, phrases[1] + phrases[2] * 2, *random_prompts([9], seed=9)]
    records = [PromptRecord(str(i), prompt_token_ids=p) for i, p in enumerate(prompts)]
    off, _ = engine_outputs(tiny_llama_dir, records, exe_mode=exe_mode)
    spec = {"method": "eagle3", "num_speculative_tokens": 2, "draft_model_path": str(drafter), "prompt_lookup": True}
    on, summary = engine_outputs(tiny_llama_dir, records, spec, exe_mode=exe_mode)
    assert on == off
    speculative = summary["speculative"]
    assert speculative["prompt_lookup"] is True and speculative["looked_up"]["verifies"] > 0
    assert speculative["looked_up"]["share_of_verifies"] < 1  # the drafter drafted too
    if exe_mode == "ge_graph":
        assert sum(summary["graph"]["graph_steps_per_bucket"].values()) > 0


@torch.no_grad()
def reference_chain(
    weights: dict[str, torch.Tensor], hf_target, tokens: list[int], layers: tuple[int, int, int], k: int
) -> list[int]:
    """The k drafts after `tokens` (the request's tokens, the one just emitted last) of the drafter
    unrolled k steps in plain torch, each step recomputed from scratch over the whole sequence: rows
    0..n-2 take fc of the target's layers and t_{j+1}; chain row i takes draft i's embedding and the
    previous row's prenorm output, at the position after it."""
    embed, eps = hf_target.model.embed_tokens, hf_target.config.rms_norm_eps
    hidden = aux_hidden(hf_target, tokens[:-1], layers) @ weights["fc.weight"].T
    row_tokens, drafts = list(tokens[1:]), []
    for _ in range(k):
        output, _, draft_ids = reference_eagle3(
            weights, embed(torch.tensor(row_tokens)), hidden, torch.arange(len(row_tokens)), eps
        )
        drafts.append(int(draft_ids[-1]))
        row_tokens.append(drafts[-1])
        hidden = torch.cat([hidden, output[-1:]])
    return drafts


def rounded_like(weights: dict[str, torch.Tensor], schemes: str) -> dict[str, torch.Tensor]:
    """The drafter's tensors with every linear weight that `schemes` (speculative_config.quantization)
    quantizes rounded to nearest and dequantized in plain torch (ops/quant_math.py): the scheme computed
    plainly. The LM head only with "+lm_head", as model_config.quantization leaves it otherwise."""
    tokens = schemes.split("+")
    args = online_scheme(tokens[0], "test").weights
    linear = [name for name in weights if name.endswith("proj.weight") or name == "fc.weight"]
    rounded = dict(weights)
    for name in linear + (["lm_head.weight"] if "lm_head" in tokens else []):
        rounded[name] = quant_math.dequantize_weight(
            *quant_math.quantize_weight(weights[name], args), args, torch.float32
        )
    return rounded


@pytest.mark.parametrize("quantization", ["", "w8a16_g16+lm_head"])  # exact rows (not a GGUF block scheme)
def test_the_proposers_chain_equals_the_drafter_unrolled_in_plain_torch(
    tiny_llama_dir, tmp_path, monkeypatch, quantization
):
    """Every step's k drafts of every request (after prefill and after each verify, whatever was
    accepted) are those of the reference unrolled k steps over the request's tokens so far: the chain
    feeds the drafter's own prenorm hidden state and the previous draft at the right positions, and
    its K/V (the first pass's over the target's rows, the lookahead slots' over the chain's) is read
    and overwritten where it should be. A drafter quantized at load (speculative_config.quantization)
    drafts what the reference does over its weights rounded by the same scheme in plain torch."""
    target = transformers.LlamaConfig.from_pretrained(tiny_llama_dir)
    layers = (0, 1, 1)
    folder = save_drafter(
        tmp_path / "drafter", target, seed=3, eagle_config={"eagle_aux_hidden_state_layer_ids": layers}
    )
    weights = random_drafter_tensors(target, seed=3)
    if quantization:
        weights = rounded_like(weights, quantization)
        assert not torch.equal(weights["fc.weight"], random_drafter_tensors(target, seed=3)["fc.weight"])
    records = [PromptRecord(str(i), prompt_token_ids=p) for i, p in enumerate(random_prompts([5, 17, 1, 9], seed=4))]
    proposed: list[tuple[list[int], list[int]]] = []
    propose = Eagle3Proposer.propose

    def recording(self: Eagle3Proposer, context: ProposalContext) -> list[list[int]]:
        drafts = propose(self, context)
        for request, new_tokens, request_drafts in zip(context.requests, context.new_token_ids, drafts, strict=True):
            if new_tokens:
                proposed.append((request.token_ids_between(0, request.num_tokens) + new_tokens, request_drafts))
        return drafts

    monkeypatch.setattr(Eagle3Proposer, "propose", recording)
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "draft_model_path": str(folder)}
    _, summary = engine_outputs(tiny_llama_dir, records, spec | {"quantization": quantization})
    hf_target = load_hf_model(tiny_llama_dir)
    full_chains = [(tokens, drafts) for tokens, drafts in proposed if len(drafts) == 3]
    assert len(full_chains) > 10 and summary["speculative"]["accepted_tokens"] > 0
    for tokens, drafts in proposed:
        assert drafts == reference_chain(weights, hf_target, tokens, layers, len(drafts)), tokens


@pytest.fixture(scope="module")
def smollm2_eagle3_dir(smollm2_dir, tmp_path_factory):
    """A drafter for the default model trained briefly by scripts/train_eagle3.py (accepts some drafts)."""
    from scripts import train_eagle3

    output = tmp_path_factory.mktemp("eagle3") / "SmolLM2-EAGLE3"
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text("".join(line + "\n" for line in (DATASET_DIR / "mtp_train.jsonl").read_text().splitlines()[:16]))
    args = ["--model", str(smollm2_dir), "--prompts", str(prompts), "--output", str(output)]
    record = train_eagle3.main([*args, "--steps", "40", "--max-new-tokens", "32", "--draft-vocab", "4096"])
    assert record["held_out_accept_rate_by_position"][0] > record["held_out_accept_rate_by_position_at_init"][0]
    return output


def chat_records(smollm2_dir) -> list[PromptRecord]:
    records = load_prompts(DATASET_DIR / "mtp_train.jsonl")[:4]
    return [PromptRecord(r.id, messages=[{"role": "user", "content": r.prompt}]) for r in records]


@pytest.mark.slow
@pytest.mark.parametrize("exe_mode", ["eager", pytest.param("ge_graph", marks=pytest.mark.long)])
def test_real_model_greedy_output_with_a_trained_drafter_equals_speculation_off(
    exe_mode, smollm2_dir, smollm2_eagle3_dir
):
    records = chat_records(smollm2_dir)
    off, _ = engine_outputs(smollm2_dir, records)
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "draft_model_path": str(smollm2_eagle3_dir)}
    on, summary = engine_outputs(smollm2_dir, records, spec, exe_mode=exe_mode)
    assert on == off
    assert summary["speculative"]["accepted_tokens"] > 0
    if exe_mode == "ge_graph":
        assert sum(summary["graph"]["graph_steps_per_bucket"].values()) > 0
