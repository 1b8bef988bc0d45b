"""CUDA forms of the quantized matmuls (imported lazily by nothing: plain torch calls that run on a GPU).

torch._int_mm on CUDA takes more than 16 rows and K, N multiples of 8: decode steps have fewer rows,
so the rows are padded to 17 and the padding dropped after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CUDA_INT_MM_MIN_ROWS = 17


def padded_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm(a [M, K] int8, b [K, N] int8) -> int32 [M, N] for any M."""
    rows = a.shape[0]
    if rows >= CUDA_INT_MM_MIN_ROWS:
        return torch._int_mm(a, b)
    return torch._int_mm(F.pad(a, (0, 0, 0, CUDA_INT_MM_MIN_ROWS - rows)), b)[:rows]
