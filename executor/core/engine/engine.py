"""ExecutionEngine: turns a scheduled Batch into packed inputs, runs the worker, samples.

Built in two phases, as in cann-recipes: the constructor readies the platform, the process groups
(CommManager) and an empty ModelWorker; init() loads weights and the tokenizer, warms up and sizes
the KV cache (the smallest pool any rank can hold, so that all ranks schedule alike).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

from executor.core.config import ConfigError, InferenceConfig
from executor.core.config.comm_manager import CommManager, DistEnv
from executor.core.config.inference_config import check_device_rules
from executor.core.config.parallel_layout import ParallelLayout, num_experts_of
from executor.core.engine.kv_cache_sizing import host_available_bytes, plan_num_blocks
from executor.core.engine.step_inputs import ScheduledSequence, build_step_layout
from executor.core.kv_cache import KVCacheManager, cdiv
from executor.core.model_worker import ModelWorker
from executor.core.model_worker.graph_runner import GraphRunner
from executor.core.sampler import Sampler, SamplingMetadata
from executor.core.sampler.noise import token_seed
from executor.core.spec_decode.factory import make_proposer
from executor.core.spec_decode.proposer import ProposalContext, Proposer
from executor.core.spec_decode.verify import accept_greedy, rejection_sample
from executor.model_loader.hf_config import load_hf_config
from executor.platform import create_platform, resolve_dtype
from executor.platform.compile_cache import CompileCache
from executor.types_ import Batch, Request, SamplingParams
from executor.types_.model_inputs import StepLayout
from executor.utils.graph_buckets import resolve_buckets
from executor.utils.step_timer import StepTimer
from ops.attention_metadata import to_device
from ops.backend import make_backend

logger = logging.getLogger(__name__)

WARM_UP_PROMPT_TOKENS = 16


class ExecutionEngine:
    def __init__(self, config: InferenceConfig, comm: CommManager | None = None) -> None:
        """`comm`: the groups of the run (a draft model's engine shares its target's); built here when None."""
        self.config = config
        env = comm.env if comm is not None else DistEnv.from_environ()
        self.platform = create_platform(config.model_config.device, env.local_rank)
        check_device_rules(config, self.platform.device_type)
        parallel = config.parallel_config
        self.comm = comm or CommManager(
            ParallelLayout.from_config(parallel), env, self.platform.dist_backend, parallel.collective_timeout_s
        )
        self.dtype = resolve_dtype(config.model_config.dtype, self.platform.device_type)
        model_config = config.model_config
        self.backend = make_backend(
            self.platform.device_type, model_config.exe_mode, self.dtype, prepack_weights=model_config.prepack_weights
        )
        self.metadata_builder = self.backend.metadata_builder(self.platform.device)
        self.host_metadata_builder = self.backend.metadata_builder(torch.device("cpu"))  # graph steps stage here
        self.step_timer = self._make_step_timer()
        self.worker = ModelWorker(
            self.platform,
            self.dtype,
            config.model_config.with_ckpt,
            seed=config.data_config.seed,
            step_timer=self.step_timer,
            parallel=self.comm.model_parallel(),
            backend=self.backend,
        )
        self.sampler = Sampler(config.data_config.seed, self.platform.device)
        self.tokenizer: Any = None
        self.kv_cache_manager: KVCacheManager | None = None
        self.max_model_len = 0
        self.max_blocks_per_request = 0
        self.vocab_size = 0
        self.eos_token_ids: set[int] = set()
        self.proposer: Proposer | None = None
        # Model groups spanning data-parallel replicas (set by init): non-empty, the replicas step in lock-step.
        self.lock_step_kinds: list[str] = []
        logger.info("platform %s, dtype %s (%s)", self.platform.device, config.model_config.dtype, self.dtype)

    def _make_step_timer(self) -> StepTimer:
        """The timer the scheduler shares: with model_config.step_breakdown (null: on where it is free,
        the CPU), each part of a step is timed, waiting for an asynchronous device at each mark."""
        asynchronous = self.platform.device_type != "cpu"
        breakdown = self.config.model_config.step_breakdown
        return StepTimer(
            breakdown=not asynchronous if breakdown is None else breakdown,
            synchronize=self.platform.synchronize if asynchronous else None,
        )

    def init(self, model_cls: type[torch.nn.Module], config_cls: Any, model_path: str) -> None:
        hf_config = load_hf_config(config_cls, model_path, self.config.model_config.custom_params)
        self.max_model_len = self._resolve_max_model_len(hf_config.max_position_embeddings)  # before the weights
        self.vocab_size = hf_config.vocab_size
        self.lock_step_kinds = self.comm.layout.lock_step_kinds(has_experts=num_experts_of(hf_config) > 0)
        if self.lock_step_kinds:
            logger.info(
                "lock-step data parallelism: %s span the %d replicas, so every replica runs a forward at every step",
                ", ".join(self.lock_step_kinds),
                self.comm.layout.attn_dp_size,
            )
        self.worker.init(model_cls, hf_config, model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = self._collect_eos_token_ids(model_path)
        self._init_kv_cache()
        graph_runner = self._make_graph_runner()
        if graph_runner is not None:
            self.worker.init_graphs(graph_runner)
        self.proposer = make_proposer(self)

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

    def _init_kv_cache(self) -> None:
        """Warm up on a small probe cache, then size the real one from the memory left after the
        weights and the warm-up (device memory on CUDA/NPU, MemAvailable on CPU), or from
        scheduler_config.num_blocks."""
        sched = self.config.scheduler_config
        groups = self.worker.kv_cache_groups
        self.max_blocks_per_request = cdiv(self.max_model_len, sched.block_size)
        warm_up_tokens = min(WARM_UP_PROMPT_TOKENS, self.max_model_len - 1)
        self._bind_kv_cache(len(groups) * cdiv(warm_up_tokens + 1, sched.block_size) + 1)
        self._warm_up(warm_up_tokens)
        graph_bytes = self._measure_graph_memory()
        self._bind_kv_cache(0)  # drop the probe before measuring what the real cache may take
        memory = self.platform.memory_info_bytes()
        free_bytes = (memory[0] - graph_bytes) if memory is not None else host_available_bytes()
        bytes_per_block = self.worker.kv_cache_bytes_per_block(sched.block_size)
        num_blocks = plan_num_blocks(
            num_blocks=sched.num_blocks,
            bytes_per_block=bytes_per_block,
            max_blocks_in_use=sched.batch_size * self.max_blocks_per_request * len(groups),
            free_memory_bytes=free_bytes,
            mem_fraction_static=sched.mem_fraction_static,
        )
        num_blocks = self.comm.min_over_world(num_blocks)
        blocks_per_request = len(groups) * self.max_blocks_per_request
        if num_blocks - 1 < blocks_per_request:
            source = (
                f"num_blocks {sched.num_blocks}"
                if sched.num_blocks
                else (f"{free_bytes / 2**30:.2f} GiB free x mem_fraction_static {sched.mem_fraction_static}")
            )
            raise ConfigError(
                f"the KV cache budget ({source}: {num_blocks - 1} usable blocks of {sched.block_size} tokens) cannot "
                f"hold one request of max_model_len {self.max_model_len}, which needs {blocks_per_request} blocks "
                f"over {len(groups)} cache group(s); raise the budget or lower scheduler_config.max_model_len "
                f"({self.config.source})"
            )
        self._bind_kv_cache(num_blocks)
        self._log_kv_cache(num_blocks, blocks_per_request)

    def _bind_kv_cache(self, num_blocks: int) -> None:
        """Allocate and bind `num_blocks` blocks (none: release the cache) and a manager over them."""
        sched = self.config.scheduler_config
        self.worker.init_kv_cache(num_blocks, sched.block_size)
        self.kv_cache_manager = (
            KVCacheManager(
                num_blocks,
                sched.block_size,
                [group.spec for group in self.worker.kv_cache_groups],
                sched.enable_prefix_caching,
            )
            if num_blocks
            else None
        )

    def _log_kv_cache(self, num_blocks: int, blocks_per_request: int) -> None:
        block_size = self.config.scheduler_config.block_size
        per_group = ", ".join(
            f"group {i} ({group.spec.kind.value}, {len(group.layer_names)} layers): "
            f"{group.spec.bytes_per_token * len(group.layer_names)} B/token"
            for i, group in enumerate(self.worker.kv_cache_groups)
        )
        total_mib = num_blocks * self.worker.kv_cache_bytes_per_block(block_size) / 2**20
        logger.info(
            "KV cache: %d blocks of %d tokens (block 0 reserved), %.0f MiB; %s; holds %d tokens per group, "
            "%d request(s) of max_model_len %d at once",
            num_blocks,
            block_size,
            total_mib,
            per_group,
            (num_blocks - 1) // len(self.worker.kv_cache_groups) * block_size,
            (num_blocks - 1) // blocks_per_request,
            self.max_model_len,
        )

    def _make_graph_runner(self, buckets: list[int] | None = None) -> GraphRunner | None:
        """The graph runner of model_config.exe_mode over `buckets` (default: the configured ones),
        or None in eager mode."""
        model_config, sched = self.config.model_config, self.config.scheduler_config
        buckets = buckets or resolve_buckets(sched.graph_buckets, sched.batch_size)
        if self.backend.graph_compiler is None:
            return None
        compiler = self.backend.graph_compiler(
            self.platform,
            CompileCache.from_config(model_config.enable_cache_compile, model_config.compile_cache_dir),
            num_buckets=len(buckets),
            settings={
                "dtype": self.dtype,
                "block_size": sched.block_size,
                "max_blocks_per_request": self.max_blocks_per_request,
                "device": self.platform.device_type,
            },
            static_kernel=model_config.enable_static_kernel,
        )
        assert self.worker.model is not None
        return GraphRunner(
            self.worker.model,
            compiler,
            buckets,
            self.metadata_builder,
            self.host_metadata_builder,
            num_cache_groups=len(self.worker.kv_cache_groups),
            max_blocks_per_request=self.max_blocks_per_request,
            pin_host_buffers=self.platform.device_type != "cpu",
            step_timer=self.step_timer,
        )

    def _measure_graph_memory(self) -> int:
        """Device bytes the graphs take, measured at the largest bucket on the probe cache (graph
        modes on CUDA/NPU; 0 elsewhere), so that the KV cache is sized from what is left."""
        if self.config.model_config.exe_mode == "eager" or self.platform.memory_info_bytes() is None:
            return 0
        sched = self.config.scheduler_config
        largest = resolve_buckets(sched.graph_buckets, sched.batch_size)[-1]
        free_before = self.platform.memory_info_bytes()[0]
        runner = self._make_graph_runner([largest])
        assert runner is not None
        with torch.inference_mode():
            runner.warm_up()
        graph_bytes = max(0, free_before - self.platform.memory_info_bytes()[0])
        del runner
        self.platform.empty_cache()
        logger.info("graphs and activations at bucket %d take %.0f MiB", largest, graph_bytes / 2**20)
        return graph_bytes

    def _warm_up(self, num_tokens: int) -> None:
        """One dummy prefill and one decode step, so first-call costs stay out of the step log."""
        assert self.kv_cache_manager is not None
        request = Request("warm-up", None, [0] * num_tokens, SamplingParams(max_new_tokens=2))
        for batch in (Batch([request], [num_tokens], is_prefill=True), Batch([request], [1], is_prefill=False)):
            allocated = self.kv_cache_manager.allocate_slots(request, batch.total_tokens)
            assert allocated is not None, "the probe cache is sized for the warm-up request"
            (new_tokens,) = self.forward_batch(batch)
            request.num_computed_tokens += batch.total_tokens
            request.output_token_ids.extend(new_tokens)
        self.kv_cache_manager.free(request)

    def forward_batch(self, batch: Batch) -> list[list[int]]:
        """Run one step for `batch`; the new token ids of each request (none for a prompt chunk
        that does not reach the end of its prompt; with drafts, the accepted ones and one more).
        With speculative decoding on, each request's drafts for its next step are left in
        `request.spec_token_ids`."""
        sequences = self._schedule_sequences(batch)
        layout = build_step_layout(
            sequences,
            block_size=self.config.scheduler_config.block_size,
            max_blocks_per_request=self.max_blocks_per_request,
        )
        timer = self.step_timer
        timer.mark("prepare")
        hidden_states, all_logits = self.worker.execute(layout, self.metadata_builder)  # marks h2d
        if not layout.logits_indices:
            self._join_lm_head_without_rows(hidden_states)
            timer.mark("forward")
            return [[] for _ in sequences]
        logits_indices = to_device(layout.logits_indices, torch.int64, self.platform.device)
        logits = (
            all_logits[logits_indices]
            if all_logits is not None
            else self.worker.compute_logits(hidden_states, logits_indices)
        )
        timer.mark("forward")
        requests_per_row = [
            request for request, seq in zip(batch.requests, sequences, strict=True) for _ in range(seq.num_sampled_rows)
        ]
        row_token_ids = self._sample(logits, requests_per_row)
        new_token_ids: list[list[int]] = []
        row = 0
        for index, seq in enumerate(sequences):
            rows = row_token_ids[row : row + seq.num_sampled_rows]
            drafts = batch.drafts_of(index)
            if drafts:
                rows = self._verify(batch.requests[index], drafts, rows, logits[row : row + seq.num_sampled_rows])
            new_token_ids.append(rows)
            row += seq.num_sampled_rows
        timer.mark("sample")
        if self.proposer is not None:
            self._propose(batch, sequences, new_token_ids, hidden_states, layout)
            timer.mark("propose")
        return new_token_ids

    @property
    def lock_step(self) -> bool:
        """Whether every data-parallel replica must run a forward at every step (docs/distributed.md)."""
        return bool(self.lock_step_kinds)

    def idle_forward(self) -> None:
        """Lock-step data parallelism: the step of a replica with nothing to run, so that the groups it
        shares with busy replicas meet in every collective. One padding token (id 0, position 0) whose
        K/V goes to slot 0 of the null block 0, where padded rows write and which no request reads;
        its hidden state and logits are dropped. Not a step of the run: nothing is scheduled."""
        null_blocks = [[0]] * len(self.worker.kv_cache_groups)
        layout = build_step_layout(
            [ScheduledSequence(token_ids=[0], num_computed_tokens=0, block_ids=null_blocks, num_sampled_rows=0)],
            block_size=self.config.scheduler_config.block_size,
            max_blocks_per_request=self.max_blocks_per_request,
        )
        hidden_states, _ = self.worker.execute(layout, self.metadata_builder)
        self._join_lm_head_without_rows(hidden_states)

    def _join_lm_head_without_rows(self, hidden_states: torch.Tensor) -> None:
        """A step that samples no row still joins the LM head's collectives when its group spans
        replicas (another replica may sample in this step)."""
        if "lmhead_tp" in self.lock_step_kinds:
            self.worker.compute_logits(hidden_states, torch.empty(0, dtype=torch.int64, device=hidden_states.device))

    def _verify(self, request: Request, drafts: list[int], row_token_ids: list[int], logits: torch.Tensor) -> list[int]:
        """What a request emits from its verify rows: the greedy prefix match, or rejection sampling
        for a random request (its generator seeded by its seed and output index, as its sampled
        tokens are); logprobs of the rows past what it emits are dropped."""
        if request.sampling_params.is_greedy:
            emitted = accept_greedy(drafts, row_token_ids)
        else:
            probs = self.sampler.probabilities(logits, SamplingMetadata.build([request] * len(logits), logits.device))
            seed = request.sampling_params.seed
            generator = None
            if seed is not None:
                generator = torch.Generator(logits.device).manual_seed(token_seed(seed, len(request.output_token_ids)))
            emitted = rejection_sample(probs, drafts, None, generator)
        if request.sampling_params.logprobs is not None:
            del request.output_logprobs[len(request.output_logprobs) - (len(row_token_ids) - len(emitted)) :]
        return emitted

    def _propose(
        self,
        batch: Batch,
        sequences: list[ScheduledSequence],
        new_token_ids: list[list[int]],
        hidden_states: torch.Tensor,
        layout: StepLayout,
    ) -> None:
        assert self.proposer is not None
        num_valid = [
            len(seq.token_ids) - (len(batch.drafts_of(i)) - (len(new) - 1) if batch.drafts_of(i) else 0)
            for i, (seq, new) in enumerate(zip(sequences, new_token_ids, strict=True))
        ]
        context = ProposalContext(
            requests=batch.requests,
            sequences=sequences,
            new_token_ids=new_token_ids,
            num_valid_tokens=num_valid,
            hidden_states=hidden_states,
            row_starts=[0, *layout.query_ends[:-1]],
        )
        for request, drafts in zip(batch.requests, self.proposer.propose(context), strict=True):
            request.spec_token_ids = drafts

    def _schedule_sequences(self, batch: Batch) -> list[ScheduledSequence]:
        assert self.kv_cache_manager is not None
        sequences = []
        for index, (request, num_tokens) in enumerate(zip(batch.requests, batch.num_scheduled_tokens, strict=True)):
            drafts = batch.drafts_of(index)
            start = request.num_computed_tokens
            end = start + num_tokens - len(drafts)  # the request's own tokens; the drafts follow them
            sequences.append(
                ScheduledSequence(
                    token_ids=request.token_ids_between(start, end) + drafts,
                    num_computed_tokens=start,
                    block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
                    num_sampled_rows=1 + len(drafts) if end >= request.num_tokens else 0,
                )
            )
        return sequences

    def _sample(self, logits: torch.Tensor, requests_per_row: list[Request]) -> list[int]:
        """One token per row of logits, each with its request's sampling parameters; the step's one
        host read of the sampled ids (a second brings logprobs back when a request asks for them,
        appended to its output_logprobs)."""
        metadata = SamplingMetadata.build(requests_per_row, logits.device)
        output = self.sampler.sample(logits, metadata)
        token_ids = output.token_ids.tolist()
        if output.logprobs is not None:
            for request, token_logprobs in zip(
                requests_per_row, output.logprobs.per_row(token_ids, metadata.num_logprobs), strict=True
            ):
                if token_logprobs is not None:
                    request.output_logprobs.append(token_logprobs)
        return token_ids
