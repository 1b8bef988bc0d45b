"""Speculative decoding's accept counts per draft position (the first draft's, the second's, ...).

One accumulator for a step, a run, data-parallel replicas and resumed parts alike: the totals are the
sums of the positions' counts, so the figures of a step line and of summary.json cannot disagree.
Greedy and rejection-sampling verification both accept a prefix of a request's drafts, so draft j
is accepted exactly when more than j - 1 of its request's drafts were.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class AcceptCounts:
    drafted: list[int] = field(default_factory=list)  # [j]: drafts verified at position j + 1
    accepted: list[int] = field(default_factory=list)  # [j]: of them, accepted
    verifies: int = 0  # requests' verify steps counted (a request with drafts, in one step)

    @classmethod
    def from_step_line(cls, line: Mapping[str, Any]) -> AcceptCounts:
        """A steps.jsonl line's counts (StepRecord's fields)."""
        return cls(
            list(line.get("drafted_per_position") or []),
            list(line.get("accepted_per_position") or []),
            line.get("num_verified_requests", 0),
        )

    def add_verify(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify: drafts 1..num_drafts fed, the first num_accepted of them accepted."""
        assert 0 <= num_accepted <= num_drafts, "a verify accepts a prefix of its drafts"
        self._grow(num_drafts)
        for position in range(num_drafts):
            self.drafted[position] += 1
            self.accepted[position] += position < num_accepted
        self.verifies += 1

    def add(self, other: AcceptCounts) -> None:
        self._grow(len(other.drafted))
        for position, (drafted, accepted) in enumerate(zip(other.drafted, other.accepted, strict=True)):
            self.drafted[position] += drafted
            self.accepted[position] += accepted
        self.verifies += other.verifies

    def _grow(self, num_positions: int) -> None:
        missing = num_positions - len(self.drafted)
        if missing > 0:
            self.drafted.extend([0] * missing)
            self.accepted.extend([0] * missing)

    @property
    def num_drafted(self) -> int:
        return sum(self.drafted)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)

    def per_position(self) -> list[dict[str, Any]]:
        """summary.json's figures of each position: drafts verified there, accepted, and their rate."""
        return [
            {
                "position": position,
                "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "accept_rate": accepted / drafted,
            }
            for position, (drafted, accepted) in enumerate(zip(self.drafted, self.accepted, strict=True), start=1)
            if drafted
        ]
