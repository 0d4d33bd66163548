"""tokenbus producer side: what clients import (no torch)."""

from producer.client import Client
from protocol.errors import (
    BatchNotFound,
    InvalidBatch,
    InvalidJob,
    JobNotFound,
    QueueFull,
    TokenbusError,
    WaitTimeout,
)
from protocol.keys import Keys
from protocol.models import BatchStatus, GenerationParams, Job, JobRequest, JobResult, JobStatus, Usage
from protocol.records import BatchRecord, QueueInfo

__all__ = [
    "BatchNotFound", "BatchRecord", "BatchStatus", "Client", "GenerationParams", "InvalidBatch", "InvalidJob",
    "Job", "JobNotFound", "JobRequest", "JobResult", "JobStatus", "Keys", "QueueFull", "QueueInfo",
    "TokenbusError", "Usage", "WaitTimeout",
]
