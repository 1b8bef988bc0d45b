"""A torchrun entry (2 ranks, gloo) for the teardown test: after CommManager.close no gloo worker
thread may be left to release a collective's tensors while the interpreter finalizes. Releasing a
tensor that has a Python object takes the GIL, and a thread that gets the GIL from a finalizing
interpreter is ended by pthread_exit, here inside the work's noexcept destructor: std::terminate,
SIGABRT, "terminate called without an active exception", after a run that finished.

The entry makes certain the schedule that a loaded machine makes rare: rank 1's all-reduce completes
in its worker thread only after rank 1 has closed its groups (rank 0 joins it late), while rank 1's
main thread keeps the GIL (a switch interval longer than the test) until it exits, and the groups
stay referenced until the interpreter tears the module down, as a run's engine and model may be
(reference cycles); their destruction there gives the GIL away. When close() has joined the workers,
the all-reduce completed and its tensors were released inside close()."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from executor.core.config.comm_manager import CommManager, DistEnv
from executor.core.config.parallel_layout import ParallelLayout

LATE_S = 0.5  # rank 0 joins the all-reduce this late
HOLD_GIL_S = 1.5  # rank 1's main thread keeps the GIL this long after close(), then exits

held_until_teardown: list[object] = []


def main() -> int:
    env = DistEnv.from_environ()
    comm = CommManager(ParallelLayout(world_size=2, attn_tp_size=2), env, "gloo", timeout_s=60)
    layers = comm.model_parallel()  # the model's share of the groups
    held_until_teardown.append((comm, layers))
    tensor = torch.ones(4)  # a tensor with a Python object, as the run's collectives take
    if env.rank == 0:
        time.sleep(LATE_S)
    work = dist.all_reduce(tensor, group=layers.attn_tp.group, async_op=True)
    if env.rank == 0:
        work.wait()
    del work, tensor  # on rank 1 the worker thread holds the last references
    comm.close()
    if env.rank == 1:
        sys.setswitchinterval(1000.0)  # a thread waiting for the GIL gets it only when it is given away
        end_s = time.monotonic() + HOLD_GIL_S
        while time.monotonic() < end_s:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
