"""tokenbus producer side: what clients import (no torch)."""

from producer.client import Client
from producer.errors import (
    BatchNotFound,
    InvalidBatch,
    InvalidJob,
    JobNotFound,
    QueueFull,
    TokenbusError,
    WaitTimeout,
)
from producer.protocol import (
    BatchRecord,
    BatchStatus,
    GenerationParams,
    Job,
    JobRequest,
    JobResult,
    JobStatus,
    Keys,
    QueueInfo,
    Usage,
)

__all__ = [
    "BatchNotFound", "BatchRecord", "BatchStatus", "Client", "GenerationParams", "InvalidBatch", "InvalidJob",
    "Job", "JobNotFound", "JobRequest", "JobResult", "JobStatus", "Keys", "QueueFull", "QueueInfo",
    "TokenbusError", "Usage", "WaitTimeout",
]
