"""`python -m executor.offline.launch --yaml FILE [--set section.key=value ...]`: what every infer.sh runs.

parallel_config.world_size 1: the run, in this process. Above 1: torchrun with world_size processes on
this node (`--standalone` rendezvous), each running `python -m executor.offline` with the same
arguments. Several nodes: run torchrun on each yourself (docs/distributed.md), e.g.
`torchrun --nnodes 2 --node-rank <n> --nproc-per-node <world_size / 2> --rdzv-backend c10d
--rdzv-endpoint <host:port> -m executor.offline --yaml FILE`.
"""

from __future__ import annotations

import argparse
import os
import sys

from executor.core.config import ConfigError, load_config
from executor.offline import __main__ as offline
from executor.offline.exit_status import COULD_NOT_START


def torchrun_command(world_size: int, argv: list[str]) -> list[str]:
    """The command that starts world_size ranks of the offline entry on this node."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world_size}",
        "-m",
        "executor.offline",
        *argv,
    ]


def main(argv: list[str] | None = None) -> int:
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
        return offline.main(argv)
    command = torchrun_command(world_size, argv)
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
