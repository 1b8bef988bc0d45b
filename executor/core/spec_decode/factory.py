"""The proposer a run's config asks for (speculative_config, or model_config.next_n for MTP).

A draft model runs in an engine of its own, which the engine builds (draft_model_config) and hands
in as its runner and KV cache manager, so that nothing here imports the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from executor.core.config import InferenceConfig
from executor.core.config.comm_manager import CommManager
from executor.core.kv_cache import KVCacheManager
from executor.core.spec_decode.draft_model import DraftModelProposer, DraftRunner
from executor.core.spec_decode.eagle3 import Eagle3Parts, Eagle3Proposer
from executor.core.spec_decode.mtp import MTPProposer
from executor.core.spec_decode.ngram import NgramProposer, NgramStepProposer, PromptLookup
from executor.core.spec_decode.proposer import LockStep, Proposer, ReplicaSharedDrafts
from executor.model_loader.default_model import expand_home_vars
from ops.attention.metadata import AttentionMetadataBuilder


@dataclass(frozen=True, slots=True)
class DraftParts:
    """What the engine builds for method draft_model: the draft's runner and KV cache manager, and
    its lock-step (None unless the draft model's own groups span the replicas)."""

    runner: DraftRunner
    kv_cache_manager: KVCacheManager
    lock_step: LockStep | None


def make_proposer(
    config: InferenceConfig,
    model: torch.nn.Module,
    kv_cache_manager: KVCacheManager,
    metadata_builder: AttentionMetadataBuilder,
    max_blocks_per_request: int,
    comm: CommManager,
    argmax_rows: Callable[[torch.Tensor], torch.Tensor],
    lock_step: LockStep | None = None,
    draft: DraftParts | None = None,
    eagle3: Eagle3Parts | None = None,
) -> Proposer | None:
    """None when speculative decoding is off; built after the target's weights and cache.
    `argmax_rows`: the backend's greedy choice (MTP's drafts take it); `lock_step`: the target's, when
    its groups span the replicas; `draft`: for method draft_model; `eagle3`: for method eagle3.
    Above one rank per attention TP group, the group's ranks take its rank 0's drafts."""
    method, num_tokens = config.speculation
    spec = config.speculative_config
    if not method:
        return None
    proposer: Proposer
    if method == "ngram":
        proposer = NgramStepProposer(NgramProposer(num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max))
    elif method in ("mtp", "eagle3"):  # EAGLE-3's passes are MTP's, through its drafter
        passes = dict(
            num_speculative_tokens=num_tokens,
            max_blocks_per_request=max_blocks_per_request,
            config=config,
            lock_step=lock_step,
            argmax_rows=argmax_rows,
            prompt_lookup=PromptLookup(NgramProposer(num_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max))
            if spec.prompt_lookup
            else None,
        )
        if method == "mtp":
            proposer = MTPProposer(model, kv_cache_manager, metadata_builder, **passes)
        else:
            assert eagle3 is not None, "method eagle3 needs the drafter the engine attached"
            proposer = Eagle3Proposer(model, eagle3, kv_cache_manager, metadata_builder, **passes)
    else:
        assert draft is not None, "method draft_model needs the draft model's runner"
        proposer = DraftModelProposer(draft.runner, draft.kv_cache_manager, num_tokens, draft.lock_step)
    return ReplicaSharedDrafts(proposer, comm, num_tokens) if comm.layout.attn_tp_size > 1 else proposer


def draft_model_config(config: InferenceConfig) -> InferenceConfig:
    """The draft model's config: the target's limits and exe_mode (one ops table per process), no
    prefix caching (its shadow requests are rewritten each step), no speculation of its own, none
    of the target's custom_params (a num_hidden_layers there cuts the target, not the draft), and
    the target's model_config.quantization unless speculative_config.quantization names the draft's."""
    spec = config.speculative_config
    draft_path = str(Path(expand_home_vars(spec.draft_model_path)).expanduser())
    quantization = spec.quantization or config.model_config.quantization
    return dataclasses.replace(
        config,
        model_config=dataclasses.replace(
            config.model_config, model_path=draft_path, next_n=0, custom_params={}, quantization=quantization
        ),
        scheduler_config=dataclasses.replace(config.scheduler_config, enable_prefix_caching=False),
        speculative_config=dataclasses.replace(spec, method="", num_speculative_tokens=0, quantization=""),
    )
