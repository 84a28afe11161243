"""Continuous-batching scheduler: requests, block pool, step composition. Pure Python, no mlx."""

from scheduler.config import SchedulerConfig
from scheduler.output import SchedulerOutput
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

__all__ = [
    "FinishReason",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
