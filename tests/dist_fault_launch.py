"""The launcher (`python -m executor.offline.launch`) over tests/dist_fault_entry.py's ranks instead of
`-m executor.offline`, so that a failure test sees what a user of infer.sh sees."""

from __future__ import annotations

import sys

from executor.offline import launch


def fault_torchrun_args(world_size: int, argv: list[str], module: str = "executor.offline") -> list[str]:
    """The launcher's torchrun arguments, with the fault entry's script in place of `module`."""
    return ["--standalone", f"--nproc-per-node={world_size}", "tests/dist_fault_entry.py", *argv]


if __name__ == "__main__":
    launch.torchrun_args = fault_torchrun_args
    sys.exit(launch.main())
