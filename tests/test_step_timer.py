"""StepTimer: a step's time and its parts, with device waits only where asked for."""

import pytest

from executor.core.engine.engine_core import StepTimer


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance_ms(self, ms: float) -> None:
        self.now_s += ms / 1e3


def test_parts_follow_the_marks_and_add_up_to_the_step_time():
    clock = FakeClock()
    timer = StepTimer(clock, breakdown=True)
    timer.start()
    for part, ms in (("prepare", 1.0), ("h2d", 2.0), ("forward", 30.0), ("sample", 4.0)):
        clock.advance_ms(ms)
        timer.mark(part)
    clock.advance_ms(0.5)
    step_ms, parts = timer.stop("output")
    assert parts == pytest.approx({"prepare": 1.0, "h2d": 2.0, "forward": 30.0, "sample": 4.0, "output": 0.5})
    assert step_ms == pytest.approx(37.5) == pytest.approx(sum(parts.values()))


def test_a_part_marked_twice_adds_up():
    clock = FakeClock()
    timer = StepTimer(clock, breakdown=True)
    timer.start()
    clock.advance_ms(3.0)
    timer.mark("forward")
    clock.advance_ms(2.0)
    timer.mark("forward")
    assert timer.stop("output")[1] == pytest.approx({"forward": 5.0, "output": 0.0})


def test_without_the_breakdown_the_step_is_timed_and_the_device_never_waited_for():
    clock, waits = FakeClock(), []
    timer = StepTimer(clock, breakdown=False, synchronize=lambda: waits.append(1))
    timer.start()
    clock.advance_ms(12.0)
    timer.mark("forward")
    assert timer.stop("output") == (pytest.approx(12.0), None)
    assert waits == []


def test_an_asynchronous_device_is_waited_for_at_every_mark():
    waits = []
    timer = StepTimer(FakeClock(), breakdown=True, synchronize=lambda: waits.append(1))
    timer.start()
    timer.mark("prepare")
    timer.mark("forward")
    timer.stop("output")
    assert len(waits) == 3


def test_marks_outside_a_step_are_ignored():
    clock = FakeClock()
    timer = StepTimer(clock, breakdown=True)
    timer.mark("forward")  # the engine's warm-up runs before any step starts
    timer.start()
    clock.advance_ms(1.0)
    assert timer.stop("output")[1] == pytest.approx({"output": 1.0})
    timer.mark("forward")  # after the step: no effect either
    timer.start()
    assert timer.stop("output")[1] == {"output": 0.0}
