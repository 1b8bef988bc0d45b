"""StopSignals (executor/offline/interrupts.py): what a signal does before, during and after serving."""

from __future__ import annotations

import os
import signal

import pytest

from executor.offline.interrupts import RunInterrupted, StopSignals


def test_a_signal_outside_serving_stops_at_once():
    with pytest.raises(RunInterrupted) as stopped, StopSignals():
        os.kill(os.getpid(), signal.SIGTERM)
    assert stopped.value.signum == signal.SIGTERM


def test_while_serving_the_first_signal_asks_and_the_second_stops_at_once():
    with StopSignals() as stop:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.stop_requested.is_set()
            with pytest.raises(RunInterrupted):
                os.kill(os.getpid(), signal.SIGINT)


def test_a_settled_run_takes_torchruns_sigterm_as_a_request_up_to_its_end():
    # a rank that stops because another was lost: torchrun's SIGTERM must not interrupt its last words
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        stop.settle()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.stop_requested.is_set() and stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the handler it replaced is back


def test_a_run_stopping_on_ctrl_c_takes_torchruns_forward_of_it_quietly():
    # a rank that got the terminal's SIGINT and is stopping: torchrun's forward of the same Ctrl-C is a
    # second signal, which must not raise in the rank's last words
    with StopSignals() as stop:
        with stop.deferred():
            os.kill(os.getpid(), signal.SIGINT)
        stop.settle()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signum == signal.SIGINT
