"""The linear-attention ops (ops/recurrent_ref.py) against the naive per-token formulas and against
transformers' torch fallbacks (modeling_qwen3_5.py), and their state slots: read where a row
continues, zeros where it starts fresh (NaN in a slot never leaks), the final state written back."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ops import recurrent_ref as ref
from ops.attention.metadata import RecurrentStateTables

torch.manual_seed(0)
HK, HV, DK, DV, CONV_CHANNELS, WIDTH = 2, 4, 8, 6, 12, 4


def naive_delta_rule(q, k, v, g, beta, state):
    """The definition, token by token: S = exp(g) S; S += k (beta (v - k^T S)); o = q^T S (q, k
    L2-normalised, q scaled by Dk^-0.5; each key head repeated over its value heads)."""
    repeats = v.shape[1] // q.shape[1]
    q = F.normalize(q.double().repeat_interleave(repeats, 1), dim=-1, eps=0) * q.shape[-1] ** -0.5
    k = F.normalize(k.double().repeat_interleave(repeats, 1), dim=-1, eps=0)
    state = state.double().clone()
    outputs = []
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            s = state[h] * torch.exp(g[t, h].double())
            s = s + torch.outer(k[t, h], beta[t, h].double() * (v[t, h].double() - k[t, h] @ s))
            state[h] = s
        outputs.append(torch.stack([q[t, h] @ state[h] for h in range(v.shape[1])]))
    return torch.stack(outputs), state


def inputs(length: int):
    q, k = torch.randn(length, HK, DK), torch.randn(length, HK, DK)
    v = torch.randn(length, HV, DV)
    g = -torch.rand(length, HV) * 0.5  # log decays <= 0
    beta = torch.rand(length, HV)
    return q, k, v, g, beta


@pytest.mark.parametrize(("length", "chunk_size"), [(1, 4), (7, 4), (16, 4), (37, 8), (5, 64)])
def test_chunked_rule_equals_the_naive_formula_from_a_given_state(length, chunk_size):
    q, k, v, g, beta = inputs(length)
    state = torch.randn(HV, DK, DV)
    output, final = ref.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    expected_output, expected_final = naive_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(output.double(), expected_output, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), expected_final, atol=1e-5, rtol=1e-5)


def test_one_token_step_equals_the_naive_formula_row_by_row():
    q, k, v, g, beta = inputs(5)  # five rows of one token each
    states = torch.randn(5, HV, DK, DV)
    output, new_states = ref.gated_delta_rule_step(q, k, v, g, beta, states)
    for row in range(5):
        expected, expected_state = naive_delta_rule(
            q[row : row + 1], k[row : row + 1], v[row : row + 1], g[row : row + 1], beta[row : row + 1], states[row]
        )
        torch.testing.assert_close(output[row].double(), expected[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_states[row].double(), expected_state, atol=1e-5, rtol=1e-5)


def test_a_sequence_in_two_chunks_carrying_the_state_equals_it_whole():
    q, k, v, g, beta = inputs(29)
    whole, whole_final = ref.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=8)
    first, state = ref.gated_delta_rule_chunked(q[:13], k[:13], v[:13], g[:13], beta[:13], chunk_size=8)
    second, final = ref.gated_delta_rule_chunked(q[13:], k[13:], v[13:], g[13:], beta[13:], state, chunk_size=8)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, whole_final, atol=1e-5, rtol=1e-5)


def test_chunked_and_recurrent_rules_match_transformers_fallbacks():
    q, k, v, g, beta = inputs(21)
    state = torch.randn(HV, DK, DV)
    ours, our_final = ref.gated_delta_rule_chunked(q, k, v, g, beta, state, chunk_size=64)
    theirs, their_final = hf.torch_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        initial_state=state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(our_final, their_final[0], atol=1e-5, rtol=1e-5)
    step, step_state = ref.gated_delta_rule_step(q[:3], k[:3], v[:3], g[:3], beta[:3], state.expand(3, -1, -1, -1))
    for row in range(3):
        theirs, their_state = hf.torch_recurrent_gated_delta_rule(
            q[None, row : row + 1],
            k[None, row : row + 1],
            v[None, row : row + 1],
            g[None, row : row + 1],
            beta[None, row : row + 1],
            initial_state=state[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(step[row], theirs[0, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step_state[row], their_state[0], atol=1e-5, rtol=1e-5)


def test_dropping_the_decay_or_beta_changes_the_output():
    """The gates matter: a rule that ignored g or beta would not pass the tests above."""
    q, k, v, g, beta = inputs(9)
    output, _ = ref.gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=4)
    no_decay, _ = ref.gated_delta_rule_chunked(q, k, v, torch.zeros_like(g), beta, chunk_size=4)
    no_beta, _ = ref.gated_delta_rule_chunked(q, k, v, g, torch.ones_like(beta), chunk_size=4)
    assert (output - no_decay).abs().max() > 1e-3
    assert (output - no_beta).abs().max() > 1e-3


def test_conv_with_state_equals_a_zero_padded_causal_conv_and_carries_across_chunks():
    x = torch.randn(11, CONV_CHANNELS)
    weight = torch.randn(CONV_CHANNELS, WIDTH)
    expected = F.silu(F.conv1d(x.t()[None], weight[:, None], padding=WIDTH - 1, groups=CONV_CHANNELS)[0, :, :11].t())
    whole, final = ref.conv1d_with_state(x, weight, None)
    torch.testing.assert_close(whole, expected)
    torch.testing.assert_close(final, x[-(WIDTH - 1) :])
    first, state = ref.conv1d_with_state(x[:2], weight, None)  # shorter than the kernel
    second, _ = ref.conv1d_with_state(x[2:], weight, state)
    torch.testing.assert_close(torch.cat([first, second]), expected)
    hf_out = hf.causal_conv1d_fn(x.t()[None], weight, None, activation="silu")[0].t()
    torch.testing.assert_close(whole, hf_out)


def test_conv_step_equals_the_sequence_form_token_by_token():
    x = torch.randn(6, CONV_CHANNELS)
    weight = torch.randn(CONV_CHANNELS, WIDTH)
    expected, _ = ref.conv1d_with_state(x, weight, None)
    state = torch.zeros(1, WIDTH - 1, CONV_CHANNELS)
    for t in range(6):
        output, state = ref.conv1d_step(x[t : t + 1], weight, state)
        torch.testing.assert_close(output[0], expected[t])


def tables(slots, continues, query_ends=None) -> RecurrentStateTables:
    return RecurrentStateTables(torch.tensor(slots), torch.tensor(continues), query_ends)


def test_slot_ops_read_continuing_rows_start_fresh_ones_from_zeros_and_write_final_states():
    """Two requests packed: one continues the state in slot 2, one starts fresh in slot 3, whose
    NaN contents must not leak; both final states land in their slots, slot 1 is untouched."""
    q, k, v, g, beta = inputs(9)
    cache = torch.full((4, HV, DK, DV), float("nan"))
    cache[2] = torch.randn(HV, DK, DV)
    initial = cache[2].clone()
    step = tables([2, 3], [True, False], [4, 9])
    output = ref.chunk_gated_delta_rule(q, k, v, g, beta, cache, step)
    first, first_final = ref.gated_delta_rule_chunked(q[:4], k[:4], v[:4], g[:4], beta[:4], initial)
    second, second_final = ref.gated_delta_rule_chunked(q[4:], k[4:], v[4:], g[4:], beta[4:])
    torch.testing.assert_close(output, torch.cat([first, second]))
    torch.testing.assert_close(cache[2], first_final)
    torch.testing.assert_close(cache[3], second_final)
    assert cache[1].isnan().all()
    decode = ref.recurrent_gated_delta_rule(q[:2], k[:2], v[:2], g[:2], beta[:2], cache, tables([3, 2], [True, True]))
    expected, _ = ref.gated_delta_rule_step(
        q[:2], k[:2], v[:2], g[:2], beta[:2], torch.stack([second_final, first_final])
    )
    torch.testing.assert_close(decode, expected)


def test_conv_slot_ops_continue_a_prompt_across_chunks_and_into_decode():
    x = torch.randn(8, CONV_CHANNELS)
    weight = torch.randn(CONV_CHANNELS, WIDTH)
    expected, _ = ref.conv1d_with_state(x, weight, None)
    cache = torch.full((3, WIDTH - 1, CONV_CHANNELS), float("nan"))
    first = ref.causal_conv1d_fn(x[:3], weight, cache, tables([1], [False], [3]))
    second = ref.causal_conv1d_fn(x[3:7], weight, cache, tables([1], [True], [4]))
    last = ref.causal_conv1d_update(x[7:], weight, cache, tables([1], [True]))
    torch.testing.assert_close(torch.cat([first, second, last]), expected)


def test_gated_rms_norm_matches_transformers():
    norm = hf.Qwen3_5RMSNormGated(DV, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x, gate = torch.randn(5, DV), torch.randn(5, DV)
    torch.testing.assert_close(ref.rms_norm_gated(x, gate, norm.weight.data, 1e-6), norm(x, gate).detach())


def test_a_row_that_fits_its_ring_keeps_the_state_after_each_position():
    """A verify row of 3 tokens: the state after each position in its slot (the naive formula's), its
    output the chunked rule's; the conv likewise keeps its last K - 1 inputs after each position."""
    q, k, v, g, beta = inputs(3)
    cache = torch.full((5, HV, DK, DV), float("nan"))
    cache[1] = torch.randn(HV, DK, DV)
    initial = cache[1].clone()
    step = RecurrentStateTables(
        torch.tensor([1]), torch.tensor([True]), [3], torch.tensor([2]), position_state_slots=[[3, 4, 2]]
    )
    output = ref.chunk_gated_delta_rule(q, k, v, g, beta, cache, step)
    torch.testing.assert_close(output, ref.gated_delta_rule_chunked(q, k, v, g, beta, initial)[0])
    for position, slot in enumerate([3, 4, 2]):
        _, expected = naive_delta_rule(
            q[: position + 1], k[: position + 1], v[: position + 1], g[: position + 1], beta[: position + 1], initial
        )
        torch.testing.assert_close(cache[slot].double(), expected, atol=1e-5, rtol=1e-5)
    x = torch.randn(3, CONV_CHANNELS)
    weight = torch.randn(CONV_CHANNELS, WIDTH)
    conv_cache = torch.zeros(5, WIDTH - 1, CONV_CHANNELS)
    ref.causal_conv1d_fn(x, weight, conv_cache, step)
    history = torch.cat([torch.zeros(WIDTH - 1, CONV_CHANNELS), x])
    for position, slot in enumerate([3, 4, 2]):
        torch.testing.assert_close(conv_cache[slot], history[position + 1 : position + WIDTH])
