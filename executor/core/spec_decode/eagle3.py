"""EAGLE-3 proposer (vLLM's `eagle3` method): a one-layer drafter reading the target's residual
stream at three layers (low, middle, high), drafting k tokens per step as a chain.

After every step its first pass runs over each request's rows whose K/V stands, as the MTP pass
does (the inputs shifted by one token, so that its own KV cache stays complete): row p takes the
embedding of the token at p + 1 and fc(the target's three hidden states at p), and the last row's
greedy token is draft 1. Draft j > 1 feeds draft j - 1 and the previous pass's hidden state
(before the drafter's norm) back, one position further on, in the lookahead slots the scheduler
allocates with the step. The drafter's attention layer keeps its K/V in the target's KV pool (its
layers are added to the worker's cache layers before the cache is sized). The target's three
hidden states come from forward pre-hooks on those layers, which keep the latest step's rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from executor.core.config import ConfigError, InferenceConfig
from executor.core.config.model_registry import resolve_eagle3_drafter
from executor.core.model_worker.graph_runner import GraphRunner
from executor.core.spec_decode.mtp import MTPProposer
from executor.core.spec_decode.mtp_graphs import MTPStep, RunnerFactory
from executor.core.spec_decode.proposer import ProposalContext
from executor.model_loader.default_loader import safetensors_weights
from executor.model_loader.quantization_config import QuantizationRequest, read_quantization
from executor.types_.quant_scheme import QuantizationPlan
from module.causal_lm import CausalLM
from module.parallel_group import ONE_PROCESS, ModelParallel
from module.quantization_pass import QuantizedLayer, describe_quantized_layers, quantize_model
from ops.attention.metadata import ModelInputs, take_rows
from ops.backend import Backend

DRAFTER_QUANTIZATION_KEY = "speculative_config.quantization"


def drafter_quantization(path: str, draft_config: PretrainedConfig, schemes: str) -> QuantizationPlan | None:
    """The plan `schemes` (speculative_config.quantization) gives the drafter at `path`, quantized at
    load; None when empty. A drafter whose checkpoint is quantized already, and a KV cache scheme (the
    drafter's K/V lies in the target's pool, whose scheme is model_config.quantization's), are
    refused: ValueError naming the folder or the key."""
    if getattr(draft_config, "quantization_config", None) is not None:
        raise ValueError(
            f"{path}/config.json has a quantization_config: a drafter quantized in its checkpoint is not read "
            f"here; quantize an unquantized one at load with {DRAFTER_QUANTIZATION_KEY}"
        )
    request = QuantizationRequest(schemes, DRAFTER_QUANTIZATION_KEY)
    plan = read_quantization(draft_config, request, f"{path}/config.json")
    if plan is not None and plan.kv_cache is not None:
        raise ValueError(
            f"{DRAFTER_QUANTIZATION_KEY}: {schemes!r}: the drafter's K/V lies in the target's KV pool; "
            "model_config.quantization's c8 sets that pool's scheme"
        )
    return plan


@dataclass(frozen=True, slots=True)
class DrafterFolder:
    """A drafter folder's config.json, read and checked against the target before anything loads."""

    path: str
    drafter_cls: Any  # the family's drafter class: its package's eagle3_drafter_cls
    config: PretrainedConfig
    target_hidden_size: int
    quantization: QuantizationPlan | None

    @classmethod
    def read(cls, path: str, target_config: PretrainedConfig, model_name: str, quantization: str = "") -> DrafterFolder:
        """ValueError (OSError without a config.json) naming the folder when it holds no drafter of
        model_name's family for this target, or `quantization` (speculative_config.quantization's
        schemes) cannot quantize it."""
        drafter_cls = resolve_eagle3_drafter(model_name)
        config = AutoConfig.from_pretrained(path)
        if (problem := drafter_cls.config_problem(config)) is not None:
            raise ValueError(f"{path}/config.json: {problem}")
        if config.hidden_size != target_config.hidden_size:
            raise ValueError(
                f"{path}/config.json: hidden_size {config.hidden_size} differs from the target's "
                f"{target_config.hidden_size}; the drafter embeds through the target's embedding"
            )
        target_hidden = getattr(config, "target_hidden_size", None) or target_config.hidden_size
        return cls(path, drafter_cls, config, target_hidden, drafter_quantization(path, config, quantization))


@dataclass(slots=True)
class LoadedDrafter:
    """A drafter folder built and loaded: the module, the target layers it reads, the layers its plan quantized."""

    module: Any  # the family's drafter class: its package's eagle3_drafter_cls
    aux_layers: tuple[int, int, int]
    quantized_layers: list[QuantizedLayer]


def load_eagle3_drafter(
    path: str,
    target_config: PretrainedConfig,
    model_name: str,
    *,
    parallel: ModelParallel = ONE_PROCESS,
    backend: Backend,
    quantization: str = "",
    compute_dtype: torch.dtype = torch.float32,
) -> LoadedDrafter:
    """A published EAGLE-3 drafter folder (config.json + safetensors) as it is, built by the drafter
    class of model_name's family, its linear layers given `quantization`'s schemes (quantized as their
    weights load); ValueError naming the folder when it is not one, or a tensor is missing."""
    folder = DrafterFolder.read(path, target_config, model_name, quantization)
    drafter = folder.drafter_cls(folder.config, folder.target_hidden_size, parallel=parallel, backend=backend)
    plan = folder.quantization
    quantized = [] if plan is None else quantize_model(drafter, plan, backend, compute_dtype)
    filled = drafter.load_weights(safetensors_weights(path))
    missing = sorted({name for name, _ in drafter.named_parameters()} - filled)
    if "d2t" not in filled and drafter.draft_vocab_size != target_config.vocab_size:
        missing.append("d2t")
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks {missing}")
    aux_layers = folder.drafter_cls.aux_layers(folder.config, target_config.num_hidden_layers)
    return LoadedDrafter(drafter, aux_layers, quantized)


class AuxHiddenStates:
    """The target's residual stream at the input of three of its layers, kept from its latest
    forward by pre-hooks on those layers (each row's hidden + residual, as vLLM collects them).
    `token_rows`: where that forward's tokens lie among its rows (a verify graph pads each request to
    1 + k rows: GraphRunner.token_rows), None when they lead them."""

    def __init__(self, layers: list[nn.Module], token_rows: Callable[[], list[int] | None]) -> None:
        self._latest: list[torch.Tensor | None] = [None] * len(layers)
        self._token_rows = token_rows
        self._handles = [layer.register_forward_pre_hook(self._hook(index)) for index, layer in enumerate(layers)]

    def _hook(self, index: int) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def keep(_: nn.Module, args: tuple[Any, ...]) -> None:
            hidden_states, residual = args[0], args[1]
            self._latest[index] = hidden_states if residual is None else hidden_states + residual

        return keep

    def rows(self, rows: list[int]) -> torch.Tensor:
        """[len(rows), 3 x hidden] at the latest target forward's tokens `rows` (the step layout's)."""
        assert all(t is not None for t in self._latest), "no target forward ran yet"
        token_rows = self._token_rows()
        if token_rows is not None:
            rows = [token_rows[row] for row in rows]
        return torch.cat([take_rows(t, rows) for t in self._latest if t is not None], dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass(slots=True)
class Eagle3Parts:
    """What the engine builds for method eagle3 before the KV cache is sized and the graphs are
    compiled: the drafter (its layers in the worker's cache), the target layers it reads, the hooks
    that keep their hidden states (on the target before any graph traces it), and one line per
    quantized layer kind of the drafter (describe_quantized_layers; none unquantized)."""

    drafter: Any  # the family's drafter class: its package's eagle3_drafter_cls
    aux_layers: tuple[int, int, int]
    aux: AuxHiddenStates
    quantized_kinds: list[str]

    @classmethod
    def attach(cls, path: str, model: CausalLM, worker: Any, model_name: str, quantization: str = "") -> Eagle3Parts:
        """Load the drafter at `path` into `worker` (ModelWorker.add_draft_module) beside `model`,
        quantized at load by `quantization` (speculative_config.quantization's schemes)."""
        loaded: list[LoadedDrafter] = []

        def build(parallel: ModelParallel, backend: Backend) -> nn.Module:
            drafter = load_eagle3_drafter(
                path,
                model.config,
                model_name,
                parallel=parallel,
                backend=backend,
                quantization=quantization,
                compute_dtype=worker.dtype,
            )
            loaded.append(drafter)
            return drafter.module

        drafter = worker.add_draft_module("eagle3", build)
        aux_layers = loaded[0].aux_layers
        layers = [model.model.layers[index] for index in aux_layers]

        def token_rows() -> list[int] | None:  # the target's graphs are made after the drafter
            return worker.graph_runner.token_rows if worker.graph_runner is not None else None

        kinds = describe_quantized_layers(drafter, loaded[0].quantized_layers)
        return cls(drafter, aux_layers, AuxHiddenStates(layers, token_rows), kinds)


class Eagle3Proposer(MTPProposer):
    """MTPProposer's passes (the same rows, slots and lock-step idle passes) through the EAGLE-3
    drafter instead of an MTP layer."""

    def __init__(self, model: CausalLM, parts: Eagle3Parts, *args: Any, **kwargs: Any) -> None:
        self.drafter = parts.drafter
        super().__init__(model, *args, **kwargs)
        self.aux_layers = parts.aux_layers
        self.aux = parts.aux

    @property
    def num_draft_layers(self) -> int:
        return 1

    def check_drafter(self, model: CausalLM, config: InferenceConfig) -> None:
        if self.drafter.config.vocab_size != model.config.vocab_size:
            raise ConfigError(
                f"speculative_config.draft_model_path in {config.source}: the EAGLE-3 drafter's vocab_size "
                f"{self.drafter.config.vocab_size} differs from the target's {model.config.vocab_size}"
            )

    def first_pass_hidden(self, context: ProposalContext, rows: list[int]) -> torch.Tensor:
        return self.drafter.combine_hidden_states(self.aux.rows(rows))

    @property
    def embedding(self) -> nn.Module:
        """The drafter's token embedding: its checkpoint's own, else the target's."""
        return self.drafter.embed_tokens if self.drafter.embed_tokens is not None else self.model.model.embed_tokens

    def eager_pass(
        self, layer: int, inputs: ModelInputs, previous_hidden: torch.Tensor, with_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = self.drafter(
            self.embedding(inputs.input_ids), inputs.positions, previous_hidden, inputs.forward_metadata
        )
        return hidden, self.drafter.compute_logits(hidden, inputs.logits_indices) if with_logits else None

    def draft_token_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter.target_token_ids(draft_ids)

    def make_graph_runners(self, hidden_size: int, dtype: torch.dtype, make_runner: RunnerFactory) -> list[GraphRunner]:
        """One runner for the drafter: verify buckets of 1 + k tokens per request for its first pass
        after a verify step, decode buckets for the chain (fc stays outside, on the first pass's rows)."""
        step = Eagle3Step(self.drafter, self.embedding)
        return [make_runner(step, 1 + self.num_speculative_tokens, ((hidden_size, dtype),), "eagle3-")]


class Eagle3Step(MTPStep):
    """What a drafter bucket's graph holds: MTPStep's, with the embedding of the step's tokens and the
    drafter's layer as the pass, its LM head over the draft vocabulary as the logits."""

    def __init__(self, drafter: nn.Module, embedding: nn.Module) -> None:
        super().__init__(drafter, 0)
        self.embedding = embedding

    def draft_forward(self, input_ids: torch.Tensor, *inputs: Any) -> torch.Tensor:
        return self.model(self.embedding(input_ids), *inputs)

    def draft_logits(self, hidden_states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states, rows)
