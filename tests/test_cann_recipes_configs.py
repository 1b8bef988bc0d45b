"""cann-recipes-infer's executor-schema YAML runs as it is: every key its files use has the outcome
that docs/configuration.md's tables give it (used, not applicable with a reason, or refused unless
it has a value that runs), checked on our own files in tests/data/cann_recipes/."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from executor.core.config import ConfigError, build_config, load_config
from executor.core.config.inference_config import not_applicable_keys

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "cann_recipes"
FILES = sorted(DATA.glob("*.yaml"))

# Every key that cann-recipes-infer's 92 executor-schema YAML files set (model_config.custom_params's
# keys included), as found in its repository: the data files must use each of them.
CANN_KEYS = {
    "model_config": (
        "custom_params enable_cache_compile enable_dynamic_graph enable_hadamard enable_profiler "
        "enable_static_kernel enable_weight_nz exe_mode force_eplb hadamard_weight_path model_name model_path "
        "next_n packed_sequence platform_version with_ckpt"
    ),
    "data_config": "dataset input_truncated_len temperature top_k top_p",
    "parallel_config": (
        "attn_tp_size cp_size dense_tp_size embed_tp_size lmhead_tp_size moe_ep_size moe_tp_size o_proj_tp_size "
        "pp_size shared_tp_size world_size"
    ),
    "scheduler_config": (
        "batch_size block_size cp_mini_batch max_new_tokens max_prefill_tokens mem_fraction_static "
        "num_reserved_decode_tokens"
    ),
    "model_config.custom_params": (
        "enable_afd enable_gdn_solve_triangular enable_limit_core enable_limit_core_num enable_mla_prolog "
        "enable_mm_all_reduce_base enable_moe_stream_overlap enable_multi_streams enable_o_proj_alltoall "
        "enable_offload enable_online_mxfp8_quantization enable_prefetch enable_pypto enable_sp enable_superkernel "
        "micro_batch_mode moe_chunk_max_len ngram_embed_tp_size num_hidden_layers online_mxfp8_ignored_layers "
        "online_mxfp8_quant_layers"
    ),
}


@dataclass(frozen=True)
class DocOutcome:
    outcome: str  # "used" | "not applicable" | "refused"
    reason: str
    runs_with: tuple[Any, ...] = ()


def doc_outcomes() -> dict[str, DocOutcome]:
    """`section.key` -> its outcome, read from the key tables of docs/configuration.md; the flattened
    schema's tables give `flat.key` (top level) and `flat.section.key`."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    outcomes: dict[str, DocOutcome] = {}
    section = ""
    for line in text.splitlines():
        if line.startswith("#"):
            heading = re.fullmatch(r"### (flattened )?(?:`([\w.]+)`|top level)", line)
            section = ".".join(part for part in ("flat" if heading[1] else "", heading[2]) if part) if heading else ""
        elif section and (row := re.fullmatch(r"\| `(\w+)` \|.*", line)):
            outcome_cell = [cell.strip() for cell in line.split(" | ")][3]
            outcomes[f"{section}.{row.group(1)}"] = parse_outcome(outcome_cell)
    return outcomes


def parse_outcome(cell: str) -> DocOutcome:
    if cell == "used":
        return DocOutcome("used", "")
    if cell.startswith("not applicable: "):
        return DocOutcome("not applicable", cell.removeprefix("not applicable: "))
    refused = re.fullmatch(r"refused unless (.+?): (.+)", cell)
    assert refused, f"an outcome cell that is none of the three: {cell!r}"
    values = tuple(ast.literal_eval(value.strip().strip("`")) for value in refused.group(1).split(","))
    return DocOutcome("refused", refused.group(2), values)


def file_keys(raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`section.key` -> value for every key a file sets, custom_params' keys included."""
    keys = {}
    for section, values in raw.items():
        for key, value in values.items():
            keys[f"{section}.{key}"] = value
            if key == "custom_params":
                keys |= {f"{section}.custom_params.{inner}": v for inner, v in value.items()}
    return keys


def refused_keys(keys: dict[str, Any], outcome_of: Callable[[str], DocOutcome]) -> dict[str, DocOutcome]:
    """The keys of `keys` (`name` -> value) whose documented outcome refuses the value set."""
    return {
        key: outcome_of(key)
        for key, value in keys.items()
        if outcome_of(key).outcome == "refused" and value not in outcome_of(key).runs_with
    }


def test_the_data_files_use_every_key_cann_recipes_files_use_one_file_per_model_folder():
    used: set[str] = set()
    for path in FILES:
        used |= set(file_keys(yaml.safe_load(path.read_text())))
    expected = {f"{section}.{key}" for section, keys in CANN_KEYS.items() for key in keys.split()}
    assert expected <= used, sorted(expected - used)
    assert len(FILES) == 15


def test_every_cann_recipes_key_has_an_outcome_in_the_docs():
    outcomes = doc_outcomes()
    missing = [f"{s}.{k}" for s, keys in CANN_KEYS.items() for k in keys.split() if f"{s}.{k}" not in outcomes]
    assert missing == []
    counts = {kind: sum(o.outcome == kind for o in outcomes.values()) for kind in ("used", "not applicable", "refused")}
    assert all(counts.values()), counts


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_each_key_of_a_cann_recipes_file_has_its_documented_outcome(path):
    outcomes = doc_outcomes()
    raw = yaml.safe_load(path.read_text())
    should_refuse = refused_keys(file_keys(raw), outcomes.__getitem__)
    problems: list[str] = []
    try:
        load_config(path)
    except ConfigError as exc:
        problems = exc.problems
    # Every refusal is reported at once, one line each, and nothing else is a problem.
    assert sorted(problems) == sorted(p for p in problems if any(f"{key} in {path}" in p for key in should_refuse))
    for key in should_refuse:
        (line,) = [p for p in problems if f"{key} in {path} is refused" in p]
        assert outcomes[key].reason in line

    # With the refused values set to one that runs, the file loads and every other key does what the doc says.
    for key in should_refuse:
        section, _, rest = key.partition(".")
        target = raw[section]["custom_params"] if rest.startswith("custom_params.") else raw[section]
        target[rest.removeprefix("custom_params.")] = outcomes[key].runs_with[0]
    config = build_config(raw, source=str(path))
    logged = dict(not_applicable_keys(config, "cpu"))
    for key, value in file_keys(raw).items():
        expected = outcomes[key]
        if expected.outcome == "not applicable":
            assert logged.get(key) == expected.reason, key
        elif key not in logged:
            assert value_of(config, key) == value, key


def value_of(config: Any, dotted: str) -> Any:
    section, _, rest = dotted.partition(".")
    if rest.startswith("custom_params."):
        return getattr(config, section).custom_params[rest.removeprefix("custom_params.")]
    return getattr(getattr(config, section), rest)
