"""fiber-aws: Fiber's ``aws-batch`` backend, every job an AWS Batch job, GPU queues by configuration."""

from __future__ import annotations

__version__ = "0.1.0"
