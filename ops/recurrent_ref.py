"""Torch reference of the linear-attention ops: the gated delta rule (Gated DeltaNet) and the causal
depthwise short convolution in front of it, each carrying a per-request state.

Two levels. The math on one sequence or one token per row (`gated_delta_rule_chunked`,
`gated_delta_rule_step`, `conv1d_with_state`, `conv1d_step`), tested against the naive per-token
formula and against transformers' torch fallbacks. Then the ops a layer calls (Backend fields), which
read each row's state from its slot of the layer's state tensor (RecurrentStateTables: the slot, and
whether the row continues a state or starts from zeros), run the math, and write the state after the
row's last token back to the slot:

- `causal_conv1d_fn` / `chunk_gated_delta_rule`: a step whose rows hold several tokens (prefill, a
  prompt chunk, a verify step): one call per request over the packed TND rows (the query ends as a
  host list), so a chunk continues where the previous chunk of its prompt stopped; a row that fits
  its request's ring of slots (a verify step's k + 1 tokens) keeps the state after each position,
  token by token, so that the next step finds the accepted prefix's state;
- `causal_conv1d_update` / `recurrent_gated_delta_rule`: a decode-shaped step, one token per row,
  with shapes that depend only on the number of rows (graph buckets; padded rows read and write the
  null slot 0 and start from zeros); or a verify step in a graph, whose rows hold 1 + k tokens each
  (RecurrentStateTables.tokens_per_row): token by token, each token's state to its slot
  (`step_rows`).

The delta rule, per value head h and token t, with S [Dk, Dv] the state, q and k L2-normalised and
q scaled by Dk^-0.5:  S = exp(g_t) S;  S = S + k_t (beta_t (v_t - k_t^T S));  o_t = q_t^T S.
Computed in fp32, as transformers and the FLA kernels do; the recurrent state is kept in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ops.attention.metadata import RecurrentStateTables

DEFAULT_CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (FLA's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(
    query: torch.Tensor, key: torch.Tensor, num_v_heads: int, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q and k with each key head repeated over its value heads, normalised, q scaled."""
    repeats = num_v_heads // key.shape[-2]
    query, key = query.float(), key.float()
    if repeats > 1:
        query = query.repeat_interleave(repeats, dim=-2)
        key = key.repeat_interleave(repeats, dim=-2)
    if use_qk_l2norm:
        query, key = l2norm(query), l2norm(key)
    return query * query.shape[-1] ** -0.5, key


def gated_delta_rule_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [L, Hk, Dk], v [L, Hv, Dv], g (log decay) and beta [L, Hv], state
    [Hv, Dk, Dv] or None (zeros) -> (output [L, Hv, Dv] in v's dtype, final state fp32).

    Within a chunk the updates are condensed with the UT transform (a unit lower-triangular solve),
    across chunks the state is carried: the chunked form of the delta rule, as in transformers'
    torch_chunk_gated_delta_rule and FLA's chunk kernel.
    """
    length, num_v_heads, v_dim = value.shape
    query, key = _prepare_qk(query, key, num_v_heads, use_qk_l2norm)
    # heads first: [H, L, D]
    query, key = query.transpose(0, 1), key.transpose(0, 1)
    value_f, g_f, beta_f = value.float().transpose(0, 1), g.float().transpose(0, 1), beta.float().transpose(0, 1)
    pad = (-length) % chunk_size
    query, key, value_f = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value_f))
    g_f, beta_f = F.pad(g_f, (0, pad)), F.pad(beta_f, (0, pad))
    num_chunks = (length + pad) // chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(num_v_heads, num_chunks, chunk_size, *x.shape[2:])

    k_beta = chunks(key * beta_f.unsqueeze(-1))
    v_beta = chunks(value_f * beta_f.unsqueeze(-1))
    query, key = chunks(query), chunks(key)
    cum_g = chunks(g_f).cumsum(dim=-1)  # [H, N, C]: log decay from the chunk's start to each position
    above = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=value.device).triu(1)
    decay = (cum_g.unsqueeze(-1) - cum_g.unsqueeze(-2)).masked_fill(above, float("-inf")).exp()  # [H, N, C, C]
    ut_system = (k_beta @ key.transpose(-1, -2)) * decay  # its strict lower triangle; the solve takes 1 on the diagonal
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    decayed_k_beta = k_beta * cum_g.exp().unsqueeze(-1)
    k_cumdecay = torch.linalg.solve_triangular(ut_system, decayed_k_beta, upper=False, unitriangular=True)
    intra = (query @ key.transpose(-1, -2)) * decay
    query_decayed = query * cum_g.exp().unsqueeze(-1)
    key_decayed = key * (cum_g[..., -1:] - cum_g).exp().unsqueeze(-1)
    chunk_decay = cum_g[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    state = (
        torch.zeros(num_v_heads, key.shape[-1], v_dim, dtype=torch.float32, device=value.device)
        if initial_state is None
        else initial_state.float()
    )
    output = torch.empty_like(new_values)
    for index in range(num_chunks):
        v_new = new_values[:, index] - k_cumdecay[:, index] @ state
        output[:, index] = query_decayed[:, index] @ state + intra[:, index] @ v_new
        state = state * chunk_decay[:, index] + key_decayed[:, index].transpose(-1, -2) @ v_new
    output = output.reshape(num_v_heads, -1, v_dim)[:, :length]
    return output.transpose(0, 1).to(value.dtype), state


def gated_delta_rule_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g and beta [B, Hv], state [B, Hv, Dk, Dv]
    -> (output [B, Hv, Dv] in v's dtype, new state fp32)."""
    query, key = _prepare_qk(query, key, value.shape[-2], use_qk_l2norm)
    state = state.float() * g.float().exp()[..., None, None]
    predicted = (state * key.unsqueeze(-1)).sum(dim=-2)  # what the state recalls for k: [B, Hv, Dv]
    delta = (value.float() - predicted) * beta.float().unsqueeze(-1)
    state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
    output = (state * query.unsqueeze(-1)).sum(dim=-2)
    return output.to(value.dtype), state


def gated_delta_rule_positions(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One short sequence token by token, keeping every state: (output [L, Hv, Dv], the state after
    each position [L, Hv, Dk, Dv] fp32), for a verify step whose accepted prefix is known only after."""
    length, num_v_heads, v_dim = value.shape
    state = (
        torch.zeros(1, num_v_heads, query.shape[-1], v_dim, dtype=torch.float32, device=value.device)
        if initial_state is None
        else initial_state.float().unsqueeze(0)
    )
    outputs, states = [], []
    for t in range(length):
        rows = slice(t, t + 1)
        output, state = gated_delta_rule_step(
            query[rows], key[rows], value[rows], g[rows], beta[rows], state, use_qk_l2norm
        )
        outputs.append(output)
        states.append(state)
    return torch.cat(outputs), torch.cat(states)


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    raise ValueError(f"causal conv1d: activation {activation!r} is not one of silu / swish / None")


def conv1d_with_state(
    x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through a causal depthwise conv: x [L, C], weight [C, K], state [K - 1, C] (the
    last K - 1 inputs before x; None: zeros) -> (output [L, C], the last K - 1 inputs after x)."""
    width = weight.shape[-1]
    if initial_state is None:
        initial_state = x.new_zeros(width - 1, x.shape[-1])
    inputs = torch.cat([initial_state.to(x.dtype), x], dim=0)  # [L + K - 1, C]
    output = F.conv1d(inputs.t().unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), groups=weight.shape[0])
    return _activate(output[0].t(), activation).to(x.dtype), inputs[-(width - 1) :]


def conv1d_position_states(x: torch.Tensor, initial_state: torch.Tensor | None, width: int) -> torch.Tensor:
    """The conv state after each position of x [L, C] from `initial_state` [K - 1, C] (None: zeros):
    [L, K - 1, C], the last K - 1 inputs up to and including that position."""
    if initial_state is None:
        initial_state = x.new_zeros(width - 1, x.shape[-1])
    inputs = torch.cat([initial_state.to(x.dtype), x], dim=0)
    return torch.stack([inputs[t + 1 : t + width] for t in range(x.shape[0])])


def conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: str | None = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [B, C], weight [C, K], state [B, K - 1, C] -> (output [B, C], new state)."""
    window = torch.cat([state.to(x.dtype), x.unsqueeze(1)], dim=1)  # [B, K, C]
    output = (window.to(weight.dtype) * weight.t().unsqueeze(0)).sum(dim=1)
    return _activate(output, activation).to(x.dtype), window[:, 1:]


def row_states(cache: torch.Tensor, tables: RecurrentStateTables) -> torch.Tensor:
    """Each row's state from its slot, or zeros where it starts fresh (a slot never written may hold
    anything, NaN included: `where`, not a product, keeps it out)."""
    states = cache.index_select(0, tables.state_slots)
    fresh = ~tables.has_initial_state.view(-1, *[1] * (states.dim() - 1))
    return torch.where(fresh, torch.zeros((), dtype=states.dtype, device=states.device), states)


def _row_bounds(tables: RecurrentStateTables) -> list[tuple[int, int]]:
    assert tables.query_ends_list is not None, "a multi-token step carries its query ends as a host list"
    ends = tables.query_ends_list
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _position_slots(tables: RecurrentStateTables, num_rows: int) -> list[list[int] | None]:
    """Per row of a multi-token step: the slots of the state after each position, or None (final only)."""
    return tables.position_state_slots if tables.position_state_slots is not None else [None] * num_rows


def _write_states(
    cache: torch.Tensor,
    tables: RecurrentStateTables,
    finals: list[torch.Tensor | None],
    kept: list[tuple[list[int], torch.Tensor]],
) -> None:
    """Each row's final state to its final slot, or (kept) every position's state to its slot."""
    final_rows = [row for row, final in enumerate(finals) if final is not None]
    final_index = tables.write_slots[torch.tensor(final_rows, dtype=torch.int64, device=cache.device)]
    kept_slots = [slot for position_slots, _ in kept for slot in position_slots]
    index = torch.cat([final_index, torch.tensor(kept_slots, dtype=torch.int64, device=cache.device)])
    finals_written = [final for final in finals if final is not None]
    states = finals_written + [state for _, states in kept for state in states.unbind(0)]
    cache.index_copy_(0, index, torch.stack(states).to(cache.dtype))


def scan_rows(
    state_cache: torch.Tensor,
    tables: RecurrentStateTables,
    inputs: tuple[torch.Tensor, ...],
    chunked: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    positions: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The multi-token step of a recurrent op: each request's rows of the packed `inputs` ([T, ...]
    each), from its initial state, through `chunked` (-> output, final state, written to its final
    slot) or, in a row that fits its ring of slots (a verify step), `positions` (-> output, the state
    after each position, written to that position's slot) -> the outputs packed again."""
    initial = row_states(state_cache, tables)
    bounds = _row_bounds(tables)
    outputs: list[torch.Tensor] = []
    finals: list[torch.Tensor | None] = []
    kept: list[tuple[list[int], torch.Tensor]] = []
    for row, ((start, end), position_slots) in enumerate(
        zip(bounds, _position_slots(tables, len(bounds)), strict=True)
    ):
        args = (*(tensor[start:end] for tensor in inputs), initial[row])
        if position_slots is None:
            output, final = chunked(*args)
            finals.append(final)
        else:
            output, states = positions(*args)
            finals.append(None)
            kept.append((position_slots, states))
        outputs.append(output)
    _write_states(state_cache, tables, finals, kept)
    return torch.cat(outputs)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_cache: torch.Tensor,
    tables: RecurrentStateTables,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Packed rows x [T, C] of several tokens each through the conv, each request continuing its conv
    state from conv_cache [slots, K - 1, C] (or zeros) and leaving its last K - 1 inputs in its final
    slot (after each position, in a row that fits its ring)."""
    initial = row_states(conv_cache, tables)
    bounds = _row_bounds(tables)
    outputs: list[torch.Tensor] = []
    finals: list[torch.Tensor | None] = []
    kept: list[tuple[list[int], torch.Tensor]] = []
    for row, ((start, end), position_slots) in enumerate(
        zip(bounds, _position_slots(tables, len(bounds)), strict=True)
    ):
        output, final = conv1d_with_state(x[start:end], weight, initial[row], activation)
        outputs.append(output)
        if position_slots is None:
            finals.append(final)
        else:
            finals.append(None)
            kept.append((position_slots, conv1d_position_states(x[start:end], initial[row], weight.shape[-1])))
    _write_states(conv_cache, tables, finals, kept)
    return torch.cat(outputs)


def step_rows(
    state_cache: torch.Tensor,
    tables: RecurrentStateTables,
    inputs: tuple[torch.Tensor, ...],
    step: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """The decode-shaped step of a recurrent op, no host read: packed `inputs` ([T, ...] each) of
    tables.tokens_per_row tokens per row (1 in a decode step), each row's state read from its slot,
    its tokens through `step` (-> output, new state) one position at a time, and the state after each
    token written to that token's slot -> the outputs [T, ...]."""
    tokens_per_row = tables.tokens_per_row
    state = row_states(state_cache, tables)
    outputs, states = [], []
    for position in range(tokens_per_row):
        output, state = step(*(x.unflatten(0, (-1, tokens_per_row))[:, position] for x in inputs), state)
        outputs.append(output)
        states.append(state)
    state_cache.index_copy_(0, tables.write_slots, torch.stack(states, 1).flatten(0, 1).to(state_cache.dtype))
    return torch.stack(outputs, 1).flatten(0, 1)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_cache: torch.Tensor,
    tables: RecurrentStateTables,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token per row x [rows, C] (tables.tokens_per_row per row in a verify graph) through the
    conv, the state read from each row's slot and written to its final slot (each token's)."""
    return step_rows(conv_cache, tables, (x,), lambda rows, state: conv1d_step(rows, weight, state, activation))


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_cache: torch.Tensor,
    tables: RecurrentStateTables,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Packed rows (q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv]) of several tokens each, each
    request continuing its state from state_cache [slots, Hv, Dk, Dv] (or zeros) and leaving its
    final state in its final slot (a row that fits its ring: the state after each position, token by
    token) -> output [T, Hv, Dv]."""
    return scan_rows(
        state_cache,
        tables,
        (query, key, value, g, beta),
        functools.partial(gated_delta_rule_chunked, use_qk_l2norm=use_qk_l2norm),
        functools.partial(gated_delta_rule_positions, use_qk_l2norm=use_qk_l2norm),
    )


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_cache: torch.Tensor,
    tables: RecurrentStateTables,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token per row (q, k [rows, Hk, Dk], v [rows, Hv, Dv], g, beta [rows, Hv]; tables.tokens_per_row
    per row in a verify graph), the state read from each row's slot and written to its final slot
    (each token's) -> output [rows, Hv, Dv]."""
    step = functools.partial(gated_delta_rule_step, use_qk_l2norm=use_qk_l2norm)
    return step_rows(state_cache, tables, (query, key, value, g, beta), step)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [N, D] (in fp32, weighted in x's dtype), then times silu(gate) in fp32: the norm
    Gated DeltaNet puts on its output, as transformers' RMSNormGated computes it."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    weighted = weight * normed.to(x.dtype)
    return (weighted * F.silu(gate.float())).to(x.dtype)
