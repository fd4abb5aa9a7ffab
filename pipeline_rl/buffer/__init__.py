"""The replay buffer and its ZeroMQ link (docs/design.md).

``ReplayBuffer`` (replay.py): bounded FIFO, staleness eviction, admission budget.
``BufferServer`` (server.py): PULL socket + receiver thread feeding a buffer.
``GroupSender`` (sender.py): what a rollout worker pushes groups with.
Typed messages and errors live in types.py. Importing has no side effects.
"""

from pipeline_rl.buffer.replay import ReplayBuffer
from pipeline_rl.buffer.sender import GroupSender
from pipeline_rl.buffer.server import BufferServer
from pipeline_rl.buffer.types import (
    Admission,
    AdmissionStats,
    BackpressureTimeout,
    BufferStats,
    BufferUnreachable,
    TransportError,
)

__all__ = [
    "Admission", "AdmissionStats", "BackpressureTimeout", "BufferServer", "BufferStats",
    "BufferUnreachable", "GroupSender", "ReplayBuffer", "TransportError",
]
