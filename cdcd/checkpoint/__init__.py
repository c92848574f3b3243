"""The durable checkpoint store and the checkpoint document."""

from cdcd.checkpoint.store import Checkpoint, CheckpointStore

__all__ = ["Checkpoint", "CheckpointStore"]
