"""The framework-free step: flat bucket, error feedback, communication patterns, statistics."""

from .core import Bucket, Engine
from .stats import BucketStats, summarize

__all__ = ["Bucket", "BucketStats", "Engine", "summarize"]
