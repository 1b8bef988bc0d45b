"""The run's default SamplingParams: scheduler_config's length and stop settings with data_config's
sampling knobs; a dataset line or an HTTP request overrides them per request."""

from __future__ import annotations

import dataclasses

from executor.core.config import InferenceConfig
from executor.types_ import SamplingParams
from executor.types_.structured_output import parse_structured_output


def default_sampling_params(config: InferenceConfig) -> SamplingParams:
    sched, data = config.scheduler_config, config.data_config
    return SamplingParams(
        max_new_tokens=sched.max_new_tokens,
        ignore_eos=sched.ignore_eos,
        stop_token_ids=tuple(sched.stop_token_ids),
        temperature=data.temperature,
        top_k=data.top_k,
        top_p=data.top_p,
        min_p=data.min_p,
        repetition_penalty=data.repetition_penalty,
        frequency_penalty=data.frequency_penalty,
        presence_penalty=data.presence_penalty,
        logprobs=data.logprobs,
        prompt_logprobs=data.prompt_logprobs,
        bad_words=tuple(data.bad_words),
        structured_output=parse_structured_output(dataclasses.asdict(data)),  # checked when the config loads
    )
