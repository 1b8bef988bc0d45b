"""What `exe_mode` means on each device: the compiler that turns the decode forward into a graph.

- ge_graph: torch.compile with inductor on CPU and CUDA (one graph per bucket); torchair's GE graph
  (max-autotune) on NPU.
- npugraph_ex: an AOTInductor package per bucket, kept in the compile cache, on CPU; a CUDA graph
  per bucket in one memory pool on CUDA; torch.compile(backend="npugraph_ex"), aclgraph
  capture/replay, on NPU.

A compiler turns a step module (the model's forward and its LM head over every row, for a decode or
a verify step; an MTP layer's forward and its LM head), at one bucket's persistent input buffers,
into a GraphCallable that runs it on those buffers. One compiler serves every step module of an
engine. Everything device-specific is imported lazily.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from executor.platform import npu_runtime
from executor.platform.compile_cache import CompileCache, graph_key
from executor.platform.platform import Platform
from executor.utils.tensor_tree import tensor_leaves, with_tensors

logger = logging.getLogger(__name__)


GraphOutput = tuple[torch.Tensor, torch.Tensor]  # hidden states [rows, hidden], logits [rows, vocab]


class GraphInputs(Protocol):
    """A bucket's buffers (ModelInputs, or the graph runner's StepBuffers): what the step module reads."""

    def forward_args(self) -> tuple[object, ...]: ...


def kv_cache_layers(step: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of `step` that hold KV cache tensors (module.attention.KVCacheLayer and its kinds,
    found by their `kv_caches()` so that this package, below module/, need not import it)."""
    return [m for m in step.modules() if callable(getattr(m, "kv_caches", None))]


@dataclass(frozen=True, slots=True)
class GraphCallable:
    """Runs the decode step on one bucket's buffers; `origin` says how it was made, for the log."""

    fn: Callable[[GraphInputs], GraphOutput]
    origin: str

    def __call__(self, inputs: GraphInputs) -> GraphOutput:
        return self.fn(inputs)


def _forward(step: Callable[..., GraphOutput]) -> Callable[[GraphInputs], GraphOutput]:
    """The step module (or its compiled form) as a function of one step's inputs."""
    return lambda inputs: step(*inputs.forward_args())


def _with_own_code(step: torch.nn.Module) -> types.FunctionType:
    """`step` called through a function whose code object is its alone. Dynamo keeps its graphs on
    the code object of the frame it compiles, so each engine's graphs (weights frozen in) stay apart
    from every other engine's in the process: guards that match a module by id could pass for a new
    engine's module where a freed one's stood, and the alternative, resetting dynamo for each
    engine, dropped the graphs of the engines built before (recompiled at their next step)."""

    def call(*args: object) -> GraphOutput:
        return step(*args)

    code = call.__code__.replace()  # a new code object, so a cache of its own
    return types.FunctionType(code, call.__globals__, call.__name__, None, call.__closure__)


class GraphCompiler:
    """One exe_mode on one device."""

    name = "graph"

    def compile(self, step: torch.nn.Module, buffers: GraphInputs, bucket: str) -> GraphCallable:
        """`step` maps a step's forward args to (hidden states, logits of every row); `bucket` names
        the graph among the engine's (the compile cache's file names)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait for the device, so warm-up times cover the work (a no-op on the CPU)."""


class InductorCompiler(GraphCompiler):
    """torch.compile with inductor and static shapes: one graph per bucket, specialised to it.

    One compiled module per step module serves its buckets (dynamo compiles one graph per input
    shape), so the recompile limit is raised to the number of graphs. Static shapes rather than one graph
    dynamic in the batch: see docs/graph_modes.md for the measurement behind the choice.
    """

    name = "ge_graph (torch.compile, inductor)"

    def __init__(self, platform: Platform, cache: CompileCache, num_buckets: int, cpp_wrapper: bool = False) -> None:
        """`num_buckets`: the graphs compiled, every step module's together. `cpp_wrapper`: the code
        that calls a graph's kernels in C++ (model_config.graph_cpp_wrapper)."""
        import torch._dynamo.config

        self.platform = platform
        self.cpp_wrapper = cpp_wrapper
        cache.configure_inductor()
        limit = num_buckets + 1  # + the graph dynamo may build before specialising
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 8 * limit
        )
        self._compiled: dict[torch.nn.Module, _Compiled] = {}  # by step module

    def compile(self, step: torch.nn.Module, buffers: GraphInputs, bucket: str) -> GraphCallable:
        import torch._inductor.config
        from torch._dynamo.utils import counters

        if step not in self._compiled:
            own = _with_own_code(step)
            self._compiled[step] = _Compiled(own, torch.compile(own, backend="inductor", dynamic=False, fullgraph=True))
        entry = self._compiled[step]
        for layer in kv_cache_layers(step):
            for cache in layer.kv_caches().values():
                # The block count follows free memory from run to run; code generic in it keeps the
                # compile cache valid across runs (only the cache write and attention index it).
                torch._dynamo.mark_dynamic(cache, 0)
        before = dict(counters["inductor"])
        # Set around the compiling call rather than passed as torch.compile(options=...): measured
        # here, freezing and the GEMM autotuning did not take effect through `options`.
        options = self.inductor_options()
        with torch._inductor.config.patch(options), _bytecode_made_of(entry.own) as made:
            entry.compiled(*buffers.forward_args())  # dynamo compiles this bucket's shapes now
        # this bucket's bytecode, called directly; dynamo's guarded lookup where it made none (a
        # bucket of shapes compiled before)
        run = _forward(_with_code(entry.own, made[-1]) if made else entry.compiled)
        return GraphCallable(run, _inductor_origin(before, counters["inductor"], autotuning="max_autotune" in options))

    def inductor_options(self) -> dict[str, object]:
        """On the CPU: weights frozen into the graph and GEMMs autotuned between aten's (MKL/oneDNN) and
        inductor's own C++ micro-kernels over prepacked weights, which at decode's few rows beat MKL by
        about 2x here (docs/graph_modes.md); elsewhere inductor's defaults. With `cpp_wrapper`, the C++
        wrapper: at batch 1 the Python one's ~180 kernel calls were ~1.2 ms of a decode step."""
        wrapper: dict[str, object] = {"cpp_wrapper": True} if self.cpp_wrapper else {}
        if self.platform.device_type != "cpu":
            return wrapper
        return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN", **wrapper}

    def synchronize(self) -> None:
        self.platform.synchronize()


@dataclass(frozen=True, slots=True)
class _Compiled:
    """A step module's call with a code object of its own (`_with_own_code`) and its torch.compile."""

    own: types.FunctionType
    compiled: Callable[..., GraphOutput]


@contextlib.contextmanager
def _bytecode_made_of(function: types.FunctionType) -> Iterator[list[types.CodeType]]:
    """The bytecode dynamo makes of `function`'s frame while the block runs, one per compile.

    That bytecode calls the compiled graph and replays what the frame did besides (an EAGLE-3 hook
    keeping hidden states); called directly, as vLLM calls it, it skips dynamo's cache lookup, whose
    guards hold by construction once a bucket is compiled (the step module, its hooks and frozen
    weights never change after warm-up; each bucket runs on its own buffers and the engine's KV
    caches) and whose check cost about 1.7 ms of a batch-1 decode step (docs/graph_modes.md)."""
    from torch._dynamo.convert_frame import register_bytecode_hook

    made: list[types.CodeType] = []

    def keep(code: types.CodeType, new_code: types.CodeType) -> types.CodeType | None:
        if code is function.__code__:
            made.append(new_code)
        return None  # dynamo's bytecode, unchanged

    handle = register_bytecode_hook(keep)
    try:
        yield made
    finally:
        handle.remove()


def _with_code(function: types.FunctionType, code: types.CodeType) -> types.FunctionType:
    """`function` running `code` (dynamo's bytecode of it: the globals it installs are `function`'s)."""
    return types.FunctionType(
        code, function.__globals__, function.__name__, function.__defaults__, function.__closure__
    )


def _inductor_origin(before: dict[str, int], after: dict[str, int], *, autotuning: bool) -> str:
    """How inductor made a graph, from its counters. Frozen weights are constants of the graph, so
    inductor bypasses its FX-graph cache for them; a warm cache then still serves the autotuning
    choices and the built C++ kernels."""
    if after.get("fxgraph_cache_hit", 0) > before.get("fxgraph_cache_hit", 0):
        return "inductor cache hit"
    if autotuning and after.get("select_algorithm_autotune", 0) == before.get("select_algorithm_autotune", 0):
        return "compiled, autotuning from the cache"
    return "compiled"


class _FlatDecode(torch.nn.Module):
    """The step module as a function of flat tensors (the step's inputs, then every KV cache tensor), as
    torch.export wants it: the caches become inputs that the program writes in place, rather than
    constants baked into it."""

    def __init__(self, step: torch.nn.Module, template: GraphInputs, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.step = step
        self.template = template.forward_args()
        self.layers = layers
        self.num_input_tensors = len(tensor_leaves(self.template))

    def cache_tensors(self) -> list[torch.Tensor]:
        return [tensor for layer in self.layers for tensor in layer.kv_caches().values()]

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        step_args = with_tensors(self.template, list(tensors[: self.num_input_tensors]))
        caches = iter(tensors[self.num_input_tensors :])
        bound = [layer.kv_caches() for layer in self.layers]
        try:
            for layer, current in zip(self.layers, bound, strict=True):
                layer.bind_kv_cache({name: next(caches) for name in current}, layer.kv_cache_group_id)
            return self.step(*step_args)
        finally:
            for layer, current in zip(self.layers, bound, strict=True):
                layer.bind_kv_cache(current, layer.kv_cache_group_id)


class AotInductorCompiler(GraphCompiler):
    """CPU npugraph_ex: each bucket compiled ahead of time into an AOTInductor package, then loaded
    and replayed. Packages hold no weights (they are bound to the live model's tensors at load) and
    take the KV caches as inputs with a dynamic block count, so one package serves any cache size;
    with enable_cache_compile they are kept and the next run loads them without compiling.

    GEMMs stay aten's: inductor's C++ GEMM templates prepack weights into new constants, which a
    package without weights cannot carry (loading fails on the packed constant's name)."""

    name = "npugraph_ex (AOTInductor, per bucket)"

    def __init__(self, cache: CompileCache, settings: dict[str, object]) -> None:
        self.cache = cache
        self.settings = settings
        self._scratch = tempfile.TemporaryDirectory(prefix="infer-recipes-aoti-") if cache.root is None else None

    def package_path(self, step: torch.nn.Module, bucket: str) -> Path:
        folder = self.cache.folder("aoti")
        if folder is None:
            assert self._scratch is not None
            folder = Path(self._scratch.name)
        key = graph_key(step.model, **self.settings)
        (folder / key).mkdir(parents=True, exist_ok=True)
        return folder / key / f"bucket_{bucket}.pt2"

    def compile(self, step: torch.nn.Module, buffers: GraphInputs, bucket: str) -> GraphCallable:
        import torch._inductor
        import torch._inductor.config

        layers = kv_cache_layers(step)
        flat = _FlatDecode(step, buffers, layers)
        path = self.package_path(step, bucket)
        origin = "loaded from the compile cache"
        if not path.exists():
            origin = "compiled"
            args = (*tensor_leaves(buffers.forward_args()), *flat.cache_tensors())
            num_blocks = torch.export.Dim("num_blocks", min=2)
            dynamic = [None] * flat.num_input_tensors + [{0: num_blocks}] * len(flat.cache_tensors())
            program = torch.export.export(flat, args, dynamic_shapes=(tuple(dynamic),), strict=False)
            with torch._inductor.config.patch({"aot_inductor.package_constants_in_so": False}):
                partial = path.with_suffix(".partial.pt2")
                torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
                partial.replace(path)  # a crash mid-write leaves no package that looks whole
        runner = torch._inductor.aoti_load_package(str(path))
        constants = {**dict(flat.named_parameters(remove_duplicate=False)), **dict(flat.named_buffers())}
        runner.load_constants(
            {name: constants[name] for name in runner.get_constant_fqns()}, check_full_update=True, user_managed=True
        )

        def run(inputs: GraphInputs) -> GraphOutput:
            hidden_states, logits = runner(*tensor_leaves(inputs.forward_args()), *flat.cache_tensors())
            return hidden_states, logits

        return GraphCallable(run, origin)


class CudaGraphCompiler(GraphCompiler):
    """CUDA npugraph_ex: the decode forward captured into a CUDA graph per bucket and replayed,
    all buckets in one memory pool (captured largest first, so smaller ones reuse its memory).
    Across processes the graph holds the NCCL collectives c10d enqueues on the capturing stream
    (NCCL 2.9.6 and later can be captured; ProcessGroupNCCL leaves captured work out of its watchdog)."""

    name = "npugraph_ex (CUDA graph capture/replay)"

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.pool = torch.cuda.graph_pool_handle()

    def compile(self, step: torch.nn.Module, buffers: GraphInputs, bucket: str) -> GraphCallable:
        forward = _forward(step)
        side = torch.cuda.Stream(self.platform.device)
        side.wait_stream(torch.cuda.current_stream(self.platform.device))
        with torch.cuda.stream(side):
            forward(buffers)  # lazy initialisation (cuBLAS handles, workspaces) stays out of the graph
        torch.cuda.current_stream(self.platform.device).wait_stream(side)
        # Several processes: that forward also ran the NCCL collectives once outside the graph (the
        # communicators exist before capture), and none of their work is left for the process
        # group's watchdog to poll while the capture runs.
        torch.cuda.synchronize(self.platform.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward(buffers)

        def replay(inputs: GraphInputs) -> GraphOutput:
            assert inputs is buffers, "a captured graph reads only the buffers it was captured on"
            graph.replay()
            return output

        return GraphCallable(replay, "captured")

    def synchronize(self) -> None:
        self.platform.synchronize()


class TorchairGeCompiler(GraphCompiler):
    """NPU ge_graph: torchair's GE backend as cann-recipes configures it (frozen parameters, tiling
    sink, StableRDFS), static shapes (cann-recipes ignores enable_dynamic_graph under ge_graph too);
    with enable_cache_compile the compiled graph (and GE's .om) is kept by
    torchair.inference.cache_compile."""

    name = "ge_graph (torchair GE)"

    def __init__(self, platform: Platform, cache: CompileCache) -> None:
        torchair = npu_runtime.torchair()
        self.platform = platform
        self.torchair = torchair
        config = torchair.CompilerConfig()
        config.mode = "max-autotune"
        config.experimental_config.frozen_parameter = True
        config.experimental_config.tiling_schedule_optimize = True
        config.experimental_config.topology_sorting_strategy = "StableRDFS"
        self.config = config
        self.cache_dir = cache.folder("torchair")
        self._compiled: dict[torch.nn.Module, Callable[..., GraphOutput]] = {}  # by step module

    def compile(self, step: torch.nn.Module, buffers: GraphInputs, bucket: str) -> GraphCallable:
        if step not in self._compiled:
            backend = self.torchair.get_npu_backend(compiler_config=self.config)
            if self.cache_dir is not None:
                self._compiled[step] = self.torchair.inference.cache_compile(
                    step.forward,
                    config=self.config,
                    dynamic=False,
                    cache_dir=str(self.cache_dir),
                    ge_cache=True,
                )
            else:
                self._compiled[step] = torch.compile(step, backend=backend, dynamic=False, fullgraph=True)
        return GraphCallable(_forward(self._compiled[step]), "compiled")

    def synchronize(self) -> None:
        self.platform.synchronize()


class NpuGraphExCompiler(GraphCompiler):
    """NPU npugraph_ex: torch.compile(backend="npugraph_ex") captures each bucket as an ACL graph,
    all in one graph pool; enable_static_kernel turns on its static kernel compile."""

    name = "npugraph_ex (aclgraph capture/replay)"

    def __init__(self, platform: Platform, cache: CompileCache, static_kernel: bool) -> None:
        npu_runtime.torch_npu()
        self.platform = platform
        self.options = {
            "frozen_parameter": True,
            "static_kernel_compile": static_kernel,
            "use_graph_pool": torch.npu.graph_pool_handle(),
            "clone_input": False,  # the buffers are persistent already
        }
        self.cache_dir = cache.folder("npugraph_ex")
        self._compiled: dict[torch.nn.Module, Callable[..., GraphOutput]] = {}  # by step module

    def compile(self, step: torch.nn.Module, buffers: GraphInputs, bucket: str) -> GraphCallable:
        if step not in self._compiled:
            if self.cache_dir is not None:
                self._compiled[step] = torch.npu.npugraph_ex.inference.cache_compile(
                    step.forward, dynamic=False, cache_dir=str(self.cache_dir), options=self.options
                )
            else:
                self._compiled[step] = torch.compile(
                    step, backend="npugraph_ex", fullgraph=True, dynamic=False, options=self.options
                )
        return GraphCallable(_forward(self._compiled[step]), "captured")

    def synchronize(self) -> None:
        self.platform.synchronize()


class GraphCompilerFactory(Protocol):
    def __call__(
        self,
        platform: Platform,
        cache: CompileCache,
        *,
        num_buckets: int,
        settings: dict[str, object],
        static_kernel: bool = False,
        cpp_wrapper: bool = False,
    ) -> GraphCompiler: ...


def _cuda_graphs(platform: Platform, cache: CompileCache, **options: object) -> GraphCompiler:
    return CudaGraphCompiler(platform)


def _inductor(
    platform: Platform, cache: CompileCache, *, num_buckets: int, cpp_wrapper: bool = False, **options: object
) -> GraphCompiler:
    return InductorCompiler(platform, cache, num_buckets, cpp_wrapper)


def _aot_inductor(
    platform: Platform, cache: CompileCache, *, settings: dict[str, object], **options: object
) -> GraphCompiler:
    return AotInductorCompiler(cache, {"exe_mode": "npugraph_ex", **settings})


def _torchair_ge(platform: Platform, cache: CompileCache, **options: object) -> GraphCompiler:
    return TorchairGeCompiler(platform, cache)


def _npugraph_ex(
    platform: Platform, cache: CompileCache, *, static_kernel: bool = False, **options: object
) -> GraphCompiler:
    return NpuGraphExCompiler(platform, cache, static_kernel=static_kernel)


# (device type, exe_mode) -> the compiler's factory; eager has none.
GRAPH_COMPILERS: dict[tuple[str, str], GraphCompilerFactory] = {
    ("cpu", "ge_graph"): _inductor,
    ("cuda", "ge_graph"): _inductor,
    ("npu", "ge_graph"): _torchair_ge,
    ("cpu", "npugraph_ex"): _aot_inductor,
    ("cuda", "npugraph_ex"): _cuda_graphs,
    ("npu", "npugraph_ex"): _npugraph_ex,
}
EXE_MODES = ("eager", "ge_graph", "npugraph_ex")


def graph_compiler_factory(device_type: str, exe_mode: str) -> GraphCompilerFactory | None:
    """The factory of `exe_mode`'s compiler on `device_type`; None for eager."""
    if exe_mode not in EXE_MODES:
        raise ValueError(f"exe_mode must be eager, ge_graph or npugraph_ex, got {exe_mode!r}")
    return GRAPH_COMPILERS.get((device_type, exe_mode))
