"""Group construction is a pure function of parallel_config's sizes: every layout, cann-recipes' own
included, is checked here without starting a process."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from executor.core.config import ConfigError, build_config
from executor.core.config.parallel_layout import KINDS, ParallelLayout, model_fit_problems

CANN_DIR = Path(__file__).resolve().parent / "data" / "cann_recipes"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def all_layouts(world_sizes: tuple[int, ...] = (1, 2, 4, 6, 8, 16)) -> list[ParallelLayout]:
    layouts = []
    for world in world_sizes:
        for attn, moe, embed in itertools.product(divisors(world), repeat=3):
            layouts.append(ParallelLayout(world, attn, attn, moe, embed, embed, attn))
    return layouts


@pytest.mark.parametrize("layout", all_layouts(), ids=str)
def test_every_kind_of_group_splits_the_world_into_equal_disjoint_groups(layout):
    for kind in KINDS:
        if kind == "dp_leaders":
            continue
        groups = layout.groups(kind)
        assert sorted(rank for group in groups for rank in group) == list(range(layout.world_size)), kind
        assert {len(group) for group in groups} == {layout.size_of(kind)}, kind


@pytest.mark.parametrize("layout", all_layouts(), ids=str)
def test_an_ep_group_holds_one_rank_of_each_moe_tp_group(layout):
    tp_groups = layout.groups("moe_tp")
    for ep_group in layout.groups("moe_ep"):
        assert sorted(next(i for i, g in enumerate(tp_groups) if rank in g) for rank in ep_group) == list(
            range(len(tp_groups))
        )
        assert len({layout.group_rank("moe_tp", rank) for rank in ep_group}) == 1


def test_world_4_attention_tp_2_makes_two_replicas_led_by_ranks_0_and_2():
    layout = ParallelLayout(world_size=4, attn_tp_size=2)
    assert layout.groups("attn_tp") == [[0, 1], [2, 3]]
    assert layout.groups("attn_dp") == [[0, 2], [1, 3]]
    assert layout.groups("dp_leaders") == [[0, 2]]
    assert [layout.dp_rank(rank) for rank in range(4)] == [0, 0, 1, 1]
    assert layout.attn_dp_size == 2


def test_world_8_moe_tp_2_makes_strided_ep_groups_of_4():
    layout = ParallelLayout(world_size=8, attn_tp_size=8, moe_tp_size=2)
    assert layout.groups("moe_tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("moe_ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.moe_ep_size == 4


def test_sizes_that_do_not_divide_the_world_are_each_named():
    layout = ParallelLayout(world_size=6, attn_tp_size=4, embed_tp_size=4, lmhead_tp_size=3)
    assert layout.size_problems() == [
        "parallel_config.attn_tp_size 4 does not divide world_size 6",
        "parallel_config.embed_tp_size 4 does not divide world_size 6",
    ]


def test_a_size_that_does_not_divide_world_size_is_a_config_error():
    raw = {"parallel_config": {"world_size": 3, "attn_tp_size": 2}}
    with pytest.raises(ConfigError, match="attn_tp_size 2 does not divide world_size 3 in <dict>"):
        build_config(raw)


def test_parallel_sizes_above_one_load():
    raw = {"parallel_config": {"world_size": 4, "attn_tp_size": 2, "embed_tp_size": 2, "lmhead_tp_size": 1}}
    assert build_config(raw).parallel_config.attn_tp_size == 2


def cann_layout(name: str) -> ParallelLayout:
    sizes = yaml.safe_load((CANN_DIR / f"{name}.yaml").read_text())["parallel_config"]
    fields = ParallelLayout.__dataclass_fields__
    return ParallelLayout(**{key: value for key, value in sizes.items() if key in fields})


# cann-recipes' layouts (for a model with experts): the model groups that span data-parallel
# replicas, which make the replicas step in lock-step (empty: independent replicas, or one).
CANN_LOCK_STEP = {
    "bailing_2_5": [],  # world 8, everything TP 8, MoE EP 8 inside the one replica
    "hy3": [],  # world 16, attention TP 16, dense FFN replicated, MoE EP 16
    "qwen3_5": [],  # world 4, everything TP 4
    "longcat_flash_lite": [],  # world 8, attention and LM head TP 8, MoE EP 8
    "gemma_4": ["embed_tp", "lmhead_tp", "moe_ep"],  # world 4, attention DP 4, embedding/LM head TP 4
    "qwen3_moe": ["moe_ep"],  # world 16, attention DP 16, MoE EP 16 across the replicas
    "step3p7_flash": ["dense_tp", "embed_tp", "lmhead_tp", "moe_ep"],
}


@pytest.mark.parametrize("name", sorted(CANN_LOCK_STEP))
def test_cann_recipes_layouts_build_their_groups_and_say_which_span_replicas(name):
    layout = cann_layout(name)
    assert layout.size_problems() == []
    for kind in KINDS:
        assert all(len(group) == layout.size_of(kind) for group in layout.groups(kind))
    assert layout.lock_step_kinds(has_experts=True) == CANN_LOCK_STEP[name]


def test_cann_qwen3_moe_layout_is_world_16_of_attention_dp_16_and_one_ep_group_of_16():
    layout = cann_layout("qwen3_moe")
    assert layout.attn_dp_size == 16
    assert layout.groups("moe_ep") == [list(range(16))]
    assert layout.groups("attn_tp") == [[rank] for rank in range(16)]
    assert layout.lock_step_kinds(has_experts=False) == []  # a dense model runs it as 16 independent replicas


def test_a_group_spans_replicas_when_its_ranks_serve_different_ones():
    inside = ParallelLayout(world_size=4, attn_tp_size=2, moe_tp_size=2, embed_tp_size=2)
    assert not inside.spans_replicas("moe_tp")  # [0, 1], [2, 3]: one replica each
    assert inside.spans_replicas("moe_ep")  # [0, 2], [1, 3]
    assert not inside.spans_replicas("embed_tp")
    across = ParallelLayout(world_size=4, attn_tp_size=1, moe_tp_size=2)
    assert across.spans_replicas("moe_tp") and across.spans_replicas("moe_ep")
    assert across.lock_step_kinds(has_experts=True) == ["moe_tp", "moe_ep"]
    assert across.lock_step_kinds(has_experts=False) == []
    assert ParallelLayout(world_size=2, attn_tp_size=2, moe_tp_size=1).lock_step_kinds(has_experts=True) == []


SMOLLM2 = SimpleNamespace(
    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, intermediate_size=1536, tie_word_embeddings=True
)


def test_smollm2_splits_over_three_attention_ranks_but_not_two():
    assert model_fit_problems(ParallelLayout(world_size=3, attn_tp_size=3), SMOLLM2) == []
    assert model_fit_problems(ParallelLayout(world_size=2, attn_tp_size=2), SMOLLM2) == [
        "parallel_config.attn_tp_size 2 does not divide the model's num_attention_heads 9",
        "parallel_config.attn_tp_size 2 does not divide the model's num_key_value_heads 3",
    ]


def test_linear_attention_heads_must_split_over_attention_tp():
    """Gated DeltaNet's key and value heads (and KDA's heads) are split by rank as attention's are."""
    hybrid = SimpleNamespace(
        num_attention_heads=8, num_key_value_heads=4, vocab_size=256, linear_num_key_heads=2, linear_num_value_heads=6
    )
    assert model_fit_problems(ParallelLayout(world_size=2, attn_tp_size=2), hybrid) == []
    assert model_fit_problems(ParallelLayout(world_size=4, attn_tp_size=4), hybrid) == [
        "parallel_config.attn_tp_size 4 does not divide the model's linear_num_key_heads 2",
        "parallel_config.attn_tp_size 4 does not divide the model's linear_num_value_heads 6",
    ]


def test_a_tied_lm_head_needs_the_embeddings_split():
    problems = model_fit_problems(ParallelLayout(world_size=3, attn_tp_size=3, lmhead_tp_size=3), SMOLLM2)
    assert problems == [
        "parallel_config.embed_tp_size 1 and lmhead_tp_size 3 must be equal: the model ties its LM head to its "
        "embedding"
    ]


def test_experts_must_split_over_ep_and_the_expert_width_over_moe_tp():
    moe = SimpleNamespace(
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        intermediate_size=128,
        num_experts=6,
        moe_intermediate_size=30,
    )
    problems = model_fit_problems(ParallelLayout(world_size=4, attn_tp_size=2, moe_tp_size=4), moe)
    assert problems == ["parallel_config.moe_tp_size 4 does not divide the model's moe_intermediate_size 30"]
    assert model_fit_problems(ParallelLayout(world_size=4, attn_tp_size=4, moe_tp_size=1), moe) == [
        "parallel_config.MoE EP (world_size / moe_tp_size) 4 does not divide the model's experts 6"
    ]
