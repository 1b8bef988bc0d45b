"""A rank lost under torchrun (killed by a signal: the OOM killer, a SIGKILL), said in one line per rank.

The lost rank says nothing: the launcher (executor/offline/launch.py) learns from torchrun which rank
died and of which signal. Every other rank meets the loss in its next collective, whose connection
to the lost rank closes; it writes what its run folder holds, says so in one line with the resume
command, and exits STOPPED_ON_ERROR instead of raising (no traceback: nothing is wrong in it).
"""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from executor.offline.exit_status import STOPPED_ON_ERROR

# What a collective's error says when the rank at its other end is gone (gloo's tcp pairs, NCCL).
LOST_PEER_SIGNS = ("closed by peer", "reset by peer", "broken pipe", "remote process exited", "connection refused")


def is_lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective that failed because another rank went away."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(sign in text for sign in LOST_PEER_SIGNS)


def stopped_line(rank: int, world_size: int, finished_in: str, resume_hint: str) -> str:
    """A surviving rank's line: it stopped because another was lost, what is kept, how to resume."""
    return (
        f"error: rank {rank} of {world_size} stopped: another rank was lost (its connection closed in a "
        f"collective); finished requests are kept in {finished_in}; {resume_hint}"
    )


def lost_rank_lines(error: ChildFailedError, world_size: int) -> list[str]:
    """The launcher's line for each rank that a signal killed (torchrun's failures of exit code < 0)."""
    return [
        f"error: rank {rank} of {world_size} was lost: killed by {failure.signal_name()} (pid {failure.pid}); "
        "the other ranks stopped because of it"
        for rank, failure in sorted(error.failures.items())
        if failure.exitcode < 0
    ]


def launcher_status(error: ChildFailedError) -> int:
    """The launcher's exit status for a failed torchrun: STOPPED_ON_ERROR where a rank was lost to a
    signal, else the first failed rank's own status (2 when the input was bad, ...)."""
    if any(failure.exitcode < 0 for failure in error.failures.values()):
        return STOPPED_ON_ERROR
    return error.get_first_failure()[1].exitcode
