"""N-gram (prompt lookup) proposer: drafts copied from the request's own earlier tokens.

Model-free and fit for any model: when the request's last n tokens occurred before in its prompt
or output, the tokens that followed that occurrence are proposed. Longer n-grams are tried first,
and the latest occurrence wins, as vLLM's prompt-lookup decoding does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class NgramProposer:
    num_speculative_tokens: int
    min_n: int
    max_n: int

    def propose_for(self, token_ids: list[int]) -> list[int]:
        """Up to num_speculative_tokens drafts to follow `token_ids`; none when no n-gram recurs."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n  # what followed the latest earlier occurrence
                return tokens[start : start + self.num_speculative_tokens].tolist()
        return []
