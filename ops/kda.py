"""Kimi Delta Attention (KDA): the torch reference.

KDA is a gated delta rule whose decay is per channel: each head keeps a state S [K, V] that, for
each token, decays row by row (exp(g) [K]), is corrected toward v along k (the delta rule with
strength beta), and is read by q:

    S <- diag(exp(g_t)) S;   u_t = beta_t (v_t - S^T k_t);   S <- S + k_t u_t^T;   o_t = S^T q_t

with q and k L2-normalized (eps inside the root, as FLA and transformers do) and q scaled by
K^-1/2. Kimi-Linear and Ling 3 (transformers' kimi_linear and bailing_hybrid) both use it; they
differ only in how they compute g. A prompt is computed chunk by chunk (kda_chunked: within a chunk
the delta rule's dependencies form one unit lower-triangular system), a decode token by the
recurrence (kda_step), both from a carried state, all in fp32.

The ops a layer calls (Backend fields) read each row's state from its slot of the layer's state
tensor (RecurrentStateTables: the slot, and whether the row continues a state or starts from zeros)
and write the state after the row's last token back: chunk_kda for steps whose rows hold several
tokens (one call per request, so a prompt's chunk continues where the previous one stopped; a
verify step keeps the state after each of its positions, kda_positions), recurrent_kda for
decode-shaped steps (shapes that depend only on the number of rows). The short
convolution in front of KDA is ops/recurrent_ref.py's, shared with Gated DeltaNet.
"""

from __future__ import annotations

import torch

from ops.attention.metadata import RecurrentStateTables
from ops.recurrent_ref import scan_rows, step_rows

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


def kda_chunked(
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
        # [H, t, j, K]: exp(G_t - G_j) k_j where j <= t, else 0; formed once, in place (the largest
        # tensor of a chunk), and contracted with k_t and q_t in one batched product
        decayed_keys = cumulative.unsqueeze(2) - cumulative.unsqueeze(1)
        decayed_keys.masked_fill_(~causal[..., None], float("-inf")).exp_().mul_(k.unsqueeze(1))
        key_key, query_key = (decayed_keys @ torch.stack((k, q), dim=-1)).unbind(-1)  # [H, t, j] each
        system = torch.eye(length, dtype=key_key.dtype, device=query.device) + (b.unsqueeze(-1) * key_key).tril(-1)
        decayed_key = k * cumulative.exp()
        rhs = b.unsqueeze(-1) * (v - decayed_key @ state)
        update = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        outputs.append((q * cumulative.exp()) @ state + query_key @ update)
        last = cumulative[:, -1:, :]  # [H, 1, K]
        carried_key = k * (last - cumulative).exp()
        state = state * last.transpose(1, 2).exp() + carried_key.transpose(1, 2) @ update
    return torch.cat(outputs, dim=1).transpose(0, 1), state


def kda_positions(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One short sequence token by token (the shapes of kda_chunked), keeping every state:
    (output [L, H, V], the state after each position [L, H, K, V]), for a verify step whose accepted
    prefix is known only after it."""
    outputs, states = [], []
    for t in range(query.shape[0]):
        output, state = kda_step(query[t], key[t], value[t], gate[t], beta[t], state)
        outputs.append(output)
        states.append(state)
    return torch.stack(outputs), torch.stack(states)


def chunk_kda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate: torch.Tensor,
    beta: torch.Tensor,
    state_cache: torch.Tensor,
    tables: RecurrentStateTables,
) -> torch.Tensor:
    """Packed rows of several tokens each (query, key, gate [T, H, K], value [T, H, V], beta [T, H]),
    each request continuing its state from state_cache [slots, H, K, V] (fp32; zeros where it starts
    fresh) and leaving its final state in its final slot, or, in a row that fits its ring of slots (a
    verify step), the state after each position in that position's slot -> output [T, H, V] in
    value's dtype."""
    query, key = prepare_query_key(query, key)
    inputs = (query, key, value.float(), gate.float(), beta.float())
    return scan_rows(state_cache, tables, inputs, kda_chunked, kda_positions).to(value.dtype)


def recurrent_kda(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gate: torch.Tensor,
    beta: torch.Tensor,
    state_cache: torch.Tensor,
    tables: RecurrentStateTables,
) -> torch.Tensor:
    """One token per row (query, key, gate [rows, H, K], value [rows, H, V], beta [rows, H];
    tables.tokens_per_row per row in a verify graph), the state read from each row's slot and written
    to its final slot (each token's), with no host read (graph buckets; padded rows use the null
    slot) -> output [rows, H, V] in value's dtype."""
    query, key = prepare_query_key(query, key)
    inputs = (query, key, value.float(), gate.float(), beta.float())
    return step_rows(state_cache, tables, inputs, kda_step).to(value.dtype)
