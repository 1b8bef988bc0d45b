"""The YAML sections of a run, with cann-recipes-infer key names, defaults and rules.

Each field's metadata states its rule (`choices`, `min`, `above` (exclusive), `max`) and whether it only means
something on an NPU (`npu_only`), so one generic validator (inference_config.py) checks every key and
docs/configuration.md can be read straight off these classes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models import DEFAULT_MODEL_NAME


def rule(default: Any = None, *, default_factory: Any = None, **metadata: Any) -> Any:
    """A dataclass field carrying its validation rule in metadata."""
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(slots=True)
class ModelConfig:
    model_name: str = rule(DEFAULT_MODEL_NAME, help="folder under models/ holding the model code")
    model_path: str = rule("", help="HF model folder; empty = the default SmolLM2-135M-Instruct in $INFER_RECIPES_HOME")
    output_path: str = rule("", help="where results go; empty = models/<model_name>/res/<timestamp>_<yaml-stem>/")
    dtype: str = rule("bfloat16", choices=("float32", "bfloat16", "float16"), help="weights, activations and KV cache")
    with_ckpt: bool = rule(True, help="false: seeded random weights (DummyModelLoader)")
    exe_mode: str = rule(
        "eager",
        choices=("eager", "ge_graph", "npugraph_ex"),
        help="ge_graph / npugraph_ex run decode steps as a graph per bucket (docs/graph_modes.md)",
    )
    next_n: int = rule(0, min=0, help="MTP draft tokens per step (speculative_config method mtp); 0 = off")
    enable_cache_compile: bool = rule(False, help="keep compiled graphs in compile_cache_dir and load them next run")
    compile_cache_dir: str = rule("", help="ours: the compile cache; empty = $INFER_RECIPES_HOME/compile_cache")
    enable_static_kernel: bool = rule(False, npu_only=True, help="npugraph_ex static kernel compile")
    enable_dynamic_graph: bool = rule(False, npu_only=True, help="GE graph with dynamic shapes")
    enable_profiler: bool = rule(False, help="write a torch profiler trace of the run next to the outputs")
    custom_params: dict = rule(
        default_factory=dict, help="model-specific switches, kept with the run; no model reads any yet"
    )
    device: str = rule("auto", choices=("auto", "cpu", "cuda", "npu"), help="ours: force a platform")


@dataclass(slots=True)
class DataConfig:
    dataset: str = rule("default", help="a file in dataset/ (name with or without .jsonl)")
    dataset_path: str = rule("", help="any JSONL prompt file; wins over dataset")
    input_truncated_len: int = rule(0, min=0, help="keep the first N prompt tokens; 0 = no truncation")
    temperature: float = rule(0.0, min=0.0, help="0 (below 1e-5) = greedy; else random sampling (docs/sampling.md)")
    top_p: float = rule(1.0, above=0.0, max=1.0, help="keep the most likely tokens up to this probability; 1.0 = all")
    top_k: int = rule(0, min=0, help="keep the k most likely tokens; 0 = all")
    seed: int = rule(
        0, min=0, max=2**63 - 1, help="random weights; sampling: each request's own seed derives from it and its id"
    )
    min_p: float = rule(0.0, min=0.0, max=1.0, help="ours: cut tokens below min_p x the top probability; 0 = off")
    repetition_penalty: float = rule(1.0, above=0.0, help="ours: on prompt and output tokens (HF / vLLM); 1.0 = off")
    frequency_penalty: float = rule(0.0, min=-2.0, max=2.0, help="ours: minus this x count in the output; 0 = off")
    presence_penalty: float = rule(0.0, min=-2.0, max=2.0, help="ours: minus this if in the output; 0 = off")
    logprobs: int | None = rule(
        None, min=0, max=20, help="ours: per output token, its logprob and the top N; null = off"
    )
    apply_chat_template: bool = rule(True, help="ours: send text prompts through the chat template")
    num_prompts: int = rule(0, min=0, help="ours: use the first N prompts; 0 = all")


@dataclass(slots=True)
class ParallelConfig:
    world_size: int = rule(1, min=1, max=1, help="processes; one for now")
    attn_tp_size: int = rule(1, min=1, max=1, help="attention tensor parallel size")
    moe_tp_size: int = rule(1, min=1, max=1, help="MoE tensor parallel size (EP = world_size / this)")
    embed_tp_size: int = rule(1, min=1, max=1, help="embedding tensor parallel size")
    lmhead_tp_size: int = rule(1, min=1, max=1, help="LM head tensor parallel size")
    dense_tp_size: int = rule(1, min=1, max=1, help="dense FFN tensor parallel size")

    @property
    def attn_dp_size(self) -> int:
        return self.world_size // self.attn_tp_size

    @property
    def moe_ep_size(self) -> int:
        return self.world_size // self.moe_tp_size


@dataclass(slots=True)
class SchedulerConfig:
    batch_size: int = rule(1, min=1, help="most requests running at once")
    max_new_tokens: int = rule(32, min=1, help="tokens generated per request at most")
    max_prefill_tokens: int = rule(8192, min=1, help="token budget of one prefill step")
    mem_fraction_static: float = rule(0.9, min=0.01, max=1.0, help="share of free device memory for the KV cache")
    block_size: int = rule(128, min=1, help="tokens per KV block (NPU fused attention wants a multiple of 128)")
    num_blocks: int = rule(0, min=0, help="ours: KV blocks to allocate; 0 = size from the memory budget")
    max_model_len: int = rule(0, min=0, help="ours: longest prompt+output; 0 = the model's max_position_embeddings")
    ignore_eos: bool = rule(False, help="ours: run every request to max_new_tokens (benchmarks)")
    stop_token_ids: list[int] = rule(default_factory=list, help="ours: extra token ids that end a request")
    enable_prefix_caching: bool = rule(True, help="ours: reuse the cached K/V of prompt prefixes shared by requests")
    graph_buckets: list[int] = rule(
        default_factory=list, help="ours: decode batch sizes graph modes compile; empty = 1, 2, 4, 8, 16k, batch_size"
    )


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = rule(
        "",
        choices=("", "mtp", "ngram", "draft_model"),
        help="ours: draft proposer; empty = off (or model_config.next_n)",
    )
    num_speculative_tokens: int = rule(0, min=0, help="ours: draft tokens per request per step")
    draft_model_path: str = rule("", help="ours: method draft_model: a model folder with the target's tokenizer")
    prompt_lookup_min: int = rule(2, min=1, help="ours: method ngram: shortest n-gram matched")
    prompt_lookup_max: int = rule(4, min=1, help="ours: method ngram: longest n-gram matched (tried first)")


SECTIONS: dict[str, type] = {
    "model_config": ModelConfig,
    "data_config": DataConfig,
    "parallel_config": ParallelConfig,
    "scheduler_config": SchedulerConfig,
    "speculative_config": SpeculativeConfig,
}
