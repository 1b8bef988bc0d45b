"""The CUDA graph backend's attention: what a captured graph must do differently from eager CUDA.

A captured graph may read nothing on the host (the capture would sync, and the replay would keep
the first step's value), and it is replayed for every later length; so its decode attention
gathers the block table's whole capacity instead of reading the step's longest length (the
reference's gathered_decode_attention with no max_len), for the paged K/V and MLA's absorbed decode
alike. DSA's indexer reads each request's length to score only its tokens, so it has no captured
form yet (ops/backend.py leaves it out of the record).
"""

from __future__ import annotations

from ops.attention.reference import ReferenceAttention, gathered_decode_attention


class CudaGraphAttention(ReferenceAttention):
    """The reference's attention, its decode over the block table's whole capacity."""

    name = "cuda_graph"

    def __init__(self) -> None:
        super().__init__(gathered_decode_attention)
