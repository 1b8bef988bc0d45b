"""Request lifecycle and prefill-first batching."""

from executor.core.scheduler.scheduler import Scheduler, SchedulerLimits, StepOutput, StepRecord

__all__ = ["Scheduler", "SchedulerLimits", "StepOutput", "StepRecord"]
