"""Request lifecycle and prefill-first batching."""

from executor.core.scheduler.scheduler import Scheduler, SchedulerLimits

__all__ = ["Scheduler", "SchedulerLimits"]
