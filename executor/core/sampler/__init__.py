"""The sampler: penalties, temperature, top-k / top-p / min-p, greedy or seeded random choice per
row, logprobs and prompt logprobs, over a whole step's rows at once (docs/sampling.md)."""

from executor.core.sampler.defaults import default_sampling_params
from executor.core.sampler.metadata import SamplingMetadata
from executor.core.sampler.noise import request_seed
from executor.core.sampler.sampler import LogprobsTensors, Sampler, SamplerOutput, prompt_logprobs

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "default_sampling_params",
    "prompt_logprobs",
    "request_seed",
]
