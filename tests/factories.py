"""The one place tests make Requests, word-level tokenizers and tiny random model configs (one factory per family)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping

import transformers
from tokenizers import Tokenizer, processors
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from executor.types_ import Request, SamplingParams

TINY_VOCAB = 256  # the tiny tokenizer has a word for every token id of the parity models (PARITY_SETTINGS)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
)


def make_request(
    request_id: str = "r", prompt: Iterable[int] = (1, 2, 3), output: Iterable[int] = (), **params: object
) -> Request:
    """A request of token ids `prompt` (no text), `output` already generated, SamplingParams(**params)."""
    return Request(request_id, None, list(prompt), SamplingParams(**params), output_token_ids=list(output))


def word_tokenizer(
    vocab: Mapping[str, int],
    chat_template: str | None,
    *,
    prepend_bos: bool = False,
    **special_tokens: object,
) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over `vocab`, built offline; with `prepend_bos`, encoding
    starts with <s> as Llama's does. `special_tokens`: PreTrainedTokenizerFast's (bos_token=...)."""
    backend = Tokenizer(WordLevel(dict(vocab), unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    if prepend_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", **special_tokens)
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Words w3..w255 plus <unk>, <s>, </s> (ids 0, 1, 2): enough to encode and decode offline."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, TINY_VOCAB)}
    return word_tokenizer(vocab, TINY_CHAT_TEMPLATE, bos_token="<s>", eos_token="</s>", pad_token="</s>")


# What every family's tiny parity config shares: random weights that give peaked logits (greedy
# choices far from ties), no special tokens (transformers' generate must not stop early) and
# transformers' eager attention.
PARITY_SETTINGS: dict[str, object] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    max_position_embeddings=128,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    attn_implementation="eager",
)


def parity_config(
    make_config: Callable[..., transformers.PretrainedConfig],
    family_settings: Mapping[str, object],
    overrides: Mapping[str, object],
) -> transformers.PretrainedConfig:
    """make_config (a config class) with PARITY_SETTINGS, then a family's own settings, then a test's overrides."""
    return make_config(**(PARITY_SETTINGS | dict(family_settings) | dict(overrides)))


def llama_config(**overrides: object) -> transformers.LlamaConfig:
    """A tiny random Llama config for parity tests (PARITY_SETTINGS, 3 layers); overrides change any field."""
    return parity_config(transformers.LlamaConfig, {"intermediate_size": 128, "num_hidden_layers": 3}, overrides)


def mtp_config(**overrides: object) -> transformers.LlamaConfig:
    """llama_config with GQA (4 heads over 2) and one MTP layer (num_nextn_predict_layers=1)."""
    return llama_config(num_key_value_heads=2, num_nextn_predict_layers=1, **overrides)


def qwen_config(family: str, **overrides: object) -> transformers.PretrainedConfig:
    """Three tiny layers, GQA (4 heads over 2), 8 experts choosing 2 for MoE; overrides change any field."""
    settings: dict[str, object] = dict(intermediate_size=96, num_hidden_layers=3, num_key_value_heads=2)
    if family == "qwen3":
        settings["head_dim"] = 16
    if family == "qwen3_moe":
        settings |= dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    return parity_config(functools.partial(transformers.AutoConfig.for_model, family), settings, overrides)


GPT_OSS_WINDOW = 8  # gpt_oss_config's sliding window


def gpt_oss_yarn(truncate: bool) -> dict:
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
        intermediate_size=32,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=GPT_OSS_WINDOW,
        rope_parameters=gpt_oss_yarn(truncate=False),
    )
    return parity_config(transformers.GptOssConfig, settings, overrides)


# What the tiny DeepSeek-V2 and V3 configs share: three layers (the first dense), MLA's dims, 8 routed
# experts choosing 3 and one shared expert.
DEEPSEEK_SETTINGS: dict[str, object] = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_key_value_heads=4,  # transformers' eager attention repeats K/V by heads // this
    n_shared_experts=1,
    n_routed_experts=8,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
)


def deepseek_config(**overrides: object) -> transformers.DeepseekV3Config:
    """DEEPSEEK_SETTINGS with the 8 experts in 4 groups, q_lora_rank set, no MTP module; overrides
    change any field."""
    settings = DEEPSEEK_SETTINGS | dict(n_group=4, topk_group=2, q_lora_rank=48, num_nextn_predict_layers=0)
    return parity_config(transformers.DeepseekV3Config, settings, overrides)


def deepseek_v2_config(**overrides: object) -> transformers.DeepseekV2Config:
    """DEEPSEEK_SETTINGS as DeepSeek-V2-Lite is built: no q LoRA (a plain q_proj), greedy softmax
    routing; routed_scaling_factor 1.5 so that a lost scale shows. Overrides change any field
    (topk_method="group_limited_greedy" with n_group and topk_group)."""
    settings = DEEPSEEK_SETTINGS | dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5)
    return parity_config(transformers.DeepseekV2Config, settings, overrides)


def longcat_flash_config(**overrides: object) -> transformers.LongcatFlashConfig:
    """Two layers (four MLA blocks), 8 routed experts and 4 zero-computation ones choosing 3,
    routed_scaling_factor 1.5 so that a lost scale shows; overrides change any field."""
    settings = dict(
        num_layers=2,
        ffn_hidden_size=96,
        expert_ffn_hidden_size=32,
        n_routed_experts=8,
        zero_expert_num=4,
        moe_topk=3,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        head_dim=8,  # transformers' rope dims
        qk_nope_head_dim=16,
        v_head_dim=12,
        routed_scaling_factor=1.5,
    )
    return parity_config(transformers.LongcatFlashConfig, settings, overrides)


STEP3P7_WINDOW = 8  # step3p7_config's sliding window
# Four layers (sliding, full, sliding, full; the first dense, the others MoE), GQA with more heads on
# the sliding layers, partial rope with llama3 scaling on the full layers and another theta on the
# sliding ones, 8 experts choosing 3, a shared expert, and clamped SwiGLUs on the last layer.
STEP3P7_SETTINGS: dict[str, object] = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    share_expert_dim=48,
    num_hidden_layers=4,
    num_key_value_heads=2,
    num_sliding_attention_heads=6,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=3,
    layer_types=["sliding_attention", "full_attention"] * 2,
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    sliding_window=STEP3P7_WINDOW,
    rope_theta=[10000.0, 500000.0] * 2,
    partial_rotary_factors=[1.0, 0.5] * 2,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 2.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    moe_router_scaling_factor=2.5,
    swiglu_limits=[0.0, 0.0, 0.0, 0.5],
    swiglu_limits_shared=[0.0, 0.0, 0.0, 0.5],
    tie_word_embeddings=False,
    pad_token_id=0,  # an int, not None, in Step3p7TextConfig
)


def step3p7_config(**overrides: object) -> transformers.Step3p7Config:
    """Step-3.7-Flash's multimodal config (as its checkpoints ship it) over STEP3P7_SETTINGS' text
    config and a one-layer vision tower that text-only runs never call; overrides change text fields."""
    text_config = parity_config(transformers.Step3p7TextConfig, STEP3P7_SETTINGS, overrides)
    vision_config = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    return transformers.Step3p7Config(
        text_config=text_config.to_dict(),
        vision_config=vision_config,
        tie_word_embeddings=text_config.tie_word_embeddings,
        attn_implementation="eager",
    )


def deepseek_v4_config(**overrides: object) -> transformers.DeepseekV4Config:
    """A tiny DeepSeek-V4: one layer of each attention kind and a second compressed sparse one
    (compress rates 4 and 8, window 6), the first layer hash-routed, 2 hyper-connection streams,
    an indexer keeping 2 entries, no MTP module; overrides change any field."""
    settings = dict(
        hidden_size=32,
        num_hidden_layers=4,
        head_dim=16,
        partial_rotary_factor=0.5,
        q_lora_rank=24,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        sliding_window=6,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=2,
        hc_mult=2,
        hc_sinkhorn_iters=3,
        num_nextn_predict_layers=0,
    )
    return parity_config(transformers.DeepseekV4Config, settings, overrides)


# What the tiny Kimi-Linear and Ling 3 configs share: DeepSeek's MLA dims and MoE sizes under their
# names (num_local_experts), KDA layers of 4 heads of 16, four layers (the first dense).
KDA_HYBRID_SETTINGS: dict[str, object] = dict(
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    num_local_experts=8,
    num_experts_per_tok=3,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    linear_num_heads=4,
)


def kimi_linear_config(**overrides: object) -> transformers.KimiLinearConfig:
    """KDA, KDA, MLA, KDA; one group of 8 experts (Kimi-Linear-48B's routing); routed_scaling_factor
    2.446 as released. Overrides change any field."""
    settings = KDA_HYBRID_SETTINGS | dict(
        linear_head_dim=16,
        q_lora_rank=None,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    )
    return parity_config(transformers.KimiLinearConfig, settings, overrides)


def bailing_hybrid_config(**overrides: object) -> transformers.BailingHybridConfig:
    """KDA and MLA alternating (layer_group_size 2), 8 experts in 4 groups of which 2 are kept, the
    bounded forget gate, no MTP layer. Overrides change any field (head_dim is KDA's head size)."""
    settings = KDA_HYBRID_SETTINGS | dict(
        head_dim=16, layer_group_size=2, first_k_dense_replace=1, n_group=4, topk_group=2, num_mtp_layers=0
    )
    return parity_config(transformers.BailingHybridConfig, settings, overrides)


def hy3_config(**overrides: object) -> transformers.HYV3Config:
    """Three tiny layers (the first dense, as transformers' default mlp_layer_types), GQA (4 heads over
    2, head_dim 16), 8 experts choosing 2 plus one shared expert, router_scaling_factor 2.826 (Hy3's,
    so that a lost scale shows); overrides change any field."""
    settings = dict(
        intermediate_size=96,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    return parity_config(transformers.HYV3Config, settings, overrides)


GEMMA4_WINDOW = 8  # gemma4_config's sliding window


def gemma4_config(**overrides: object) -> transformers.Gemma4TextConfig:
    """Four layers (sliding, full, sliding, full), GQA, head_dim 16 in sliding layers and 32 in full
    ones (global_head_dim), a window of 8, the logits soft-capped at 3 (the tiny model's logits are of
    that order, so the cap bends them); overrides change any field (per-layer inputs, KV sharing,
    k_eq_v, MoE)."""
    settings = dict(
        intermediate_size=48,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=GEMMA4_WINDOW,
        final_logit_softcapping=3.0,
        hidden_size_per_layer_input=0,
    )
    return parity_config(transformers.Gemma4TextConfig, settings, overrides)


# What the tiny DSA configs (DeepSeek-V3.2, GLM-5) add to deepseek_config's: an indexer of 16 heads
# of 16 dims (its rope on the first qk_rope_head_dim = 8) that keeps 6 tokens, fewer than most
# prompts, so that the selection decides what each query attends to. 16 heads, not fewer: a token
# whose every head's relu is 0 scores exactly 0 (probability 2**-heads), and tokens tied at the
# top-k cut are broken by torch.topk differently over rows of different lengths (a chunked prefill's
# rows are shorter than a whole prompt's), as transformers' own incremental decode and full forward
# then differ; real checkpoints have 32 or 64 heads.
DSA_SETTINGS: dict[str, object] = dict(index_n_heads=16, index_head_dim=16, index_topk=6)


def dsa_config(family: str, **overrides: object) -> transformers.PretrainedConfig:
    """deepseek_config's tiny DeepSeek-V3 shape (q LoRA, 8 experts in 4 groups) as transformers'
    `family` ("deepseek_v32" or "glm_moe_dsa"), with DSA_SETTINGS; overrides change any field."""
    settings = DEEPSEEK_SETTINGS | dict(n_group=4, topk_group=2, q_lora_rank=48) | DSA_SETTINGS
    return parity_config(functools.partial(transformers.AutoConfig.for_model, family), settings, overrides)
