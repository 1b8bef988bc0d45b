"""GraphFactory: an engine's graph runners in a graph mode (ge_graph, npugraph_ex; inductor on
CPU/CUDA), all compiled by one compiler: the target's decode and verify buckets, the MTP layers'
passes, and the probe bucket that measures their memory before the KV cache is sized."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from executor.core.config import InferenceConfig
from executor.core.config.comm_manager import CommManager
from executor.core.model_worker import ModelWorker
from executor.core.model_worker.graph_runner import GraphRunner, StepMarks
from executor.platform.compile_cache import CompileCache
from executor.platform.graph_compilers import GraphCompiler
from executor.platform.platform import Platform
from executor.utils.graph_buckets import resolve_buckets
from ops.attention.metadata import AttentionMetadataBuilder
from ops.backend import Backend

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GraphFactory:
    config: InferenceConfig
    platform: Platform
    worker: ModelWorker
    comm: CommManager
    compiler: GraphCompiler
    metadata_builder: AttentionMetadataBuilder
    host_metadata_builder: AttentionMetadataBuilder  # graph steps stage their inputs here
    max_blocks_per_request: int
    step_timer: StepMarks
    lock_step: bool

    @staticmethod
    def make_compiler(
        config: InferenceConfig,
        backend: Backend,
        platform: Platform,
        comm: CommManager,
        dtype: torch.dtype,
        max_blocks_per_request: int,
    ) -> GraphCompiler | None:
        """The engine's one graph compiler for model_config.exe_mode, or None in eager mode. Its
        graph count is an upper bound on the graphs of all step modules: decode and verify buckets
        of the target and the MTP layers (a draft model's engine compiles its decode buckets under
        our step's code object), and the probe's largest bucket, measured before the run's."""
        if backend.graph_compiler is None:
            return None
        model_config, sched = config.model_config, config.scheduler_config
        method, num_speculative_tokens = config.speculation
        extra = {"mtp": 2 * num_speculative_tokens, "draft_model": 1}.get(method, 0)
        num_graphs = len(resolve_buckets(sched.graph_buckets, sched.batch_size)) * (2 + extra) + 1
        return backend.graph_compiler(
            platform,
            CompileCache.from_config(model_config.enable_cache_compile, model_config.compile_cache_dir),
            num_buckets=num_graphs,
            settings={
                "dtype": dtype,
                "block_size": sched.block_size,
                "max_blocks_per_request": max_blocks_per_request,
                "device": platform.device_type,
                **comm.graph_key_settings(),
            },
            static_kernel=model_config.enable_static_kernel,
            cpp_wrapper=model_config.graph_cpp_wrapper,
        )

    def runner(
        self,
        buckets: list[int] | None = None,
        *,
        step: torch.nn.Module | None = None,
        tokens_per_verify_row: int | None = None,
        row_inputs: tuple[tuple[int, torch.dtype], ...] = (),
        name: str = "",
    ) -> GraphRunner:
        """A graph runner over `buckets` (default: the configured ones): the target's decode step
        (and with speculative decoding its verify step of 1 + k tokens per request) unless `step`
        is given (an MTP layer's, with its `tokens_per_verify_row` and `row_inputs`)."""
        sched = self.config.scheduler_config
        buckets = buckets or resolve_buckets(sched.graph_buckets, sched.batch_size)
        method, num_speculative_tokens = self.config.speculation
        if tokens_per_verify_row is None:
            tokens_per_verify_row = 1 + num_speculative_tokens if method else 1
        assert self.worker.model is not None
        return GraphRunner(
            self.worker.model,
            self.compiler,
            buckets,
            self.metadata_builder,
            self.host_metadata_builder,
            num_cache_groups=len(self.worker.kv_cache_groups),
            max_blocks_per_request=self.max_blocks_per_request,
            pin_host_buffers=self.platform.device_type != "cpu",
            step_timer=self.step_timer if step is None else None,
            state_groups=self.worker.state_groups(),
            agree_shape=self.comm.max_each_over_world if self.lock_step else None,
            tokens_per_verify_row=tokens_per_verify_row,
            step=step,
            row_inputs=row_inputs,
            name=name,
        )

    def mtp_runner(
        self,
        step: torch.nn.Module,
        tokens_per_verify_row: int,
        row_inputs: tuple[tuple[int, torch.dtype], ...],
        name: str,
    ) -> GraphRunner:
        """An MTP layer's graph runner (spec_decode/mtp_graphs.py calls it per layer and pass)."""
        return self.runner(step=step, tokens_per_verify_row=tokens_per_verify_row, row_inputs=row_inputs, name=name)

    def measure_memory(self) -> int:
        """Device bytes the graphs take, measured at the largest bucket on the probe cache (CUDA,
        NPU; 0 where the platform reports no memory), so that the KV cache is sized from what is left."""
        if self.platform.memory_info_bytes() is None:
            return 0
        sched = self.config.scheduler_config
        largest = resolve_buckets(sched.graph_buckets, sched.batch_size)[-1]
        free_before = self.platform.memory_info_bytes()[0]
        runner = self.runner([largest])
        with torch.inference_mode():
            runner.warm_up()
        graph_bytes = max(0, free_before - self.platform.memory_info_bytes()[0])
        del runner
        self.platform.empty_cache()
        logger.info("graphs and activations at bucket %d take %.0f MiB", largest, graph_bytes / 2**20)
        return graph_bytes
