"""Mixture of experts: a sparse block of a pluggable router, routed experts stored stacked for one op
call, and optional shared experts, shared by every MoE family.

Routers map hidden states to (top-k weights, expert ids) and follow their transformers counterpart op
for op, so that ties between equal scores break the same way: TopkRouter is DeepSeek-V3's (sigmoid
scores; a per-expert bias that steers the choice but not the weights; top-k within the best groups),
SoftmaxGroupRouter DeepSeek-V2's (softmax; top-k within the groups of the best single scores, or
over all experts; scaled, not renormalised), SoftmaxTopkRouter Qwen-MoE's (softmax, top-k, optional
renormalisation), SigmoidTopkRouter Hy3's (sigmoid scores and a choice bias as V3's, top-k over all
experts, renormalised, scaled). The experts hold every
expert's weights in two stacked tensors, as transformers does, and run through the backend's
moe_experts;
MoE tensor parallelism (moe_tp) splits each expert's intermediate dim, expert parallelism (moe_ep)
splits the experts, and the partial sums are all-reduced over both groups.

Expert parallelism, inside one attention TP group (every rank of the EP group holds the same
tokens): dispatch is the identity and combine an all-reduce. Each rank runs its own experts on the
tokens routed to them (the weights of the other experts' slots are zero) and the EP all-reduce sums
the experts' outputs.

Across data-parallel replicas (moe_ep or moe_tp spans them, as in cann-recipes' attention DP 16 x
EP 16): the replicas hold different tokens, so dispatch is an all-gather. FusedExperts.gather_tokens
gathers every rank's hidden states over each MoE group that spans replicas (variable counts, padded),
which leaves the same rows on every rank of both groups; the replicated router routes them all, each
rank runs its experts over them as above, the all-reduce combines, and each rank keeps its own rows.
The replicas step in lock-step so that these collectives meet (docs/distributed.md). This moves
every token to every rank (all-gather of [sum T, H], all-reduce of [sum T, H]) where an all-to-all
would move each token to its top-k experts' ranks only; on gloo the all-gather is the simple,
shape-static form, and the NPU API facts this project writes against name no fused dispatch op.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from executor.types_.checkpoint_tensor import LoadedWeight
from executor.types_.errors import WeightLoadError
from executor.types_.quant_scheme import LinearScheme
from module.linear import divide
from module.parallel_group import SINGLE, ParallelGroup
from module.quantized import load_quant_part, load_quant_tensor, quant_param, quant_parameters, set_quant_param
from module.weights import load_shard
from ops.backend import Backend
from ops.quantized_experts import ExpertsMethod


def keep_best_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """scores [T, E] with every expert outside the `topk_group` best of group_scores [T, G] set to
    `fill`: the group limit of DeepSeek's routers, op for op as transformers', so ties between
    groups break the same way."""
    num_groups, num_experts = group_scores.shape[-1], scores.shape[-1]
    group_ids = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, num_groups, num_experts // num_groups).reshape(-1, num_experts)
    return scores.masked_fill(~score_mask.bool(), fill)


def grouped_topk(
    router_logits: torch.Tensor,
    e_score_correction_bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (fp32) -> (weights [T, top_k] fp32, expert ids [T, top_k]).

    Experts are split into `num_groups` groups scored by the sum of their two best biased scores;
    the `topk_group` best groups are kept and `top_k` experts chosen within them by biased score.
    Weights are the unbiased sigmoid scores of the chosen experts, renormalised when
    norm_topk_prob, times routed_scaling_factor.
    """
    scores = router_logits.sigmoid()
    scores_for_choice = scores + e_score_correction_bias
    grouped = scores_for_choice.view(scores.shape[0], num_groups, -1)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    scores_for_choice = keep_best_groups(scores_for_choice, group_scores, topk_group, float("-inf"))
    topk_ids = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    return chosen_weights(scores, topk_ids, norm_topk_prob, routed_scaling_factor), topk_ids


def chosen_weights(
    scores: torch.Tensor, topk_ids: torch.Tensor, norm_topk_prob: bool, routed_scaling_factor: float
) -> torch.Tensor:
    """The unbiased scores [T, E] of the chosen experts [T, top_k], renormalised to sum 1 (plus 1e-20,
    as transformers) when norm_topk_prob, times routed_scaling_factor."""
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor


# One routed expert's projection in a checkpoint: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight,
# and its quantization tensors where a compressed-tensors checkpoint quantizes it (weight_packed loads
# as weight: module/quantized.py's checkpoint_tensor_name).
EXPERT_TENSOR = re.compile(
    r"^(?P<module>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)"
    r"\.(?P<tensor>weight|weight_scale|weight_zero_point|input_scale)$"
)
# A checkpoint tensor's suffix -> the suffix of the stacked parameter it fills (gate_up_proj_scale, ...).
STACKED_SUFFIX = {
    "weight": "",
    "weight_scale": "_scale",
    "weight_zero_point": "_zero_point",
    "input_scale": "_input_scale",
}


class Router(nn.Module):
    """A gate: hidden states [T, H] -> (weights [T, top_k], expert ids [T, top_k]). Every rank holds it whole."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class GroupedRouter(Router):
    """What DeepSeek's gates share: an fp32 weight (as transformers keeps the router in fp32 whatever
    the model's dtype), experts in num_groups groups of which top_k are chosen within the
    topk_group best, weights times routed_scaling_factor."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_group: int,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        if num_experts % num_groups or not 1 <= topk_group <= num_groups or top_k > num_experts:
            raise ValueError(
                f"router: {num_experts} experts in n_group {num_groups} groups, topk_group {topk_group}, "
                f"top_k {top_k} do not fit"
            )
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.top_k = top_k
        self.num_groups = num_groups
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor


class TopkRouter(GroupedRouter):
    """DeepSeek-V3's gate: fp32 logits, then grouped_topk."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__(hidden_size, num_experts, top_k, num_groups, topk_group, routed_scaling_factor)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
        self.norm_topk_prob = norm_topk_prob

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = F.linear(hidden_states.float(), self.weight)
        return grouped_topk(
            router_logits,
            self.e_score_correction_bias,
            self.top_k,
            self.num_groups,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )


class SigmoidTopkRouter(Router):
    """Hy3's gate, op for op as transformers' HYV3TopKRouter (MiniMax-M2's, with a scale): fp32
    logits and sigmoid scores, top-k over all experts by score plus a per-expert bias that steers the
    choice but not the weights, the chosen scores renormalised and times routed_scaling_factor. The
    weight and bias are fp32 whatever the model's dtype, as transformers keeps them."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routed_scaling_factor: float) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"router: top_k {top_k} must be in [1, {num_experts} experts]")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
        self.top_k = top_k
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(F.linear(hidden_states.float(), self.weight))
        topk_ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        return chosen_weights(scores, topk_ids, True, self.routed_scaling_factor), topk_ids


class SoftmaxGroupRouter(GroupedRouter):
    """DeepSeek-V2's gate, op for op as transformers' DeepseekV2TopkRouter: softmax over fp32 logits,
    then top-k within the `topk_group` groups of the highest single score (topk_method
    group_limited_greedy; the other groups' scores set to 0, not -inf, as transformers does) or over
    all experts (greedy: one group). The weights are the chosen scores, not renormalised, times
    routed_scaling_factor."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(hidden_states.float(), self.weight).softmax(dim=-1, dtype=torch.float32)
        group_scores = scores.view(scores.shape[0], self.num_groups, -1).max(dim=-1).values
        scores = keep_best_groups(scores, group_scores, self.topk_group, 0.0)
        topk_weights, topk_ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return topk_weights * self.routed_scaling_factor, topk_ids


class SoftmaxTopkRouter(Router):
    """Qwen-MoE's gate, op for op as transformers' Qwen3MoeTopKRouter: logits in the model's dtype,
    softmax in fp32 over all experts, top-k, renormalised to sum 1 when norm_topk_prob, weights cast
    back to the logits' dtype."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"router: top_k {top_k} must be in [1, {num_experts} experts]")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits = F.linear(hidden_states, self.weight)
        probabilities = F.softmax(router_logits, dim=-1, dtype=torch.float)
        topk_weights, topk_ids = torch.topk(probabilities, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights.to(router_logits.dtype), topk_ids


class FusedExperts(nn.Module):
    """This rank's E_local = E / ep.size SwiGLU experts (global ids first_expert ...): gate_up_proj
    [E_local, 2I, H] (gate rows, then up rows) and down_proj [E_local, H, I], with I this rank's share
    of moe_intermediate_size. Checkpoints store one tensor per expert and projection;
    load_expert_weight puts each of this rank's in its place and skips the others'.

    Under a quantized scheme (set_scheme) each projection holds what a linear layer of that scheme
    holds (module/quantized.py), stacked over the experts: values in gate_up_proj / down_proj, and
    gate_up_proj_scale, _zero_point, _input_scale beside them; gate and up are cut along their rows as
    a column layer, down along its input features as a row layer, so moe_tp cuts I consistently in
    values, group scales and zero points. The backend's ExpertsMethod (ops/quantized_experts.py) runs them."""

    PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
    NEEDED_OPS: tuple[str, ...] = ("moe_experts",)

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: ParallelGroup = SINGLE,
        ep: ParallelGroup = SINGLE,
        *,
        backend: Backend,
    ) -> None:
        super().__init__()
        backend.require(self.NEEDED_OPS, "routed experts")
        self.ops = backend
        self.num_experts = num_experts
        self.tp, self.ep = tp, ep
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        self.num_local_experts = divide(num_experts, ep.size)
        self.first_expert = ep.rank * self.num_local_experts
        self.intermediate_per_rank = divide(intermediate_size, tp.size)
        size, local = self.intermediate_per_rank, self.num_local_experts
        self.hidden_size = hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * size, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, size), requires_grad=False)
        self.experts_method: ExpertsMethod | None = None  # set by set_scheme

    def checkpoint_modules(self, name: str) -> list[tuple[str, str]]:
        """(checkpoint module, its class) for every expert projection of this layer (at `name`), as a
        quantization plan names them: per-expert Linear modules in the checkpoint's layout."""
        return [(f"{name}.{e}.{p}", "Linear") for e in range(self.num_experts) for p in self.PROJECTIONS]

    def set_scheme(
        self, scheme: LinearScheme, method: ExpertsMethod, compute_dtype: torch.dtype, at_load: bool
    ) -> None:
        """Run these experts under `scheme` by `method`: their parameters become the checkpoint's
        quantized tensors stacked per expert, or (`at_load`) the float weights stay and are rounded
        after loading. A shard that cuts a group of the scheme is a WeightLoadError."""
        self.scheme = scheme
        self.experts_method = method
        self.compute_dtype = compute_dtype
        self.quantize_at_load = at_load
        size = self.intermediate_per_rank
        shapes = (("gate_up_proj", 2 * size, self.hidden_size, 0), ("down_proj", self.hidden_size, size, 1))
        for projection, rows, cols, tp_dim in shapes:
            params = quant_parameters(scheme, rows, cols, tp_dim)  # checks the shard holds whole groups
            if at_load:
                continue
            for tensor, (param, spec) in params.items():
                stacked = torch.zeros(self.num_local_experts, *param.shape, dtype=param.dtype)
                stacked_param = nn.Parameter(stacked, requires_grad=False)
                set_quant_param(stacked_param, spec)
                setattr(self, f"{projection}{STACKED_SUFFIX[tensor]}", stacked_param)

    def local_index(self, expert_id: int) -> int | None:
        """Where global expert `expert_id` sits in this rank's parameters; None when another rank holds it."""
        if not 0 <= expert_id < self.num_experts:
            raise WeightLoadError(f"expert {expert_id} out of range: the layer has {self.num_experts} experts")
        local = expert_id - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def load_expert_weight(
        self, loaded_weight: LoadedWeight, expert_id: int, projection: str, tensor: str = "weight"
    ) -> str | None:
        """Copy this rank's slice of one expert's gate_proj/up_proj [I, H] or down_proj [H, I] (or
        of its scale, zero point or input scale, `tensor`); returns the name of the parameter it went
        into, None for another EP rank's expert."""
        local = self.local_index(expert_id)
        if local is None:
            return None
        stacked = "down_proj" if projection == "down_proj" else "gate_up_proj"
        name = f"{stacked}{STACKED_SUFFIX[tensor]}"
        param = getattr(self, name, None)
        if param is None:
            raise WeightLoadError(f"{tensor} of expert {expert_id}'s {projection}, which the plan leaves unquantized")
        spec = quant_param(param)
        if stacked == "down_proj":
            if spec is None:
                load_shard(param.data[local], loaded_weight, 1, self.tp_rank, self.tp_size)
            else:
                load_quant_tensor(param.data[local], loaded_weight, spec, self.tp_rank, self.tp_size)
            return name
        size = self.intermediate_per_rank
        offset = self.PROJECTIONS.index(projection) * size
        if spec is None:
            load_shard(param.data[local].narrow(0, offset, size), loaded_weight, 0, self.tp_rank, self.tp_size)
        else:
            load_quant_part(param.data[local], loaded_weight, spec, offset, size, self.tp_rank, self.tp_size)
        return name

    def checkpoint_tensors_needed(self, param_name: str) -> int:
        """How many checkpoint tensors fill `param_name`: gate and up of each local expert, or each down."""
        return self.num_local_experts * (2 if param_name.startswith("gate_up_proj") else 1)

    def gather_tokens(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """The tokens this layer runs on, and where this rank's own lie among them: its own where
        the MoE groups lie inside one replica; where moe_tp or moe_ep spans replicas, every rank's
        gathered over each such group (the same rows on every rank of both groups)."""
        own = slice(0, hidden_states.shape[0])
        for group in (self.tp, self.ep):
            if group.spans_replicas:
                hidden_states, mine = group.gather_rows(hidden_states)
                own = slice(mine.start + own.start, mine.start + own.stop)
        return hidden_states, own

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H] the same on every rank of moe_tp and moe_ep (gather_tokens' output)
        -> every token's routed experts' weighted sum [T, H]."""
        if self.ep.size > 1:  # slots routed to another rank's experts weigh nothing here
            local_ids = topk_ids - self.first_expert
            owned = (local_ids >= 0) & (local_ids < self.num_local_experts)
            topk_weights = topk_weights.masked_fill(~owned, 0)
            topk_ids = local_ids.clamp(0, self.num_local_experts - 1)
        output = self.run_experts(hidden_states, topk_weights, topk_ids)
        return self.ep.all_reduce(self.tp.all_reduce(output))

    def run_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sum of each token's weighted experts, by the scheme's method if quantized."""
        if self.experts_method is not None:
            return self.experts_method.apply(self, hidden_states, topk_weights, topk_ids)
        return self.run_dense_experts(hidden_states, topk_weights, topk_ids)

    def run_dense_experts(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """The experts over float weights; subclasses with other experts (biases, another activation)
        override only this."""
        return self.ops.moe_experts(hidden_states, topk_weights, topk_ids, self.gate_up_proj, self.down_proj)


def load_expert_tensor(
    model: nn.Module, checkpoint_name: str, tensor: torch.Tensor
) -> tuple[str, tuple[int, str]] | None:
    """Copy one routed expert's projection (EXPERT_TENSOR) into its layer's FusedExperts in `model`;
    -> (parameter name, (expert, projection)), or None when `checkpoint_name` is no expert's tensor."""
    match = EXPERT_TENSOR.match(checkpoint_name)
    if match is None:
        return None
    try:
        experts = model.get_submodule(match["module"])
    except AttributeError:
        experts = None
    if not isinstance(experts, FusedExperts):
        raise WeightLoadError(f"{type(model).__name__} has no routed experts at {match['module']!r}")
    expert_id, projection = int(match["expert"]), match["projection"]
    param_name = experts.load_expert_weight(tensor, expert_id, projection, match["tensor"])
    if param_name is None:  # another EP rank's expert
        return f"{match['module']}.skipped", (expert_id, projection)
    return f"{match['module']}.{param_name}", (expert_id, projection)


class SparseMoeBlock(nn.Module):
    """The MoE feed-forward block: each token through the experts its router chose, weighted, plus the
    shared experts (every token through them) where the model has them."""

    def __init__(self, gate: Router, experts: FusedExperts, shared_experts: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens, own = self.experts.gather_tokens(hidden_states)
        output = self.experts(tokens, *self.gate(tokens))[own]
        shared = self.shared_output(hidden_states)
        return output if shared is None else output + shared

    def shared_output(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """What every token gets from the shared experts (None without them); a family that gates
        them (Qwen3.5's sigmoid gate) overrides it."""
        return None if self.shared_experts is None else self.shared_experts(hidden_states)
