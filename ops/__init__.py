"""Operators and the backends that run them.

Every op has a torch reference (ops.torch_ref, which defines what it computes); a backend record
(ops.backend.Backend, made by make_backend per device and exe_mode) holds each op's implementation
there (the CPU's C++ kernels in ops.cpu, the NPU's in ops.npu, the CUDA graph forms in
ops.cuda_graph), the linear methods, the attention metadata builder and the graph compiler. Models
get the record at construction and their layers call its fields.

Shapes use the packed TND layout: T tokens of the whole batch, H heads, D head dim.
"""
