"""`python -m executor.offline.launch --yaml FILE [--set section.key=value ...]`: what every infer.sh runs.

parallel_config.world_size 1: the run, in this process. Above 1: torchrun, in this process, with
world_size processes on this node (`--standalone` rendezvous), each running `python -m executor.offline`
with the same arguments. Ctrl-C or SIGTERM reaches torchrun here (the ranks run in sessions of their
own), which hands it to every rank once; the ranks stop after the same step and write the run folder,
and this process then exits as one process would: 128 + the signal number. A rank that fails stops
the others (torchrun); this process exits with its status, and names a rank a signal killed
(rank_faults.py), one line each.
Several nodes: run torchrun on each yourself (docs/distributed.md), e.g.
`torchrun --nnodes 2 --node-rank <n> --nproc-per-node <world_size / 2> --rdzv-backend c10d
--rdzv-endpoint <host:port> -m executor.offline --yaml FILE`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from executor.core.config import ConfigError, load_config
from executor.offline import __main__ as offline
from executor.offline.exit_status import COULD_NOT_START
from executor.offline.interrupts import exit_status_for
from executor.offline.rank_faults import launcher_status, lost_rank_lines


def torchrun_args(world_size: int, argv: list[str], module: str = "executor.offline") -> list[str]:
    """torchrun's arguments that start world_size ranks of the entry `module` on this node."""
    return ["--standalone", f"--nproc-per-node={world_size}", "-m", module, *argv]


def run_torchrun(world_size: int, argv: list[str], module: str = "executor.offline") -> int:
    """torchrun (`python -m torch.distributed.run`) in this process: on a signal its agent hands the
    signal to every rank, waits for them (30 s, TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and raises."""
    try:
        torchrun.main(torchrun_args(world_size, argv, module))
    except SignalException as exc:
        return exit_status_for(exc.sigval)
    except ChildFailedError as exc:  # each rank has said why it stopped; a rank lost to a signal could not
        for line in lost_rank_lines(exc, world_size):
            print(line, file=sys.stderr)
        return launcher_status(exc)
    return 0


def main(
    argv: list[str] | None = None,
    entry: Callable[[list[str]], int] = offline.main,
    module: str = "executor.offline",
) -> int:
    """Run `entry` (the offline entry, or the online one: executor/online/launch.py) in this
    process, or world_size ranks of `module` under torchrun."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    known, _ = parser.parse_known_args(argv)
    world_size = 1
    if known.yaml:  # without it, the offline entry says what is missing
        try:
            world_size = load_config(known.yaml, known.overrides).parallel_config.world_size
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return COULD_NOT_START
    if world_size == 1 or "RANK" in os.environ:  # one process, or already a torchrun rank
        return entry(argv)
    return run_torchrun(world_size, argv, module)


if __name__ == "__main__":
    sys.exit(main())
