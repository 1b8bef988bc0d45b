"""Random numbers for sampling that do not depend on the batch.

Random rows sample by the exponential race (Gumbel-max in another guise): token = argmax(p / q)
with q ~ Exp(1) per token, which picks token i with probability p_i. A row whose request has a
seed draws q from a generator seeded by (seed, output index) alone, so its token depends on
nothing else in the step: the same alone or in any batch, after a preemption, or when a verify
step samples the same index again. Rows without a seed share the run generator (seeded once by
data_config.seed), whose draws depend on what ran before.
"""

from __future__ import annotations

import hashlib

import torch

_MASK64 = (1 << 64) - 1


def request_seed(run_seed: int, request_id: str) -> int:
    """A request's own seed derived from the run's seed and its id: the offline runner gives one
    to every request without a seed, so a run's samples do not depend on batch size, order or
    resumption, yet two requests do not share their random numbers. sha256, not hash(), since
    Python salts str hashes per process."""
    digest = hashlib.sha256(f"{run_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # < 2**63, like any seed a user may give


def token_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, output index): the generator seed of one token's noise. Mixed, since
    generators seeded with neighbouring integers can give correlated streams."""
    x = (seed + 0x9E3779B97F4A7C15 * (position + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class ExponentialNoise:
    """Exp(1) noise [rows, vocab] for the random rows of a step, on the sampler's device. The
    numbers for a given (seed, index) differ between device types (each has its own generator)."""

    def __init__(self, run_seed: int, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.run_generator = torch.Generator(self.device).manual_seed(run_seed)
        self._token_generator = torch.Generator(self.device)  # reseeded for every seeded row

    def sample(self, seeds: list[int | None], positions: list[int], vocab_size: int) -> torch.Tensor:
        """One row per entry of `seeds`: from token_seed(seed, position), or from the run
        generator for None. Clamped above 0, so that p / q is never 0 / 0."""
        noise = torch.empty(len(seeds), vocab_size, device=self.device)
        unseeded = [row for row, seed in enumerate(seeds) if seed is None]
        if len(unseeded) == len(seeds):
            noise.exponential_(generator=self.run_generator)
        elif unseeded:
            draws = torch.empty(len(unseeded), vocab_size, device=self.device)
            noise[torch.tensor(unseeded, device=self.device)] = draws.exponential_(generator=self.run_generator)
        for row, (seed, position) in enumerate(zip(seeds, positions, strict=True)):
            if seed is not None:  # one small draw per seeded row: the price of batch invariance
                self._token_generator.manual_seed(token_seed(seed, position))
                noise[row].exponential_(generator=self._token_generator)
        return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
