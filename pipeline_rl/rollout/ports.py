"""The replay buffer as a rollout worker sees it (``pipeline_rl.rollout.worker``): the
admission budget it asks for grants, and the sender its finished groups go through."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

from pipeline_rl.config import Config
from pipeline_rl.samples import Group

if TYPE_CHECKING:
    from pipeline_rl.buffer.types import Admission
    from pipeline_rl.run_key import RunKey


class AdmissionSource(Protocol):
    """The global admission budget: the ``ReplayBuffer`` itself, or a Ray-handle adapter.
    ``request`` asks for up to ``max_groups`` grants without blocking the caller: the
    answer comes on the future (the source may wait up to ``timeout_s`` for a non-zero
    grant before answering). ``release`` gives back grants the worker will not use
    (returns the refund)."""

    def request(self, worker_id: int, max_groups: int,
                timeout_s: float = 0.0) -> "Future[Admission]": ...

    def release(self, worker_id: int, count: int) -> int: ...


class SenderLike(Protocol):
    """Where finished groups go (``pipeline_rl.buffer.sender.GroupSender``); thread-safe."""

    def send(self, group: Group) -> None: ...

    def close(self, linger_s: float = 5.0) -> None: ...

    @property
    def wait_s(self) -> float: ...


def connect_sender(address: str, worker_id: int, cfg: Config, key: "RunKey | None") -> SenderLike:
    """The sender to the buffer at ``address``, proving ``key`` (None: outside a run)."""
    from pipeline_rl.buffer.sender import GroupSender

    return GroupSender(address, worker_id, cfg.buffer.send_timeout_s, key=key)
