"""ExecutionEngine (cann-recipes' name): builds what a run steps with, and hands it the EngineCore.

The constructor does the whole build, in cann-recipes' order, so nothing is half-built after it:
the platform, the process groups (CommManager), the backend record (ops/backend.py) and the
ModelWorker; then the weights and the tokenizer, a warm-up that sizes the KV cache
(kv_cache_sizing), the graphs, the proposer, the ModelRunner (whose execute(batch) is a step) and
last the EngineCore (scheduler and runner), which both entries drive.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from executor.core.config import ConfigError, InferenceConfig
from executor.core.config.comm_manager import CommManager, DistEnv
from executor.core.config.inference_config import check_device_rules
from executor.core.config.model_registry import resolve_model
from executor.core.config.parallel_layout import ParallelLayout, num_experts_of
from executor.core.engine.context_parallel import ContextParallelForward, layers_without_context_parallel
from executor.core.engine.engine_core import EngineCore, StepTimer
from executor.core.engine.graph_factory import GraphFactory
from executor.core.engine.kv_cache_sizing import size_kv_cache
from executor.core.engine.model_runner import ModelRunner
from executor.core.kv_cache import KVCacheManager, cdiv
from executor.core.model_worker import ModelWorker
from executor.core.sampler import Sampler
from executor.core.sampler.constraints import LogitsConstraints
from executor.core.sampler.structured_output import StructuredOutputCompiler
from executor.core.scheduler import Scheduler, SchedulerLimits
from executor.core.spec_decode.eagle3 import Eagle3Parts
from executor.core.spec_decode.factory import DraftParts, draft_model_config, make_proposer
from executor.core.spec_decode.mtp import MTPProposer
from executor.core.spec_decode.proposer import LockStep, Proposer, drafting_proposer
from executor.model_loader.default_model import expand_home_vars
from executor.model_loader.hf_config import load_hf_config
from executor.model_loader.quantization_config import quantization_request, read_quantization
from executor.platform import create_platform, resolve_dtype
from executor.platform.host_allocator import keep_freed_host_memory
from executor.types_ import Request, SamplingParams
from ops.backend import make_backend

logger = logging.getLogger(__name__)


class ExecutionEngine:
    def __init__(self, config: InferenceConfig, model_path: str, comm: CommManager | None = None) -> None:
        """`comm`: the groups of the run (a draft model's engine shares its target's); built here when None."""
        self.config = config
        env = comm.env if comm is not None else DistEnv.from_environ()
        self.platform = create_platform(config.model_config.device, env.local_rank)
        check_device_rules(config, self.platform.device_type)
        if self.platform.device_type == "cpu" and keep_freed_host_memory():
            logger.debug("host allocator: freed memory kept for reuse (glibc mmap and trim off)")
        parallel = config.parallel_config
        self.comm = comm or CommManager(
            ParallelLayout.from_config(parallel), env, self.platform.dist_backend, parallel.collective_timeout_s
        )
        self.dtype = resolve_dtype(config.model_config.dtype, self.platform.device_type)
        model_config = config.model_config
        self.backend = make_backend(
            self.platform.device_type,
            model_config.exe_mode,
            self.dtype,
            prepack_weights=model_config.prepack_weights,
            wna16_activations=model_config.wna16_activations,
        )
        self.metadata_builder = self.backend.metadata_builder(self.platform.device)
        self.host_metadata_builder = self.backend.metadata_builder(torch.device("cpu"))  # graph steps stage here
        self.step_timer = self._make_step_timer()
        self.worker = ModelWorker(
            self.platform,
            self.dtype,
            config.model_config.with_ckpt,
            seed=config.data_config.seed,
            parallel=self.comm.model_parallel(),
            backend=self.backend,
        )
        self.sampler = Sampler(config.data_config.seed, self.platform.device, self.backend.argmax_rows)
        logger.info("platform %s, dtype %s (%s)", self.platform.device, config.model_config.dtype, self.dtype)
        model_cls, config_cls = resolve_model(model_config.model_name)
        hf_config = load_hf_config(config_cls, model_path, model_config.custom_params)
        self.max_model_len = self._resolve_max_model_len(hf_config.max_position_embeddings)  # before the weights
        self.max_blocks_per_request = cdiv(self.max_model_len, config.scheduler_config.block_size)
        self.vocab_size: int = hf_config.vocab_size
        self.hidden_size: int = hf_config.hidden_size
        # Model groups spanning data-parallel replicas: non-empty, the replicas step in lock-step.
        self.lock_step_kinds = self.comm.layout.lock_step_kinds(has_experts=num_experts_of(hf_config) > 0)
        # Whether every data-parallel replica must run a forward at every step (docs/distributed.md);
        # a plain attribute, as the step loop reads it at every step.
        self.lock_step = bool(self.lock_step_kinds)
        if self.lock_step_kinds:
            logger.info(
                "lock-step data parallelism: %s span the %d replicas, so every replica runs a forward at every step",
                ", ".join(self.lock_step_kinds),
                self.comm.layout.attn_dp_size,
            )
        request = quantization_request(model_config)
        quantization = read_quantization(hf_config, request, f"{model_path}/config.json")
        self.worker.init(model_cls, hf_config, model_path, quantization, before_load=self._check_context_parallel)
        self._check_speculation_with_states()
        self.eagle3 = self._attach_eagle3()  # its attention's K/V goes in the pool sized below
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = self._collect_eos_token_ids(model_path)
        # grammars compile against the tokenizer (requests are checked with it when made, docs/sampling.md)
        self.structured_output = StructuredOutputCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.graphs = self._make_graph_factory()  # None in eager mode
        self.kv_cache_manager = size_kv_cache(
            config,
            self.worker,
            self.platform,
            self.comm,
            self.max_model_len,
            warm_up=self._warm_up,
            measure_graph_memory=self.graphs.measure_memory if self.graphs is not None else lambda: 0,
        )
        graph_runner = self.graphs.runner() if self.graphs is not None else None
        draft = self._make_draft_engine()
        if graph_runner is not None:
            self.worker.init_graphs(graph_runner)
        self.runner = self._make_runner(self.kv_cache_manager, self._make_proposer(draft))
        self.core = EngineCore(self._make_scheduler(self.kv_cache_manager), self.runner, self.step_timer)

    def _make_step_timer(self) -> StepTimer:
        """The timer the scheduler shares: with model_config.step_breakdown (null: on where it is free,
        the CPU), each part of a step is timed, waiting for an asynchronous device at each mark."""
        asynchronous = self.platform.device_type != "cpu"
        breakdown = self.config.model_config.step_breakdown
        return StepTimer(
            breakdown=not asynchronous if breakdown is None else breakdown,
            synchronize=self.platform.synchronize if asynchronous else None,
        )

    def _make_graph_factory(self) -> GraphFactory | None:
        """The engine's graph runners' maker in a graph mode (one compiler for all), None in eager mode."""
        compiler = GraphFactory.make_compiler(
            self.config, self.backend, self.platform, self.comm, self.dtype, self.max_blocks_per_request
        )
        if compiler is None:
            return None
        return GraphFactory(
            self.config,
            self.platform,
            self.worker,
            self.comm,
            compiler,
            self.metadata_builder,
            self.host_metadata_builder,
            self.max_blocks_per_request,
            self.step_timer,
            self.lock_step,
        )

    def _check_context_parallel(self, model: torch.nn.Module) -> None:
        """Under context parallel, before any weight is read: every cache layer must take a step's
        tokens in shares (full and sliding-window attention, MLA and DSA do)."""
        cp_size = self.config.parallel_config.cp_size
        lacking = layers_without_context_parallel(model) if cp_size > 1 else []
        if lacking:
            raise ConfigError(
                f"parallel_config.cp_size {cp_size} in {self.config.source}: context parallel is not built for this "
                f"model's caches ({', '.join(lacking)}: recurrent state or compressed KV); set cp_size 1"
            )

    def _check_speculation_with_states(self) -> None:
        """Speculative decoding with recurrent states needs every recurrent layer to keep the state
        after each position of a verify step (in the request's 1 + k slots, as cann-recipes keeps
        1 + next_n), so that the accepted prefix's state survives; refused where a layer does not."""
        method, _ = self.config.speculation
        lacking = sorted(
            {
                type(layer).__name__
                for layer in self.worker.kv_cache_layers.values()
                if layer.kv_cache_spec().is_recurrent and not getattr(layer, "keeps_position_states", False)
            }
        )
        if method and lacking:
            raise ConfigError(
                f"speculative decoding ({method}) is not supported for this model: its linear-attention layers "
                f"({', '.join(lacking)}) do not keep their recurrent state after every draft position; "
                f"turn speculative_config / model_config.next_n off ({self.config.source})"
            )

    def _make_scheduler(self, kv_cache_manager: KVCacheManager) -> Scheduler:
        """The run's scheduler over `kv_cache_manager`, with the configured limits."""
        config = self.config
        proposer = self.runner.proposer
        return Scheduler(
            SchedulerLimits(
                config.scheduler_config.batch_size,
                config.prefill_token_budget,
                self.max_model_len,
                config.max_prefill_requests,
            ),
            kv_cache_manager,
            self.eos_token_ids,
            num_lookahead_tokens=proposer.num_lookahead_tokens if proposer is not None else 0,
        )

    def _resolve_max_model_len(self, model_limit: int) -> int:
        requested = self.config.scheduler_config.max_model_len
        if requested > model_limit:
            raise ConfigError(
                f"scheduler_config.max_model_len {requested} exceeds the model's max_position_embeddings "
                f"{model_limit} ({self.config.source})"
            )
        return requested or model_limit

    def _collect_eos_token_ids(self, model_path: str) -> set[int]:
        """EOS ids from the tokenizer and, when present, generation_config.json."""
        eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        try:
            generation_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except OSError:
            generation_eos = None
        if generation_eos is not None:
            eos.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
        return eos

    def _make_runner(self, kv_cache_manager: KVCacheManager, proposer: Proposer | None = None) -> ModelRunner:
        return ModelRunner(
            self.worker,
            self.sampler,
            kv_cache_manager.layout,
            self.metadata_builder,
            self.step_timer,
            device=self.platform.device,
            max_blocks_per_request=self.max_blocks_per_request,
            lock_step_kinds=self.lock_step_kinds,
            proposer=proposer,
            context_parallel=self._context_parallel_forward(),
            constraints=LogitsConstraints(self.structured_output),
        )

    def _context_parallel_forward(self) -> ContextParallelForward | None:
        """The forward of a prefill step split over the CP group; it gathers every row's hidden
        state for MTP, whose pass after the step reads them all."""
        group = self.comm.groups["cp"]
        if group.size == 1:
            return None
        return ContextParallelForward(group, self.metadata_builder, every_row=self.config.speculation[0] == "mtp")

    def _make_draft_engine(self) -> DraftParts | None:
        """With method draft_model, the draft model's engine (its runner, KV cache and lock-step), else None."""
        if self.config.speculation[0] != "draft_model":
            return None
        draft_config = draft_model_config(self.config)
        engine = ExecutionEngine(draft_config, draft_config.model_config.model_path, comm=self.comm)
        if engine.vocab_size != self.vocab_size:
            raise ConfigError(
                f"speculative_config.draft_model_path in {self.config.source}: the draft model's vocabulary "
                f"({engine.vocab_size}) differs from the target's ({self.vocab_size}); it needs the same tokenizer"
            )
        return DraftParts(engine.runner, engine.kv_cache_manager, engine.proposer_lock_step())

    def _attach_eagle3(self) -> Eagle3Parts | None:
        """Method eagle3: the drafter at speculative_config.draft_model_path, loaded beside the target
        (and the hooks that read the target's three layers, set before any graph traces them)."""
        if self.config.speculation[0] != "eagle3":
            return None
        assert self.worker.model is not None
        path = str(Path(expand_home_vars(self.config.speculative_config.draft_model_path)).expanduser())
        try:
            parts = Eagle3Parts.attach(
                path,
                self.worker.model,
                self.worker,
                self.config.model_config.model_name,
                self.config.speculative_config.quantization,
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"speculative_config.draft_model_path in {self.config.source}: {exc}") from None
        logger.info(
            "speculative decoding: EAGLE-3 drafter from %s (draft vocabulary %d), reading target layers %s",
            path,
            parts.drafter.draft_vocab_size,
            list(parts.aux_layers),
        )
        for line in parts.quantized_kinds:
            logger.info("quantized drafter linears %s", line)
        return parts

    def _make_proposer(self, draft: DraftParts | None) -> Proposer | None:
        """The run's proposer; `draft`: the draft model's engine's parts (_make_draft_engine)."""
        assert self.worker.model is not None
        proposer = make_proposer(
            self.config,
            self.worker.model,
            self.kv_cache_manager,
            self.metadata_builder,
            self.max_blocks_per_request,
            self.comm,
            self.backend.argmax_rows,
            self.proposer_lock_step(),
            draft,
            self.eagle3,
        )
        if proposer is not None:
            logger.info("speculative decoding: proposer %s, %d draft tokens per step", *self.config.speculation)
        mtp = drafting_proposer(proposer)
        if isinstance(mtp, MTPProposer) and self.graphs is not None:  # MTP's layers or EAGLE-3's drafter
            mtp.graph_runners = mtp.make_graph_runners(self.hidden_size, self.dtype, self.graphs.mtp_runner)
            with torch.inference_mode():
                for runner in mtp.graph_runners:
                    runner.warm_up()
        return proposer

    def graph_stats(self) -> dict[str, object] | None:
        """The summary's `graph` entry: the target's graphs, and the drafter's under the method's name
        (`mtp`: by MTP layer, `eagle3`: the drafter's); None in eager mode."""
        if self.worker.graph_runner is None:
            return None
        stats = self.worker.graph_runner.stats()
        proposer = drafting_proposer(self.runner.proposer)
        if isinstance(proposer, MTPProposer) and proposer.graph_runners:
            method = self.config.speculation[0]
            stats[method] = {runner.name.rstrip("-"): runner.stats() for runner in proposer.graph_runners}
        return stats

    def proposer_lock_step(self) -> LockStep | None:
        """How a proposer's forwards on this engine's model keep in lock-step; None when its groups
        do not span the replicas (docs/distributed.md, "Speculation across processes")."""
        if not self.lock_step:
            return None
        return LockStep(self.comm.max_over_world, joins_lm_head="lmhead_tp" in self.lock_step_kinds)

    def _warm_up(self, probe: KVCacheManager, num_tokens: int) -> None:
        """One dummy prefill and one decode step on the probe cache, so first-call costs stay out of
        the step log: a core of its own on the probe, which logs nothing, runs one request of
        `num_tokens` tokens and two new ones."""
        runner = self._make_runner(probe)
        limits = SchedulerLimits(1, num_tokens, self.max_model_len)
        core = EngineCore(Scheduler(limits, probe, set()), runner)
        core.add_request(Request("warm-up", None, [0] * num_tokens, SamplingParams(max_new_tokens=2)))
        while core.has_work():
            core.step()
