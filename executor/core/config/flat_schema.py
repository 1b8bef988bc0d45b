"""cann-recipes' flattened YAML schema, the one three of its newest model folders use (docs/configuration.md).

Such a file names the run (model_name, model_path, draft_model_path, exe_mode, world_size) at the top
level, has no scheduler_config, and puts the scheduler's keys in model_config and data_config under
names of its own (pa_block_size, input_max_len, batch_size, ...). Each of its keys is a field here,
with the metadata of sections.py: `moved` to the sectioned key it means (taking that key's default,
rule and outcome, `maps_to` naming it), or with an outcome of its own. inference_config.py translates
a flattened file into the sectioned mapping, so one validator builds one InferenceConfig for both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from executor.core.config.sections import NESTED, SECTIONS, not_applicable, refused, rule

TOP_LEVEL = ""  # the prefix of the keys written at the top level of a flattened file


def moved(target: str, **changes: Any) -> Any:
    """The sectioned key `target` written at another place or under another name: its default, rule and
    outcome, with `changes` (a `values` mapping from this key's values to the target's, its choices)."""
    prefix, _, key = target.rpartition(".")
    target_field = next(f for f in dataclasses.fields(SECTIONS.get(prefix) or NESTED[prefix]) if f.name == key)
    metadata = {**target_field.metadata, "maps_to": target, **changes}
    if "default" in metadata:
        return rule(metadata.pop("default"), **metadata)
    if target_field.default_factory is not dataclasses.MISSING:
        return rule(default_factory=target_field.default_factory, **metadata)
    return rule(target_field.default, **metadata)


@dataclass(slots=True)
class FlatTopLevel:
    model_name: str = moved("model_config.model_name")
    model_path: str = moved("model_config.model_path")
    draft_model_path: str = not_applicable(
        "", "goes with model_config.draft_model_type dspark, which is refused", help="the DSpark draft model's folder"
    )
    exe_mode: str = moved(
        "model_config.exe_mode",
        choices=("eager", "ge_graph", "npugraph_ex", "acl_graph"),
        values={"acl_graph": "npugraph_ex"},
        help="acl_graph is torchair's ACL graph capture of decode, which npugraph_ex is",
    )
    world_size: int = moved("parallel_config.world_size")


@dataclass(slots=True)
class FlatModelConfig:
    next_n: int = moved("model_config.next_n")
    pa_block_size: int = moved("scheduler_config.block_size")
    with_ckpt: bool = moved("model_config.with_ckpt")
    enable_weight_nz: bool = moved("model_config.enable_weight_nz")
    enable_multi_streams: bool | int = moved("model_config.custom_params.enable_multi_streams")
    enable_offload: bool = moved("model_config.custom_params.enable_offload")
    shared_indexer_offload: bool = not_applicable(
        False, "keeps the sparse-attention indexer's cache in host memory; the KV cache stays on the device"
    )
    enlarge_pool_size: bool = not_applicable(
        False, "sizes the device pool of offloaded KV (goes with enable_offload, not applicable)"
    )
    enable_profiler: bool = moved("model_config.enable_profiler")
    perfect_eplb: bool = moved("model_config.force_eplb", help="uniform expert routing: what force_eplb is")
    enable_cache_compile: bool = moved("model_config.enable_cache_compile")
    enable_static_kernel: bool = moved("model_config.enable_static_kernel")
    enable_online_split_weight: bool = not_applicable(
        False,
        "each rank here reads its share of the full checkpoint at load, what True means; False's folders "
        "pre-split per rank (model_path/rank_<n>) are not read",
        help="split the full checkpoint per rank at load",
    )
    prefill_mini_batch_size: int = not_applicable(
        0,
        "prefills the fixed batch in cycles of N requests to bound NPU memory; the prefill budget here is "
        "scheduler_config.max_prefill_tokens, and results are equal",
        min=0,
        help="requests per prefill cycle; 0 = the whole batch at once",
    )
    platform_version: str = moved("model_config.platform_version")
    draft_model_type: str = refused(
        "none",
        ("none",),
        "DSpark's block draft model is not built (speculative_config.method draft_model takes a causal LM)",
        choices=("none", "dspark"),
        help="dspark: speculative decoding with a DSpark draft model of next_n tokens",
    )
    skip_warm_up: bool = not_applicable(
        True,
        "a short warm-up always runs here (it sizes the KV cache and captures graphs); it moves compile time, "
        "never changes tokens",
        help="skip the full prefill and decode warm-up",
    )
    mm_quant_mode: str = not_applicable(
        "A16W16",
        "cann-recipes' code does not read it: the checkpoint's own quantization_config decides, here too",
        choices=("A16W16", "A8W8"),
        help="matmul quantization",
    )
    gmm_quant_mode: str = not_applicable(
        "A16W16",
        "cann-recipes' code does not read it: the checkpoint's own quantization_config decides, here too",
        choices=("A16W16", "A8W8"),
        help="grouped (expert) matmul quantization",
    )
    tokenizer_mode: str = moved(
        "data_config.apply_chat_template",
        default="default",
        choices=("default", "chat"),
        values={"default": False, "chat": True},
        help="chat: prompts go through the chat template",
    )
    custom_params: dict = moved("model_config.custom_params")


@dataclass(slots=True)
class FlatDataConfig:
    dataset: str = moved("data_config.dataset")
    input_max_len: int = moved("data_config.input_truncated_len")
    max_new_tokens: int = moved("scheduler_config.max_new_tokens")
    batch_size: int = moved("scheduler_config.batch_size")
    temperature: float = moved("data_config.temperature")


@dataclass(slots=True)
class FlatParallelConfig:
    cp_size: int = moved("parallel_config.cp_size")
    attn_tp_size: int = moved("parallel_config.attn_tp_size")
    oproj_tp_size: int = moved("parallel_config.o_proj_tp_size")
    dense_tp_size: int = moved("parallel_config.dense_tp_size")
    moe_tp_size: int = moved("parallel_config.moe_tp_size")
    embed_tp_size: int = moved("parallel_config.embed_tp_size")
    lmhead_tp_size: int = moved("parallel_config.lmhead_tp_size")


# The flattened file's key tables, by prefix: TOP_LEVEL for the keys beside its sections.
FLAT_SECTIONS: dict[str, type] = {
    TOP_LEVEL: FlatTopLevel,
    "model_config": FlatModelConfig,
    "data_config": FlatDataConfig,
    "parallel_config": FlatParallelConfig,
}
