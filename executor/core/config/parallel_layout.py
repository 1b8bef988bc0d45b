"""Which ranks form which group, from parallel_config's sizes alone: pure functions, so that every
layout (cann-recipes' world 16 with MoE EP 16 included) is checked without launching a process.

Meanings, as in cann-recipes-infer (world W, rank r):
- attention TP groups are runs of attn_tp_size consecutive ranks; attention DP size = W / attn_tp_size,
  and r's DP rank is r // attn_tp_size. Every rank of one attention TP group serves the same requests.
- dense FFN, MoE, embedding, LM-head and o_proj TP groups are runs of their size of consecutive ranks.
- MoE EP size = W / moe_tp_size; an EP group is the ranks with the same MoE TP rank (a stride of moe_tp_size).
- an attention DP group is the ranks with the same attention TP rank (one per DP replica); the DP
  leaders are the one with attention TP rank 0.
- context parallel (cp_size 1 or W, with attn_tp_size 1): the one CP group is the world, which is one
  replica (DP size W / (attn_tp_size x cp_size)); its ranks each take a share of every step's tokens,
  so every model group but the LM head's (which runs on rows gathered first) holds different tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from executor.core.config.sections import ParallelConfig

# Group kinds, by the names CommManager and the step log use.
TP_KINDS = ("attn_tp", "dense_tp", "moe_tp", "embed_tp", "lmhead_tp", "o_proj_tp")
KINDS = (*TP_KINDS, "moe_ep", "cp", "replica", "attn_dp", "dp_leaders", "world")
# Groups of dense layers whose ranks need the same tokens: across DP replicas they gather them first.
TOKEN_SHARING_KINDS = ("dense_tp", "embed_tp", "lmhead_tp")


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    world_size: int = 1
    attn_tp_size: int = 1
    dense_tp_size: int = 1
    moe_tp_size: int = 1
    embed_tp_size: int = 1
    lmhead_tp_size: int = 1
    o_proj_tp_size: int = 1
    cp_size: int = 1

    @classmethod
    def from_config(cls, config: ParallelConfig) -> ParallelLayout:
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})

    @property
    def replica_size(self) -> int:
        """Ranks serving the same requests: an attention TP group, times the context-parallel ranks."""
        return self.attn_tp_size * self.cp_size

    @property
    def attn_dp_size(self) -> int:
        return self.world_size // self.replica_size

    @property
    def moe_ep_size(self) -> int:
        return self.world_size // self.moe_tp_size

    def size_of(self, kind: str) -> int:
        """The size of every group of `kind`."""
        sizes = {
            "moe_ep": self.moe_ep_size,
            "attn_dp": self.attn_dp_size,
            "dp_leaders": self.attn_dp_size,
            "replica": self.replica_size,
        }
        return sizes.get(kind) or (self.world_size if kind == "world" else getattr(self, f"{kind}_size"))

    def size_problems(self) -> list[str]:
        """Sizes that do not tile the world: each must divide world_size."""
        return [
            f"parallel_config.{kind}_size {getattr(self, f'{kind}_size')} does not divide world_size {self.world_size}"
            for kind in TP_KINDS
            if self.world_size % getattr(self, f"{kind}_size")
        ]

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of `kind`, each a list of global ranks in group-rank order (the layout must have
        no size_problems)."""
        assert kind in KINDS, kind
        world = self.world_size
        if kind == "world":
            return [list(range(world))]
        if kind == "moe_ep":
            return strided(world, self.moe_tp_size)
        if kind == "attn_dp":
            return strided(world, self.replica_size)
        if kind == "dp_leaders":
            return strided(world, self.replica_size)[:1]
        if kind == "replica":
            return consecutive(world, self.replica_size)
        return consecutive(world, getattr(self, f"{kind}_size"))

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of `kind` that `rank` belongs to (for dp_leaders: the leaders, whoever asks)."""
        if kind == "dp_leaders":
            return self.groups(kind)[0]
        (group,) = [group for group in self.groups(kind) if rank in group]
        return group

    def dp_rank(self, rank: int) -> int:
        return rank // self.replica_size

    def group_rank(self, kind: str, rank: int) -> int:
        """`rank`'s index within its group of `kind`."""
        return self.group_of(kind, rank).index(rank)

    def spans_replicas(self, kind: str) -> bool:
        """Whether a group of `kind` holds ranks of several data-parallel replicas, which hold
        different tokens: its layers must then exchange tokens (module/parallel_group.py's
        gather_rows) and every replica must step in lock-step."""
        return any(len({self.dp_rank(rank) for rank in group}) > 1 for group in self.groups(kind))

    def holds_different_tokens(self, kind: str) -> bool:
        """Whether the ranks of a group of `kind` hold different tokens in a step, so that its layers
        gather them first: across DP replicas (spans_replicas), and under context parallel every model
        group but the LM head's, whose rows the runner gathers over the CP group before it."""
        if self.cp_size > 1 and kind != "lmhead_tp":
            return self.size_of(kind) > 1
        return self.spans_replicas(kind)

    def lock_step_kinds(self, has_experts: bool) -> list[str]:
        """The model groups that span data-parallel replicas (the MoE ones only for a model with
        experts): when there is any, every replica runs a forward at every step (an idle one when it
        has no work), so that these groups' collectives meet."""
        kinds = [*TOKEN_SHARING_KINDS, *(("moe_tp", "moe_ep") if has_experts else ())]
        return [kind for kind in kinds if self.size_of(kind) > 1 and self.spans_replicas(kind)]


def num_experts_of(hf_config: Any) -> int:
    """Routed experts per MoE layer under any family's key; 0 for a dense model."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if getattr(hf_config, key, None):
            return int(getattr(hf_config, key))
    return 0


def layer_configs(hf_config: Any) -> list[Any]:
    """The configs the model's layers read: each layer's own where transformers' config gives layers
    their own (a heterogeneous config, transformers' per_layer_config, which refuses a global read of a
    per-layer key such as num_attention_heads), else the one config."""
    if getattr(hf_config, "is_heterogeneous", False):
        return list(hf_config.per_layer_config)
    return [hf_config]


def model_fit_problems(layout: ParallelLayout, hf_config: Any) -> list[str]:
    """Sizes that do not split the model: each split dimension must divide evenly (checked before
    any weight loads, so that a bad layout fails in a second with the dimension named)."""
    layers = layer_configs(hf_config)
    splits = [
        *(
            ("attn_tp_size", layout.attn_tp_size, "num_attention_heads", heads)
            for heads in sorted({layer.num_attention_heads for layer in layers})
        ),
        ("embed_tp_size", layout.embed_tp_size, "vocab_size", hf_config.vocab_size),
        ("lmhead_tp_size", layout.lmhead_tp_size, "vocab_size", hf_config.vocab_size),
    ]
    # the dense MLPs' width; a model whose every layer is MoE has its shared expert's instead
    for dense_key in ("intermediate_size", "shared_expert_intermediate_size"):
        if getattr(hf_config, dense_key, None):
            splits.append(("dense_tp_size", layout.dense_tp_size, dense_key, getattr(hf_config, dense_key)))
            break
    if getattr(hf_config, "kv_lora_rank", None) is None:  # MLA's latent cache is not split by heads
        for kv_heads in sorted(
            {getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads for layer in layers}
        ):
            splits.append(("attn_tp_size", layout.attn_tp_size, "num_key_value_heads", kv_heads))
    # linear attention's heads (Gated DeltaNet's key and value heads, KDA's), split as attention's
    for linear_key in ("linear_num_key_heads", "linear_num_value_heads", "linear_num_heads"):
        if getattr(hf_config, linear_key, None):
            splits.append(("attn_tp_size", layout.attn_tp_size, linear_key, getattr(hf_config, linear_key)))
    num_experts = num_experts_of(hf_config)
    if num_experts:
        moe_intermediate = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
        splits += [
            ("MoE EP (world_size / moe_tp_size)", layout.moe_ep_size, "experts", num_experts),
            ("moe_tp_size", layout.moe_tp_size, "moe_intermediate_size", moe_intermediate),
        ]
    problems = [
        f"parallel_config.{key} {size} does not divide the model's {dim} {value}"
        for key, size, dim, value in splits
        if value % size
    ]
    if getattr(hf_config, "tie_word_embeddings", False) and layout.embed_tp_size != layout.lmhead_tp_size:
        problems.append(
            f"parallel_config.embed_tp_size {layout.embed_tp_size} and lmhead_tp_size {layout.lmhead_tp_size} "
            "must be equal: the model ties its LM head to its embedding"
        )
    return problems


def consecutive(world_size: int, size: int) -> list[list[int]]:
    """Runs of `size` consecutive ranks: [0..size), [size..2 size), ..."""
    return [list(range(start, start + size)) for start in range(0, world_size, size)]


def strided(world_size: int, stride: int) -> list[list[int]]:
    """One group per offset in [0, stride): the ranks offset, offset + stride, ..."""
    return [list(range(offset, world_size, stride)) for offset in range(stride)]
