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
