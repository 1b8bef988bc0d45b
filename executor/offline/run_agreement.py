"""How far two runs of the same prompts agree, from their outputs.jsonl: the accuracy half of
`report --compare` (a graph mode, a quantization scheme or a parallel layout against eager).

Requests are matched by id and compared only where their prompt token ids agree (outputs.jsonl's
`prompt_token_ids_hash`; a line from before it was written is taken by its `prompt` text): others
are left out and counted, as are those that failed in either run. Per request pair:
identical generated tokens or the first position where they part; over the positions before it,
where both runs kept `logprobs`, the chosen tokens' logprob difference; where both kept
`prompt_logprobs` (the same prompt tokens, teacher-forced), each position's top-1 agreement, the
given token's logprob difference and a KL over the tokens both runs list at that position
(renormalized there: a lower bound on the full KL when the lists are short).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor.offline.durable_io import CorruptLineError, read_jsonl
from executor.offline.run_folder import OUTPUTS_FILE


class AgreementError(Exception):
    """An outputs file that cannot be compared; the message names it."""


@dataclass(slots=True)
class Drift:
    """Absolute differences of matched logprobs: their count, mean and largest."""

    count: int = 0
    total: float = 0.0
    largest: float = 0.0

    def add(self, before: float, after: float) -> None:
        difference = abs(after - before)
        self.count += 1
        self.total += difference
        self.largest = max(self.largest, difference)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass(slots=True)
class PromptAgreement:
    """Teacher-forced agreement over the prompt positions both runs scored."""

    positions: int = 0
    top1_equal: int = 0
    kl_total: float = 0.0
    given_token: Drift = field(default_factory=Drift)

    @property
    def mean_kl(self) -> float:
        return self.kl_total / self.positions if self.positions else 0.0


@dataclass(slots=True)
class RunAgreement:
    """Two runs' outputs set side by side."""

    compared: int = 0  # requests served by both runs
    identical: int = 0
    first_difference: dict[str, int] = field(default_factory=dict)  # request id -> first differing position
    failed: int = 0  # requests that failed in either run
    other_prompts: list[str] = field(default_factory=list)  # ids whose prompt token ids differ: left out
    unmatched: int = 0  # ids in one run only
    output_logprobs: Drift = field(default_factory=Drift)  # chosen tokens, over each shared prefix
    prompt: PromptAgreement = field(default_factory=PromptAgreement)

    @property
    def mean_common_prefix(self) -> float:
        """Mean over differing requests of the tokens before they part (identical ones left out)."""
        parted = self.first_difference.values()
        return sum(parted) / len(parted) if parted else 0.0


def read_outputs(folder: Path) -> dict[str, dict[str, Any]]:
    """outputs.jsonl of a run folder, by request id."""
    try:
        lines = read_jsonl(folder / OUTPUTS_FILE).lines
    except (OSError, CorruptLineError) as exc:
        raise AgreementError(f"{folder}: {OUTPUTS_FILE} cannot be read ({exc})") from None
    return {str(line.get("id")): line for line in lines if isinstance(line, dict)}


def compare_outputs(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> RunAgreement:
    agreement = RunAgreement(unmatched=len(before.keys() ^ after.keys()))
    for request_id in sorted(before.keys() & after.keys()):
        old, new = before[request_id], after[request_id]
        if not same_prompt(old, new):
            agreement.other_prompts.append(request_id)
            continue
        if old.get("error") or new.get("error"):
            agreement.failed += 1
            continue
        agreement.compared += 1
        old_tokens, new_tokens = old.get("output_token_ids") or [], new.get("output_token_ids") or []
        parted = first_difference(old_tokens, new_tokens)
        if parted is None:
            agreement.identical += 1
            shared = len(old_tokens)
        else:
            agreement.first_difference[request_id] = parted
            shared = parted
        old_lp, new_lp = old.get("logprobs"), new.get("logprobs")
        if old_lp and new_lp:
            for old_entry, new_entry in zip(old_lp[:shared], new_lp[:shared], strict=False):
                agreement.output_logprobs.add(old_entry["logprob"], new_entry["logprob"])
        _add_prompt_agreement(agreement.prompt, old, new)
    return agreement


def same_prompt(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Whether two outputs lines were made from the same prompt token ids (by their hash; lines
    written before it was kept by their prompt text; True when neither line says)."""
    for key in ("prompt_token_ids_hash", "prompt"):
        if key in before and key in after:
            return before[key] == after[key]
    return True


def first_difference(before: list[int], after: list[int]) -> int | None:
    """The first position where two token lists differ (a length counts), None when equal."""
    for position, (old, new) in enumerate(zip(before, after, strict=False)):
        if old != new:
            return position
    return None if len(before) == len(after) else min(len(before), len(after))


def _add_prompt_agreement(prompt: PromptAgreement, old: dict[str, Any], new: dict[str, Any]) -> None:
    old_entries, new_entries = old.get("prompt_logprobs"), new.get("prompt_logprobs")
    if not old_entries or not new_entries:
        return
    for old_entry, new_entry in zip(old_entries, new_entries, strict=False):
        if old_entry is None or new_entry is None or old_entry["token_id"] != new_entry["token_id"]:
            continue  # the first prompt token has no logprob; other prompts are not comparable
        prompt.positions += 1
        prompt.given_token.add(old_entry["logprob"], new_entry["logprob"])
        old_top, new_top = dict(map(tuple, old_entry["top"])), dict(map(tuple, new_entry["top"]))
        if old_top and new_top and max(old_top, key=old_top.get) == max(new_top, key=new_top.get):
            prompt.top1_equal += 1
        prompt.kl_total += shared_support_kl(old_top, new_top)


def shared_support_kl(before: dict[int, float], after: dict[int, float]) -> float:
    """KL(before || after) over the tokens both list, each renormalized over them (0 with none shared)."""
    shared = before.keys() & after.keys()
    if not shared:
        return 0.0
    log_norm_before = _log_sum_exp([before[t] for t in shared])
    log_norm_after = _log_sum_exp([after[t] for t in shared])
    kl = 0.0
    for token in shared:
        p = before[token] - log_norm_before
        q = after[token] - log_norm_after
        kl += math.exp(p) * (p - q)
    return max(kl, 0.0)


def _log_sum_exp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def agreement_lines(agreement: RunAgreement, shown: int = 5) -> list[str]:
    """The agreement as report lines: identical count, where the others part, the logprob drift."""
    lines = [
        f"{'accuracy':22s} {agreement.identical} of {agreement.compared} requests give identical tokens"
        + (f"; {agreement.failed} failed in a run" if agreement.failed else "")
        + (f"; {agreement.unmatched} ids in one run only" if agreement.unmatched else "")
        + _left_out(agreement.other_prompts, shown)
    ]
    if agreement.first_difference:
        parted = sorted(agreement.first_difference.items(), key=lambda item: (item[1], item[0]))
        listed = _listed([f"{request_id} at {position}" for request_id, position in parted], shown)
        lines.append(f"{'  first difference':22s} {listed}; mean common prefix {agreement.mean_common_prefix:.1f}")
    drift = agreement.output_logprobs
    if drift.count:
        lines.append(
            f"{'  logprob drift':22s} mean {drift.mean:.3g}, largest {drift.largest:.3g} "
            f"over {drift.count} shared tokens"
        )
    prompt = agreement.prompt
    if prompt.positions:
        lines.append(
            f"{'  prompt logprobs':22s} top-1 agreement {prompt.top1_equal / prompt.positions:.1%} of "
            f"{prompt.positions} positions, mean KL {prompt.mean_kl:.3g} (shared top-k), given-token drift "
            f"mean {prompt.given_token.mean:.3g}, largest {prompt.given_token.largest:.3g}"
        )
    return lines


def _left_out(request_ids: list[str], shown: int) -> str:
    if not request_ids:
        return ""
    return f"; {len(request_ids)} left out: their prompt token ids differ ({_listed(request_ids, shown)})"


def _listed(items: list[str], shown: int) -> str:
    """The first `shown` items, and how many more there are."""
    more = f" (+{len(items) - shown} more)" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
