"""Kimi Delta Attention (KDA) and its short causal convolution: the torch reference.

KDA is a gated delta rule whose decay is per channel: each head keeps a state S [K, V] that, for
each token, decays row by row (exp(g) [K]), is corrected toward v along k (the delta rule with
strength beta), and is read by q:

    S <- diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with q and k L2-normalized (eps inside the root, as FLA and transformers do) and q scaled by
K^-1/2. Kimi-Linear and Ling 3 (transformers' kimi_linear and bailing_hybrid) both use it; they
differ only in how they compute g. A prompt is computed chunk by chunk (chunk_kda: within a chunk
the delta rule's dependencies form one unit lower-triangular system), a decode token by the
recurrence (kda_step), both from a carried state, all in fp32.

The q, k, v inputs first go through a depthwise causal convolution over the last W tokens with
SiLU (causal_conv): the W - 1 inputs before a step are the request's conv state, carried like S.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from executor.types_.model_inputs import ForwardMetaData
from ops.attention_metadata import NpuAttentionMetadata

CHUNK_SIZE = 64
L2_NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: FLA's form (eps inside the root, not a floor)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_query_key(query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q and k, L2-normalized per head, q scaled by K^-1/2: what both forms below take."""
    query, key = l2_normalize(query.float()), l2_normalize(key.float())
    return query * query.shape[-1] ** -0.5, key


def kda_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, all fp32. query, key, gate (log decay) [..., H, K]; value [..., H, V];
    beta [..., H]; state [..., H, K, V] -> (output [..., H, V], the new state)."""
    state = state * gate.exp().unsqueeze(-1)
    memory = (state * key.unsqueeze(-1)).sum(dim=-2)
    update = (value - memory) * beta.unsqueeze(-1)
    state = state + key.unsqueeze(-1) * update.unsqueeze(-2)
    return (state * query.unsqueeze(-1)).sum(dim=-2), state


def chunk_kda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, all fp32: query, key, gate [T, H, K]; value [T, H, V]; beta [T, H]; state
    [H, K, V] (the state before the first token) -> (output [T, H, V], the state after the last).

    Within a chunk, with G the cumulative log decay from the chunk's start (G_t includes g_t) and
    S0 the state entering it, the updates u solve (I + A) u = beta (v - (k exp(G)) S0), where
    A[t, j] = beta_t sum_c k_t[c] k_j[c] exp(G_t[c] - G_j[c]) for j < t; then
    o_t = (q_t exp(G_t)) S0 + sum_{j<=t} (q_t . k_j exp(G_t - G_j)) u_j and the state leaving is
    exp(G_last) S0 + sum_j (k_j exp(G_last - G_j)) u_j^T. Decay differences are formed before
    exponentiating, so no exp(-G) can overflow."""
    outputs = []
    for start in range(0, query.shape[0], chunk_size):
        end = min(start + chunk_size, query.shape[0])
        q, k, v, g, b = (x[start:end].transpose(0, 1) for x in (query, key, value, gate, beta))  # heads first
        cumulative = g.cumsum(dim=1)  # [H, C, K]
        length = end - start
        causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
        decay = (cumulative.unsqueeze(2) - cumulative.unsqueeze(1)).masked_fill(~causal[..., None], float("-inf"))
        decay = decay.exp()  # [H, t, j, K]: exp(G_t - G_j) where j <= t, else 0
        key_key = torch.einsum("htc,hjc,htjc->htj", k, k, decay)
        system = torch.eye(length, device=query.device) + (b.unsqueeze(-1) * key_key).tril(diagonal=-1)
        decayed_key = k * cumulative.exp()
        rhs = b.unsqueeze(-1) * (v - decayed_key @ state)
        update = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        query_key = torch.einsum("htc,hjc,htjc->htj", q, k, decay)
        outputs.append((q * cumulative.exp()) @ state + query_key @ update)
        last = cumulative[:, -1:, :]  # [H, 1, K]
        carried_key = k * (last - cumulative).exp()
        state = state * last.transpose(1, 2).exp() + carried_key.transpose(1, 2) @ update
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x [T, C], depthwise weight [C, W], conv_state [C, W - 1] (the inputs before x,
    channels first as transformers keeps them) -> (SiLU of the causal convolution [T, C] in x's
    dtype, the new conv state: the last W - 1 inputs). Computed in the weight's dtype, as
    transformers does."""
    width = weight.shape[1]
    full = torch.cat((conv_state.T.to(weight.dtype), x.to(weight.dtype)), dim=0)  # [W - 1 + T, C]
    windows = full.unfold(0, width, 1)  # [T, C, W]
    output = F.silu((windows * weight).sum(dim=-1))
    return output.to(x.dtype), full[full.shape[0] - (width - 1) :].T


def step_lengths(forward_metadata: ForwardMetaData) -> tuple[list[int], list[int]]:
    """(cumulative query ends, KV lengths) per request of a step that is not decode-shaped, from the
    torch builder's lists or the NPU's (host lists in eager mode, tensors in graph modes)."""
    if isinstance(forward_metadata, NpuAttentionMetadata):
        lengths = (forward_metadata.actual_seq_lengths_q, forward_metadata.actual_seq_lengths_kv)
        return tuple(torch.as_tensor(values).tolist() for values in lengths)
    return forward_metadata.query_ends_list, forward_metadata.seq_lens_list


def decode_fresh(forward_metadata: ForwardMetaData) -> torch.Tensor:
    """[rows] bool of a decode-shaped step: the requests with no token computed before it (a
    one-token prompt; padded rows too), read from the lengths tensor without a host read."""
    if isinstance(forward_metadata, NpuAttentionMetadata):
        return torch.as_tensor(forward_metadata.actual_seq_lengths_kv) <= 1
    return forward_metadata.seq_lens <= 1


def request_segments(forward_metadata: ForwardMetaData) -> list[tuple[int, int, bool]]:
    """(first row, end row, starts fresh) per request of a step that is not decode-shaped: a request
    starts fresh (from zero states) when no token of it was computed before this step."""
    query_ends, seq_lens = step_lengths(forward_metadata)
    starts = [0, *query_ends[:-1]]
    return [(start, end, seq_len == end - start) for start, end, seq_len in zip(starts, query_ends, seq_lens)]


def short_convolution(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_states: torch.Tensor,
    state_slots: torch.Tensor,
    forward_metadata: ForwardMetaData,
) -> torch.Tensor:
    """A step's packed rows x [T, C] through causal_conv, each request from the conv state in its
    slot (state_slots [requests]) of conv_states [slots, C, W - 1], written back after. Decode-shaped
    steps run as one batch with no host read (padded rows use the null slot)."""
    if forward_metadata.is_decode_shaped:
        fresh = decode_fresh(forward_metadata)[:, None, None]
        states = torch.where(fresh, 0.0, conv_states[state_slots].to(weight.dtype))
        full = torch.cat((states, x.to(weight.dtype).unsqueeze(-1)), dim=-1)  # [B, C, W]
        conv_states[state_slots] = full[..., 1:].to(conv_states.dtype)
        return F.silu((full * weight).sum(dim=-1)).to(x.dtype)
    outputs = []
    for (start, end, fresh), slot in zip(request_segments(forward_metadata), state_slots.tolist()):
        state = torch.zeros_like(conv_states[slot]) if fresh else conv_states[slot]
        output, conv_states[slot] = causal_conv(x[start:end], weight, state)
        outputs.append(output)
    return torch.cat(outputs)


def kda_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate: torch.Tensor,
    beta: torch.Tensor,
    recurrent_states: torch.Tensor,
    state_slots: torch.Tensor,
    forward_metadata: ForwardMetaData,
) -> torch.Tensor:
    """KDA over a step's packed rows: query, key, gate [T, H, K], value [T, H, V], beta [T, H];
    each request from the state in its slot of recurrent_states [slots, H, K, V] (fp32), written
    back after -> [T, H, V] in value's dtype. Prompts chunk_kda, decode-shaped steps kda_step as
    one batch with no host read."""
    dtype = value.dtype
    query, key = prepare_query_key(query, key)
    value, gate, beta = value.float(), gate.float(), beta.float()
    if forward_metadata.is_decode_shaped:
        fresh = decode_fresh(forward_metadata)[:, None, None, None]
        states = torch.where(fresh, 0.0, recurrent_states[state_slots])
        output, recurrent_states[state_slots] = kda_step(query, key, value, gate, beta, states)
        return output.to(dtype)
    outputs = []
    for (start, end, fresh), slot in zip(request_segments(forward_metadata), state_slots.tolist()):
        state = torch.zeros_like(recurrent_states[slot]) if fresh else recurrent_states[slot]
        rows = slice(start, end)
        output, recurrent_states[slot] = chunk_kda(query[rows], key[rows], value[rows], gate[rows], beta[rows], state)
        outputs.append(output)
    return torch.cat(outputs).to(dtype)
