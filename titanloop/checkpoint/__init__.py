"""Preemption-safe checkpointing: atomic DCP checkpoints, retention, auto-resume, signal handling.

See docs/checkpointing.md for the layout and the signal/exit-code protocol.
"""

from titanloop.checkpoint.checkpointer import Checkpointer
from titanloop.checkpoint.config import CheckpointConfig
from titanloop.checkpoint.errors import CheckpointError
from titanloop.checkpoint.preemption import EXIT_CODE_PREEMPTED, PreemptionMonitor

__all__ = ["Checkpointer", "CheckpointConfig", "CheckpointError", "PreemptionMonitor", "EXIT_CODE_PREEMPTED"]
