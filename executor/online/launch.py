"""`python -m executor.online.launch --yaml FILE [--port N] [--set section.key=value ...]`: what
`infer.sh --mode online` runs: the server in this process, or under torchrun with
parallel_config.world_size ranks on this node (rank 0 serves HTTP), as the offline launcher does."""

from __future__ import annotations

import sys

from executor.offline import launch
from executor.online import __main__ as online


def main(argv: list[str] | None = None) -> int:
    return launch.main(argv, entry=online.main, module="executor.online")


if __name__ == "__main__":
    sys.exit(main())
