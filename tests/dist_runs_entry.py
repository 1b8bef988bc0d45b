"""A torchrun entry that runs the offline entry once for each argument list in a JSON file, in turn,
in one process group: tests of several layouts of one world size pay the ranks' start-up (imports,
rendezvous) once. Each run builds its own groups on the shared one; it stops at the first run that
does not succeed and exits with its status."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from executor.core.config.comm_manager import CommManager
from executor.offline.__main__ import main


def run_all(runs_file: Path) -> int:
    close = CommManager.close
    managers: list[CommManager] = []
    CommManager.close = lambda self: managers.append(self)  # the next run builds its groups on this process group
    try:
        for argv in json.loads(runs_file.read_text()):
            status = main(argv)
            if status != 0:
                return status
        return 0
    finally:
        CommManager.close = close
        for comm in managers:  # the first destroys the process group; each lets go of its run's groups
            comm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(run_all(Path(sys.argv[1])))
