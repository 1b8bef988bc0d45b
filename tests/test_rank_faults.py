"""executor/offline/rank_faults.py: which lines and status a lost rank gives (the whole run under
torchrun: tests/test_distributed.py's SIGKILL test)."""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from executor.offline.exit_status import COULD_NOT_START, STOPPED_ON_ERROR
from executor.offline.rank_faults import is_lost_peer, launcher_status, lost_rank_lines


def failed(**exit_codes: int) -> ChildFailedError:
    """torchrun's error for ranks `r<N>=exit code` (negative: killed by that signal)."""
    failures = {
        int(name[1:]): ProcessFailure(int(name[1:]), 100 + int(name[1:]), code, "") for name, code in exit_codes.items()
    }
    return ChildFailedError("executor.offline", failures)


def test_the_launcher_names_each_rank_a_signal_killed_and_exits_stopped_on_error():
    error = failed(r0=1, r1=-9, r3=-15)
    assert lost_rank_lines(error, 4) == [
        "error: rank 1 of 4 was lost: killed by SIGKILL (pid 101); the other ranks stopped because of it",
        "error: rank 3 of 4 was lost: killed by SIGTERM (pid 103); the other ranks stopped because of it",
    ]
    assert launcher_status(error) == STOPPED_ON_ERROR


def test_ranks_that_exit_on_their_own_keep_their_status_and_get_no_lost_line():
    error = failed(r0=COULD_NOT_START, r1=COULD_NOT_START)
    assert lost_rank_lines(error, 2) == [] and launcher_status(error) == COULD_NOT_START


def test_a_collective_whose_peer_closed_is_a_lost_peer_and_other_errors_are_not():
    gloo = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:52968: Connection reset by peer."
    assert is_lost_peer(RuntimeError(gloo))
    assert not is_lost_peer(RuntimeError("injected fault")) and not is_lost_peer(ValueError(gloo))
