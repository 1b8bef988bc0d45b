"""The proposer a run's config asks for (speculative_config, or model_config.next_n for MTP)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from executor.core.config import ConfigError, InferenceConfig
from executor.core.spec_decode.draft_model import DraftModelProposer
from executor.core.spec_decode.mtp import MTPProposer
from executor.core.spec_decode.ngram import NgramProposer
from executor.core.spec_decode.proposer import ProposalContext, Proposer
from executor.model_loader.default_model import expand_home_vars

if TYPE_CHECKING:
    from executor.core.engine.engine import ExecutionEngine


class NgramStepProposer:
    """Prompt lookup over each request's tokens, this step's included."""

    def __init__(self, ngram: NgramProposer) -> None:
        self.ngram = ngram

    def propose(self, context: ProposalContext) -> list[list[int]]:
        return [
            self.ngram.propose_for([*request.prompt_token_ids, *request.output_token_ids, *new]) if new else []
            for request, new in zip(context.requests, context.new_token_ids, strict=True)
        ]


def make_proposer(engine: ExecutionEngine) -> Proposer | None:
    """None when speculative decoding is off; built after the target engine's weights and cache."""
    config = engine.config
    method, num_tokens = config.speculation
    spec = config.speculative_config
    if not method:
        return None
    if method == "ngram":
        return NgramStepProposer(NgramProposer(num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max))
    if method == "mtp":
        assert engine.kv_cache_manager is not None and engine.worker.model is not None
        return MTPProposer(
            engine.worker.model,
            engine.kv_cache_manager,
            engine.metadata_builder,
            num_speculative_tokens=num_tokens,
            max_blocks_per_request=engine.max_blocks_per_request,
            source=config.source,
        )
    return DraftModelProposer(_draft_engine(engine, config), num_tokens)


def _draft_engine(target: ExecutionEngine, config: InferenceConfig) -> ExecutionEngine:
    """An engine for the draft model with the target's limits and exe_mode (one ops table per process),
    no prefix caching (its shadow requests are rewritten each step), no speculation of its own, and
    none of the target's custom_params (a num_hidden_layers there cuts the target, not the draft)."""
    from executor.core.config.model_registry import resolve_model
    from executor.core.engine.engine import ExecutionEngine

    draft_path = str(Path(expand_home_vars(config.speculative_config.draft_model_path)).expanduser())
    draft_config = dataclasses.replace(
        config,
        model_config=dataclasses.replace(config.model_config, model_path=draft_path, next_n=0, custom_params={}),
        scheduler_config=dataclasses.replace(config.scheduler_config, enable_prefix_caching=False),
        speculative_config=dataclasses.replace(config.speculative_config, method="", num_speculative_tokens=0),
    )
    engine = ExecutionEngine(draft_config, comm=target.comm)
    model_cls, config_cls = resolve_model(config.model_config.model_name)
    engine.init(model_cls, config_cls, draft_path)
    if engine.vocab_size != target.vocab_size:
        raise ConfigError(
            f"speculative_config.draft_model_path in {config.source}: the draft model's vocabulary "
            f"({engine.vocab_size}) differs from the target's ({target.vocab_size}); it needs the same tokenizer"
        )
    return engine
