"""The run's quantization plan: config.json's `quantization_config` (compressed-tensors', or ours for a
GGUF's blocks), and/or `model_config.quantization` (schemes rounded to nearest at load).

compressed-tensors parses and validates the checkpoint's config (its pydantic QuantizationConfig, as
vLLM and transformers read it); this module keeps what runs here and refuses the rest in one line
that names the group, the scheme and the file. `model_config.quantization` is one weight scheme
and/or `c8`, joined by "+": w8a8, w8a16, w4a16, w4a16_asym, w4a8 (int4 groups of 128; a `_g<N>`
suffix sets another group size), fp8 (per channel, dynamic per-token activations), fp8_block
(128x128), mxfp4, mxfp8, and c8 (an int8 KV cache, dynamic per token and head). The LM head stays
unquantized, as llm-compressor's recipes leave it, unless `lm_head` is joined too (w8a8+lm_head): the
largest matmul of a small model, at some cost in agreement (docs/benchmarks.md). On a quantized
checkpoint a weight scheme must be the checkpoint's own (anything else is a conflict); c8 adds an
int8 KV cache where the checkpoint has no kv_cache_scheme.

A folder written from a GGUF's blocks (executor/model_loader/gguf_import.py, convert_gguf_blocks)
says `{"quant_method": "gguf-blocks", "modules": {checkpoint module: "q4_1" | "q8_0"}}`: one
scheme per block type (types_/quant_scheme.py's GGUF_BLOCK_SCHEMES), for exactly the modules named.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    preset_name_to_scheme,
)
from compressed_tensors.quantization.utils.mxfp_utils import should_generate_mx_scales
from pydantic import ValidationError

from executor.types_.quant_scheme import (
    CHANNEL,
    GGUF_BLOCK_SCHEMES,
    GGUF_FORMAT,
    ONLINE,
    TENSOR,
    TOKEN,
    KVCacheScheme,
    LinearScheme,
    QuantArgs,
    QuantizationPlan,
    SchemeGroup,
)
from module.quantized import QuantizationError

# compressed-tensors formats whose tensors module/quantized.py decodes
FORMATS = (
    "int-quantized",
    "pack-quantized",
    "float-quantized",
    "naive-quantized",
    "mxfp4-pack-quantized",
    "mxfp8-quantized",
)
STRATEGIES = ("tensor", "channel", "group", "block", "token")
# model_config.quantization's weight schemes -> compressed-tensors presets
PRESETS = {
    "w8a8": "W8A8",
    "w8a16": "W8A16",
    "w4a16": "W4A16",
    "w4a16_asym": "W4A16_ASYM",
    "w4a8": "W4A8",
    "fp8": "FP8_DYNAMIC",
    "fp8_block": "FP8_BLOCK",
    "mxfp4": "MXFP4A16",
    "mxfp8": "MXFP8",
}
C8 = "c8"
LM_HEAD = "lm_head"  # quantize the LM head too, with the weight scheme
GROUP_SUFFIX = re.compile(r"^(?P<preset>.+)_g(?P<group>\d+)$")
# as llm-compressor's recipes leave them: the LM head and the MoE routers
ONLINE_IGNORE = ("lm_head", r"re:.*mlp\.gate$", r"re:.*mlp\.router$")
OWN_MXFP4 = "mxfp4"  # a model's own MXFP4 format (quant_method "mxfp4"): the model decodes its *_blocks / *_scales


def quant_args(args: QuantizationArgs, where: str) -> QuantArgs:
    """Our QuantArgs from compressed-tensors'; what we do not run is a QuantizationError naming `where`."""
    strategy = str(getattr(args.strategy, "value", args.strategy))
    if strategy not in STRATEGIES:
        raise QuantizationError(f"{where}: strategy {strategy!r} is not run here (runs: {', '.join(STRATEGIES)})")
    if args.actorder is not None and str(getattr(args.actorder, "value", args.actorder)) == "group":
        raise QuantizationError(f"{where}: activation ordering 'group' (a g_idx per column) is not run here")
    kind = str(getattr(args.type, "value", args.type))
    if (kind, args.num_bits) not in (("int", 4), ("int", 8), ("float", 8), ("float", 4)):
        raise QuantizationError(f"{where}: {kind}{args.num_bits} is not run here (int4, int8, fp8, fp4)")
    if strategy == "group" and (args.group_size is None or args.group_size < 1):
        raise QuantizationError(
            f"{where}: group size {args.group_size}: a group size must be a positive divisor of each layer's "
            "input features (K)"
        )
    block = tuple(args.block_structure) if args.block_structure else None
    return QuantArgs(
        num_bits=args.num_bits,
        type=kind,
        strategy=strategy,
        symmetric=bool(args.symmetric),
        group_size=args.group_size,
        block_structure=block,
        dynamic=bool(args.dynamic),
        mx=bool(should_generate_mx_scales(args)),
    )


def linear_scheme(weights: QuantizationArgs | None, inputs: QuantizationArgs | None, where: str) -> LinearScheme:
    if weights is None:
        raise QuantizationError(f"{where}: activation-only quantization (no weights args) is not run here")
    scheme = LinearScheme(quant_args(weights, f"{where} weights"), inputs and quant_args(inputs, f"{where} inputs"))
    try:
        scheme.kind  # noqa: B018 - validates the combination
    except ValueError as error:
        raise QuantizationError(f"{where}: {error}") from None
    return scheme


def kv_cache_scheme(args: QuantizationArgs | None, where: str) -> KVCacheScheme | None:
    if args is None:
        return None
    parsed = quant_args(args, where)
    if parsed.type != "int" or parsed.num_bits != 8 or not parsed.symmetric:
        raise QuantizationError(f"{where}: {parsed.describe()} KV cache is not run here; C8 is symmetric int8")
    if parsed.dynamic:
        return KVCacheScheme(TOKEN)
    if parsed.strategy not in (TENSOR, CHANNEL):
        raise QuantizationError(f"{where}: a static KV cache scale per {parsed.strategy} is not run here")
    return KVCacheScheme(parsed.strategy)


def gguf_blocks_plan(quantization_config: Mapping[str, Any], source: str) -> QuantizationPlan:
    """The plan of a folder of GGUF blocks: each named module runs its block type's scheme."""
    modules = quantization_config.get("modules")
    if not isinstance(modules, Mapping) or not modules:
        raise QuantizationError(f"{source}: quantization_config.modules must map module names to GGUF block types")
    by_type: dict[str, list[str]] = {}
    for module, block_type in modules.items():
        if block_type not in GGUF_BLOCK_SCHEMES:
            raise QuantizationError(
                f"{source}: quantization_config.modules.{module}: block type {block_type!r} is not run here "
                f"(runs: {', '.join(GGUF_BLOCK_SCHEMES)})"
            )
        by_type.setdefault(block_type, []).append(module)
    groups = tuple(
        SchemeGroup(block_type, tuple(names), GGUF_BLOCK_SCHEMES[block_type]) for block_type, names in by_type.items()
    )
    return QuantizationPlan(groups=groups, format=GGUF_FORMAT, source=source)


def checkpoint_plan(quantization_config: Mapping[str, Any], source: str) -> QuantizationPlan:
    """The plan config.json's quantization_config describes (compressed-tensors', or GGUF blocks)."""
    method = quantization_config.get("quant_method")
    if method == GGUF_FORMAT:
        return gguf_blocks_plan(quantization_config, source)
    if method != "compressed-tensors":
        raise QuantizationError(
            f"{source}: quantization_config.quant_method {method!r} is not read here; "
            f"the compressed-tensors format is (llm-compressor writes it), and {GGUF_FORMAT!r} (GGUF blocks)"
        )
    try:
        config = QuantizationConfig.model_validate(dict(quantization_config))
    except ValidationError as error:
        first = error.errors()[0]
        place = ".".join(str(part) for part in first["loc"])
        raise QuantizationError(f"{source}: quantization_config.{place}: {first['msg']}") from None
    groups = []
    for name, group in config.config_groups.items():
        where = f"{source}: quantization_config.config_groups.{name}"
        group_format = str(group.format or config.format)
        if group_format not in FORMATS:
            raise QuantizationError(f"{where}: format {group_format!r} is not read here (reads: {', '.join(FORMATS)})")
        groups.append(
            SchemeGroup(name, tuple(group.targets), linear_scheme(group.weights, group.input_activations, where))
        )
    formats = {str(group.format or config.format) for group in config.config_groups.values()}
    return QuantizationPlan(
        groups=tuple(groups),
        ignore=tuple(config.ignore or ()),
        kv_cache=kv_cache_scheme(config.kv_cache_scheme, f"{source}: quantization_config.kv_cache_scheme"),
        format="+".join(sorted(formats)),
        source=source,
    )


def preset_scheme(token: str, key: str) -> QuantizationScheme:
    """compressed-tensors' scheme for one of model_config.quantization's weight names (see the module docstring)."""
    match = GROUP_SUFFIX.match(token)
    name, group_size = (match["preset"], int(match["group"])) if match else (token, None)
    preset = PRESETS.get(name)
    if preset is None:
        raise QuantizationError(f"{key}: unknown scheme {token!r}; choose from {', '.join([*PRESETS, C8, LM_HEAD])}")
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        if scheme.weights.group_size is None or scheme.weights.block_structure:
            raise QuantizationError(f"{key}: {name} has no groups to size (_g{group_size})")
        scheme.weights.group_size = group_size
    return scheme


def online_scheme(token: str, key: str) -> LinearScheme:
    """Our scheme for one of model_config.quantization's weight names."""
    scheme = preset_scheme(token, key)
    return linear_scheme(scheme.weights, scheme.input_activations, f"{key}: {token}")


MXFP8_KEY = "model_config.custom_params.enable_online_mxfp8_quantization"
GMM_NAMES = ("gmm", "moe", "moegmm", "fused_moe_gmm")  # cann-recipes' names for the routed experts
EXPERTS = r"re:.*\.mlp\.experts\..*"


@dataclass(frozen=True, slots=True)
class QuantizationRequest:
    """What the YAML asks for: model_config.quantization's names, or cann-recipes' online MXFP8 keys."""

    schemes: str = ""
    key: str = "model_config.quantization"
    ignore: tuple[str, ...] = ONLINE_IGNORE


def quantization_request(model_config: Any) -> QuantizationRequest:
    """model_config.quantization, or custom_params.enable_online_mxfp8_quantization (MXFP8 weights and
    activations at load, on online_mxfp8_quant_layers' kinds: "linear" layers and/or "gmm" routed
    experts, skipping online_mxfp8_ignored_layers and their children, as cann-recipes' own code does)."""
    params = model_config.custom_params
    if not params.get("enable_online_mxfp8_quantization", False):
        return QuantizationRequest(model_config.quantization)
    if model_config.quantization:
        raise QuantizationError(f"{MXFP8_KEY} and model_config.quantization both quantize the weights; set one")
    kinds = [kind.lower() for kind in params.get("online_mxfp8_quant_layers", ["linear"])]
    ignored = [rf"re:^{re.escape(name)}(\..*)?$" for name in params.get("online_mxfp8_ignored_layers", [])]
    if "linear" not in kinds:
        ignored.append(r"re:^(?!.*\.mlp\.experts\.).*$")  # everything but the experts
    if not any(kind in GMM_NAMES for kind in kinds):
        ignored.append(EXPERTS)
    return QuantizationRequest("mxfp8", MXFP8_KEY, (*ONLINE_IGNORE, *ignored))


def read_quantization(hf_config: Any, request: QuantizationRequest, source: str) -> QuantizationPlan | None:
    """The run's plan from the checkpoint's config (`hf_config.quantization_config`) and what the
    YAML requests; None when neither quantizes anything."""
    requested, key = request.schemes, request.key
    tokens = [token.strip().lower() for token in requested.split("+") if token.strip()] if requested else []
    weight_tokens = [token for token in tokens if token not in (C8, LM_HEAD)]
    if len(weight_tokens) > 1:
        raise QuantizationError(f"{key}: {requested!r} names two weight schemes ({', '.join(weight_tokens)}); name one")
    if len(tokens) != len(set(tokens)):
        raise QuantizationError(f"{key}: {requested!r} names a scheme twice")
    if LM_HEAD in tokens and not weight_tokens:
        raise QuantizationError(f"{key}: {requested!r}: lm_head goes with a weight scheme (w8a8+lm_head)")
    requested_kv = KVCacheScheme(TOKEN) if C8 in tokens else None
    requested_weights = online_scheme(weight_tokens[0], key) if weight_tokens else None
    checkpoint = getattr(hf_config, "quantization_config", None)
    if checkpoint is not None:
        if not isinstance(checkpoint, Mapping):
            checkpoint = checkpoint.to_dict()
        if checkpoint.get("quant_method") == OWN_MXFP4 and requested_weights is None:
            return None if requested_kv is None else QuantizationPlan((), (), requested_kv, OWN_MXFP4, source)
        if LM_HEAD in tokens:
            raise QuantizationError(
                f"{key}: {requested!r}: lm_head is for quantizing at load; the checkpoint's own ignore list "
                f"decides its LM head ({source})"
            )
        plan = checkpoint_plan(checkpoint, source)
        schemes = {group.scheme for group in plan.groups}
        if requested_weights is not None and schemes != {requested_weights}:
            held = "; ".join(scheme.describe() for scheme in schemes)
            raise QuantizationError(
                f"{key}: {weight_tokens[0]} conflicts with the checkpoint's own scheme ({held}, {source}); "
                "drop the key, or quantize an unquantized checkpoint"
            )
        return QuantizationPlan(plan.groups, plan.ignore, plan.kv_cache or requested_kv, plan.format, plan.source)
    if requested_weights is None and requested_kv is None:
        return None
    groups = () if requested_weights is None else (SchemeGroup(weight_tokens[0], ("Linear",), requested_weights),)
    ignore = tuple(target for target in request.ignore if target != LM_HEAD) if LM_HEAD in tokens else request.ignore
    return QuantizationPlan(groups, ignore, requested_kv, ONLINE, f"{key}: {requested}")
