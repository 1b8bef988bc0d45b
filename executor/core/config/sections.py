"""The YAML sections of a run, with cann-recipes-infer key names, defaults and rules.

Each field's metadata states its rule (`choices`, `min`, `above` (exclusive), `max`), whether it
only means something on an NPU (`npu_only`), and what becomes of a cann-recipes key here
(`outcome`, see below), so that one generic validator (inference_config.py) checks every key and
docs/configuration.md is rendered straight off these classes (reference.py).

Outcomes, one per key:
- `used` (the default): the key does what it says.
- `not applicable`: accepted with cann-recipes' type and default, and logged once at start-up
  when a file sets it, with `reason`: it changes NPU formats, kernels, streams or deployment,
  never the tokens a run produces.
- `refused`: accepted only at the values in `runs_with`; any other value is refused with
  `reason`, since running it here would not give the results the user asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

USED = "used"
NOT_APPLICABLE = "not applicable"
REFUSED = "refused"
OUTCOMES = (USED, NOT_APPLICABLE, REFUSED)

_NOT_BUILT = "not built here: tensor, expert and data parallelism are (parallel_config)"


def rule(default: Any = None, *, default_factory: Any = None, **metadata: Any) -> Any:
    """A dataclass field carrying its validation rule and outcome in metadata."""
    metadata.setdefault("outcome", USED)
    assert metadata["outcome"] in OUTCOMES, metadata
    assert metadata["outcome"] == USED or metadata.get("reason"), "a key that is not used says why"
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def not_applicable(default: Any, reason: str, **metadata: Any) -> Any:
    """A key accepted and logged once as doing nothing here, with the reason."""
    return rule(default, outcome=NOT_APPLICABLE, reason=reason, **metadata)


def refused(default: Any, runs_with: tuple[Any, ...], reason: str, **metadata: Any) -> Any:
    """A key accepted at the values in runs_with and refused, with the reason, at any other."""
    return rule(default, outcome=REFUSED, runs_with=runs_with, reason=reason, **metadata)


def parallel_size(help_text: str) -> Any:
    """A parallel size: it must divide world_size, and fit the model (checked before weights load)."""
    return rule(1, min=1, help=help_text)


@dataclass(slots=True)
class ModelConfig:
    model_name: str = rule(
        "",
        help="a folder under models/, or a cann-recipes model name a folder answers to (its model_names); "
        "empty = the default model that models/__init__.py names",
    )
    model_path: str = rule("", help="HF model folder; empty = the default model's checkpoint in $INFER_RECIPES_HOME")
    output_path: str = rule("", help="where results go; empty = models/<folder>/res/<timestamp>_<yaml-stem>/")
    dtype: str = rule(
        "bfloat16",
        choices=("float32", "bfloat16", "float16", "auto"),
        help="weights, activations and KV cache; auto: bfloat16 where the device multiplies it fast, else float32",
    )
    with_ckpt: bool = rule(True, help="false: seeded random weights (DummyModelLoader)")
    next_n: int = rule(0, min=0, help="MTP draft tokens per step (speculative_config method mtp); 0 = off")
    platform_version: str = not_applicable(
        "",
        "picks per-chip NPU tunings (task queue, kernels); no per-chip code here",
        choices=("", "A2", "A3", "950"),
        help="Ascend chip generation; empty = detect",
    )
    exe_mode: str = rule(
        "eager",
        choices=("eager", "ge_graph", "npugraph_ex"),
        help="ge_graph / npugraph_ex run decode steps as a graph per bucket (docs/graph_modes.md)",
    )
    enable_cache_compile: bool = rule(False, help="keep compiled graphs in compile_cache_dir and load them next run")
    compile_cache_dir: str = rule("", help="ours: the compile cache; empty = $INFER_RECIPES_HOME/compile_cache")
    enable_static_kernel: bool = rule(False, npu_only=True, help="npugraph_ex static kernel compile")
    graph_cpp_wrapper: bool = rule(
        False,
        help="ours: ge_graph on CPU/CUDA calls each graph's kernels from C++ (inductor's cpp_wrapper), not Python: "
        "a shorter decode step at few rows, a longer compile per bucket",
    )
    enable_dynamic_graph: bool = not_applicable(
        True,
        "graph modes here capture one static graph per decode bucket (cann-recipes ignores it under ge_graph too)",
        help="dynamic shapes in cann-recipes' npugraph_ex compile",
    )
    force_eplb: bool = refused(
        False,
        (False,),
        "it replaces the router's expert choice by a round-robin one: a load-balance benchmark whose tokens "
        "are not the model's",
        help="MoE: route tokens to experts round-robin",
    )
    enable_profiler: bool = rule(
        False,
        help="profile the steps profile_prefill_steps / profile_decode_steps choose: a trace each under "
        "<output>/prof/prefill and prof/decode, the top operators in the log (docs/profiling.md)",
    )
    profile_prefill_steps: list[int] = rule(
        default_factory=lambda: [0], min=0, help="ours: with enable_profiler, which prefill steps (from 0) to profile"
    )
    profile_decode_steps: list[int] = rule(
        default_factory=lambda: [5], min=0, help="ours: with enable_profiler, which decode steps (from 0) to profile"
    )
    step_breakdown: bool | None = rule(
        None,
        help="ours: time each step's parts (prepare, h2d, forward, sample, propose, output); null = where it is free "
        "(CPU); on CUDA/NPU it waits for the device at each part",
    )
    prepack_weights: bool = rule(
        True,
        help="ours: on the CPU, lay linear weights out once at load for the fastest kernel at few rows (fp32: "
        "AVX-512 or AVX2 panels, bf16: AMX tiles where the CPU has AMX, else oneDNN's blocked layout; "
        "the plain weights stay too: their memory twice); "
        "off: MKL on the plain weights",
    )
    wna16_activations: str = rule(
        "auto",
        choices=("auto", "float", "int8"),
        help="ours: on the CPU, how 4/8-bit weight-only layers multiply at decode's few rows (up to 8): float: "
        "each weight dequantized to fp32 (the exact path); int8: each input row quantized to int8 per 32 values "
        "and multiplied in integers, as ggml does for GGUF files (faster, the row's rounding added; "
        "docs/quantization.md); "
        "auto: int8 for a GGUF's Q4_1 / Q8_0 blocks, float for the rest",
    )
    quantization: str = rule(
        "",
        help="ours: quantize at load, round to nearest: one weight scheme (w8a8, w8a16, w4a16, w4a16_asym, w4a8, "
        "fp8, fp8_block, mxfp4, mxfp8; _g<N> sets a group size) and/or c8 (int8 KV cache), joined by '+', with "
        "lm_head to quantize the LM head too (left unquantized otherwise); a "
        "quantized checkpoint's own config.json quantization_config is read without it (docs/quantization.md)",
    )
    enable_weight_nz: bool = not_applicable(
        True, "an NPU weight layout (FRACTAL_NZ); weights stay ND here", help="store weights in NZ format"
    )
    enable_hadamard: bool = refused(
        False,
        (False,),
        "the online Hadamard transform of attention inputs and outputs (cann-recipes' A4W4 MXFP4 attention, "
        "whose converted weights have it fused) is not built; such a checkpoint would run without it and give "
        "wrong tokens",
        help="apply offline Hadamard transform weights",
    )
    hadamard_weight_path: str = not_applicable(
        "", "goes with enable_hadamard, which is refused", help="folder of the offline Hadamard transform weights"
    )
    packed_sequence: bool = not_applicable(
        False,
        "cann-recipes' executor does not read it; here every batch is packed (TND) anyway",
        help="pack a batch's sequences into one",
    )
    custom_params: dict = rule(
        default_factory=dict, help="model switches; each known key and its outcome is in the custom_params table"
    )
    device: str = rule("auto", choices=("auto", "cpu", "cuda", "npu"), help="ours: force a platform")


@dataclass(slots=True)
class CustomParams:
    """model_config.custom_params: the switches cann-recipes' files set. The value stays a plain
    mapping (models read it); this class only gives each key its type, rule and outcome."""

    num_hidden_layers: int | None = rule(
        None, min=1, help="replaces the model config's layer count (the first N layers; tests, smoke runs)"
    )
    enable_afd: bool = refused(
        False, (False,), "attention-FFN disaggregation runs attention and FFN on separate ranks; " + _NOT_BUILT
    )
    enable_sp: bool = refused(False, (False,), "sequence parallel; " + _NOT_BUILT)
    ngram_embed_tp_size: int = refused(
        1, (1,), "n-gram embeddings are not built", min=1, help="n-gram embedding TP size"
    )
    enable_online_mxfp8_quantization: bool = rule(
        False,
        help="MXFP8 weights and activations rounded to nearest at load (model_config.quantization: mxfp8 with "
        "cann-recipes' layer choice; the LM head is never quantized); native on NPU, dequantized elsewhere",
    )
    online_mxfp8_quant_layers: list[str] = rule(
        default_factory=lambda: ["linear"],
        choices=("linear", "gmm", "moe", "moegmm", "fused_moe_gmm"),
        help="with enable_online_mxfp8_quantization: linear layers and/or (gmm) routed experts",
    )
    online_mxfp8_ignored_layers: list[str] = rule(
        default_factory=list,
        help="with enable_online_mxfp8_quantization: module names left unquantized, with their children",
    )
    enable_multi_streams: bool | int = not_applicable(
        False, "NPU multi-stream overlap; one stream here", help="overlap work on several NPU streams"
    )
    enable_moe_stream_overlap: bool = not_applicable(False, "NPU multi-stream overlap of MoE work; one stream here")
    enable_prefetch: bool = not_applicable(False, "NPU weight prefetch into L2")
    enable_superkernel: bool = not_applicable(False, "npugraph_ex super kernel fusion (NPU only)")
    enable_limit_core: bool = not_applicable(False, "limits the NPU cube/vector cores an op may use")
    enable_limit_core_num: bool = not_applicable(False, "goes with enable_limit_core")
    enable_mla_prolog: bool = not_applicable(False, "the fused NPU MLA prolog kernel; the torch reference runs")
    enable_pypto: bool = not_applicable(False, "PyPTO NPU kernels; the torch reference runs")
    enable_gdn_solve_triangular: bool = not_applicable(False, "an NPU kernel for gated delta-net attention")
    enable_mm_all_reduce_base: bool = not_applicable(
        False, "an NPU kernel fusing matmul and all-reduce; the two run apart here, with equal results"
    )
    enable_o_proj_alltoall: bool = not_applicable(
        False, "all-to-all around o_proj; o_proj is split with the attention heads here (o_proj_tp_size)"
    )
    enable_offload: bool = not_applicable(False, "keeps KV in host-swapped memory; the KV cache stays on the device")
    micro_batch_mode: int = not_applicable(0, "micro-batch overlap of communication and compute; one stream here")
    moe_chunk_max_len: int = not_applicable(0, "splits MoE work into chunks to bound NPU memory; results are equal")
    attn_res_mode: str = not_applicable(
        "original",
        "picks the NPU kernels of attention residuals; the torch reference runs",
        choices=("original", "two_phase", "fused"),
        help="attention-residual backend",
    )
    enable_flash_kda: bool = not_applicable(
        False, "the fused NPU kernel of KDA (a delta-rule linear attention) at prefill"
    )
    enable_fused_recurrent_kda: bool = not_applicable(
        False, "the fused NPU kernel of KDA (a delta-rule linear attention) at decode"
    )
    enable_mega_moe: bool = not_applicable(False, "one fused NPU kernel for dispatch, experts and combine")
    enable_moe_bf16_mode: bool = refused(
        False,
        (False,),
        "it rounds the experts' gated activation (a SiTU activation) in bfloat16 instead of float32, a numerics "
        "choice not built here",
        help="MoE gated activation in bfloat16",
    )


@dataclass(slots=True)
class DataConfig:
    dataset: str = rule(
        "default",
        help='a file in dataset/ (name with or without .jsonl or .json); JSONL or cann-recipes\' {"text": ...}',
    )
    dataset_path: str = rule(
        "",
        help="any prompt file (as for dataset); wins over dataset. With LongBench / InfiniteBench: the folder of "
        "the benchmark's <task>.jsonl files; empty = dataset/LongBench or dataset/InfiniteBench",
    )
    input_truncated_len: int = rule(
        256,
        min=0,
        help="keep the first N prompt tokens; 0 = no truncation. LongBench / InfiniteBench prompts are cut to fit "
        "first, as benchmark_prompt says",
    )
    tasks: list[str] = rule(
        default_factory=list,
        help="ours: the LongBench / InfiniteBench tasks to read (their file names less .jsonl); empty = cann-recipes' "
        "set: LongBench's 21 tasks and 13 LongBench-E ones (<task>_e), InfiniteBench's longbook_qa_eng",
    )
    benchmark_prompt: str = rule(
        "summary",
        choices=("summary", "task"),
        help="ours: LongBench / InfiniteBench prompts; summary = cann-recipes': the context's head in its "
        "summarize-the-book wrapper; task = the benchmark's template for the task, its middle cut to fit",
    )
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
    prompt_logprobs: int | None = rule(
        None, min=0, max=20, help="ours: per prompt token, its logprob (teacher forced) and the top N; null = off"
    )
    bad_words: list[str] = rule(
        default_factory=list, help="ours (vLLM's): words no output may hold, for every request (docs/sampling.md)"
    )
    guided_json: dict | str | None = rule(
        None, help="ours (vLLM's): a JSON schema every output follows (docs/sampling.md, structured output)"
    )
    guided_regex: str = rule("", help="ours (vLLM's): a regular expression every output matches")
    guided_choice: list[str] = rule(default_factory=list, help="ours (vLLM's): every output is one of these")
    guided_grammar: str = rule("", help="ours (vLLM's): an EBNF grammar (xgrammar's) every output follows")
    structured_outputs: dict | None = rule(
        None, help="ours (vLLM's): one of json, regex, choice, grammar, json_object: true; as the guided_* keys"
    )
    apply_chat_template: bool = rule(True, help="ours: send text prompts through the chat template")
    num_prompts: int = rule(0, min=0, help="ours: use the first N prompts; 0 = all")


@dataclass(slots=True)
class ParallelConfig:
    """Sizes as cann-recipes defines them (executor/core/config/parallel_layout.py has the groups);
    world_size processes are started by infer.sh through torchrun (docs/distributed.md)."""

    world_size: int = parallel_size("processes (one per device); above 1 infer.sh starts them with torchrun")
    attn_tp_size: int = parallel_size(
        "attention tensor parallel size; data parallel size = world_size / (this x cp_size)"
    )
    moe_tp_size: int = parallel_size("MoE tensor parallel size (EP = world_size / this)")
    moe_ep_size: int = not_applicable(
        0, "derived as world_size / moe_tp_size (cann-recipes ignores the written value too)", min=0
    )
    embed_tp_size: int = parallel_size("embedding tensor parallel size (wider than attn_tp_size: lock-step DP)")
    lmhead_tp_size: int = parallel_size("LM head tensor parallel size (wider than attn_tp_size: lock-step DP)")
    dense_tp_size: int = parallel_size("dense FFN tensor parallel size (wider than attn_tp_size: lock-step DP)")
    o_proj_tp_size: int = not_applicable(
        1,
        "o_proj is split with the attention heads (attn_tp_size); another split changes which ranks exchange "
        "what, not the results",
        min=1,
        help="attention output projection tensor parallel size",
    )
    shared_tp_size: int = not_applicable(
        1,
        "shared experts are split like the routed experts' intermediate dim (moe_tp_size); another split "
        "changes which ranks hold what, not the results",
        min=1,
        help="shared-expert tensor parallel size",
    )
    cp_size: int = rule(
        1,
        min=1,
        help="context parallel size: 1, or world_size (cann-recipes' rule, with attn_tp_size 1): each prefill "
        "step's tokens split over the ranks, decode and verify steps whole on each (docs/distributed.md)",
    )
    pp_size: int = refused(
        1, (1,), "pipeline parallel is not built", min=1, help="pipeline parallel size (cann-recipes does not read it)"
    )
    collective_timeout_s: int = rule(
        600, min=1, help="ours: the longest any collective waits (a rank that died turns into an error, not a hang)"
    )


@dataclass(slots=True)
class SchedulerConfig:
    batch_size: int = rule(1, min=1, help="most requests running at once (see batch_size_meaning)")
    batch_size_meaning: str = rule(
        "max_running",
        choices=("max_running", "num_requests"),
        help="ours: max_running = every dataset prompt is a request, batch_size of them run at once; "
        "num_requests = cann-recipes': exactly batch_size requests, the prompts repeated or cut to fit",
    )
    max_new_tokens: int = rule(32, min=1, help="tokens generated per request at most")
    max_prefill_tokens: int = rule(
        0,
        min=0,
        help="token budget of one prefill step; 0 = input_truncated_len x batch_size (or 8192 without truncation)",
    )
    mem_fraction_static: float = rule(0.85, min=0.01, max=1.0, help="share of free device memory for the KV cache")
    block_size: int = rule(128, min=1, help="tokens per KV block (NPU fused attention wants a multiple of 128)")
    num_reserved_decode_tokens: int = rule(
        64,
        min=0,
        help="the decode role of prefill-decode disaggregation (disagg_config): tokens of room every request in "
        "flight keeps past its own; a new one is admitted when its prompt and that room fit the free blocks less "
        "the others' (cann-recipes' admission); unused in the other modes",
    )
    cp_mini_batch: int = rule(
        -1,
        help="most requests in one prefill step when parallel_config.cp_size > 1; -1 (or 0) = no cap",
    )
    num_blocks: int = rule(0, min=0, help="ours: KV blocks to allocate; 0 = size from the memory budget")
    max_model_len: int = rule(
        0, min=0, help="ours: longest prompt+output, at least 2; 0 = the model's max_position_embeddings"
    )
    ignore_eos: bool = rule(False, help="ours: run every request to max_new_tokens (benchmarks)")
    stop_token_ids: list[int] = rule(default_factory=list, help="ours: extra token ids that end a request")
    enable_prefix_caching: bool = rule(True, help="ours: reuse the cached K/V of prompt prefixes shared by requests")
    graph_buckets: list[int] = rule(
        default_factory=list, help="ours: decode batch sizes graph modes compile; empty = 1, 2, 4, 8, 16k, batch_size"
    )
    console_step_interval: int = rule(
        0,
        min=0,
        help="ours: steps between the step lines the console shows (steps.log and steps.jsonl hold every step); "
        "0 = about 40 a run",
    )


@dataclass(slots=True)
class SpeculativeConfig:
    method: str = rule(
        "",
        choices=("", "mtp", "ngram", "draft_model", "eagle3"),
        help="ours: draft proposer; empty = off (or model_config.next_n)",
    )
    num_speculative_tokens: int = rule(0, min=0, help="ours: draft tokens per request per step")
    draft_model_path: str = rule(
        "",
        help="ours: method draft_model: a model folder with the target's tokenizer; method eagle3: an EAGLE-3 "
        "drafter folder in vLLM's layout (docs/speculative_decoding.md)",
    )
    quantization: str = rule(
        "",
        help="ours: quantize the drafter at load, as model_config.quantization names schemes (w8a16_g64+lm_head, "
        "...): method eagle3's drafter (unquantized when empty), method draft_model's model (the target's "
        "model_config.quantization when empty); a drafter's weights are read every draft pass, so fewer bytes "
        "make each cheaper (docs/speculative_decoding.md)",
    )
    prompt_lookup_min: int = rule(2, min=1, help="ours: method ngram and prompt_lookup: shortest n-gram matched")
    prompt_lookup_max: int = rule(
        4, min=1, help="ours: method ngram and prompt_lookup: longest n-gram matched (tried first)"
    )
    prompt_lookup: bool = rule(
        False,
        help="ours: methods mtp and eagle3: a request whose last n-gram recurs in its own tokens takes the tokens "
        "that followed it as its drafts (method ngram's lookup), the drafter's chain elsewhere, which then stops "
        "after its first pass for that request (Arctic Inference's suffix-then-model fallback; "
        "docs/speculative_decoding.md)",
    )


@dataclass(slots=True)
class DisaggConfig:
    """cann-recipes' DisaggConfig: the role of an online instance in prefill-decode disaggregation
    (docs/online.md). NONE runs combined: offline, or one online instance doing both."""

    disaggregation_mode: str = rule(
        "NONE",
        choices=("NONE", "PREFILL", "DECODE"),
        help="NONE: combined; PREFILL / DECODE: this online instance's role (`--pd-role` sets it); offline runs "
        "combined whatever it says",
    )
    bootstrap_host: str = rule(
        "127.0.0.1", help="the prefill leader's bootstrap server: where it listens, where decode reads the rank table"
    )
    bootstrap_port: int = rule(18800, min=0, max=65535, help="its port; 0 = a free one, logged (the prefill role)")
    store_url: str = rule(
        "",
        help="tcp://host:port of the TCPStore the instance pairs' gloo groups meet on; empty = a free port on "
        "local_ip, announced through the bootstrap server",
    )
    is_store_creator_node: bool = rule(
        True, help="the prefill leader creates the store at store_url (false: it joins one another node made)"
    )
    local_ip: str = rule("127.0.0.1", help="the address this instance's KV-transfer control socket listens on")
    transfer_timeout_s: float = rule(
        60.0,
        above=0.0,
        help="ours: longest a decode instance waits for a request's KV (and a prefill instance for its decode "
        "peer) before that request fails alone",
    )
    transfer_backend: str = rule(
        "gloo",
        choices=("gloo", "nccl", "hccl"),
        help="ours: the torch.distributed backend of the KV data path between the two instances' ranks "
        "(docs/distributed.md)",
    )
    router_port: int = rule(
        -1,
        min=-1,
        max=65535,
        help="ours: the decode leader starts the Router beside itself on this port (cann-recipes' sidecar on "
        "the decode instance's node 0), in front of router_prefill_urls and itself; 0 = a free one, logged; "
        "-1 = none",
    )
    router_prefill_urls: list[str] = rule(
        default_factory=list, help="ours: the prefill instances (http://host:port) of the Router router_port starts"
    )


SECTIONS: dict[str, type] = {
    "model_config": ModelConfig,
    "data_config": DataConfig,
    "parallel_config": ParallelConfig,
    "scheduler_config": SchedulerConfig,
    "speculative_config": SpeculativeConfig,
    "disagg_config": DisaggConfig,
}
# Mappings inside a section whose keys have a table of their own: "section.key" -> class.
NESTED: dict[str, type] = {"model_config.custom_params": CustomParams}
