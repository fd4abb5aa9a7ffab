"""The same-machine path: an update handed over in a shared-memory segment.

The writer (the trainer's publisher, or an ``AsyncLLM`` worker staging bytes it
received over gloo for its engine-core process) owns one segment, a file under
``/dev/shm`` mapped shared, and writes each version into it once, laid out as
``pipeline_rl.weight_sync.layout`` says; every reader on the machine maps the same
file and loads straight from it (:class:`ShmUpdateInfo` names the file). No byte
crosses a socket.

Invariants: a segment is rewritten only after every reader of the previous version
returned from its ``update_weights``/``finish_weight_update`` calls (the publisher's
send is synchronous per version, and the loads copy out of the segment); readers
never write to it. The writer unlinks the file when it closes; a reader's mapping
stays valid until it drops it.
"""

from __future__ import annotations

import atexit
import mmap
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from pipeline_rl.weight_sync.layout import UpdateLayout, contiguous_bytes, pack_into, update_in
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError

if TYPE_CHECKING:
    from pipeline_rl.weight_sync.protocol import OpenContext, SendTiming, SyncClient, WeightSyncCalls


def shm_dir() -> Path:
    """Where segments live: ``/dev/shm`` (memory-backed) where it exists."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


@dataclass(frozen=True, slots=True)
class ShmUpdateInfo:
    """``update_weights`` info of the shared-memory path: the layout, the segment's
    file, and whether the values were already checked for non-finite ones by the
    worker that staged them (an ``AsyncLLM`` worker checks before it pauses, so its
    engine core does not check again)."""

    PATH: ClassVar[str] = "shm"
    version: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    segment: str
    checked: bool = False
    offset: int = 0
    status: str | None = None   # a StatusCell: load beside generation, report there

    def layout(self) -> UpdateLayout:
        return UpdateLayout(self.version, self.names, self.dtype_names, self.shapes)

    @classmethod
    def of(cls, layout: UpdateLayout, segment: str, checked: bool = False, offset: int = 0,
           status: str | None = None) -> "ShmUpdateInfo":
        return cls(layout.version, layout.names, layout.dtype_names, layout.shapes, segment, checked, offset,
                   status)


def _map(path: str, size: int, create: bool) -> np.ndarray:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        elif os.fstat(fd).st_size < size:
            raise WeightUpdateError(f"shared-memory segment {path} holds {os.fstat(fd).st_size} bytes, "
                                    f"the update needs {size}")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return np.frombuffer(mm, dtype=np.uint8)


#: Name prefixes of this project's files under :func:`shm_dir` (``<prefix>-<pid>-<id>``).
PREFIXES = ("pipeline_rl_gather", "pipeline_rl_weights", "pipeline_rl_stage", "pipeline_rl_status")


def sweep_stale() -> int:
    """Unlink this project's files whose creating process is gone (a process that was
    killed never unlinks its own: a crashed trainer would otherwise leave a model-sized
    file in memory); returns how many. Files of live processes are left alone."""
    removed = 0
    for path in shm_dir().glob("pipeline_rl_*-*-*"):
        prefix, _, rest = path.name.partition("-")
        pid = rest.partition("-")[0]
        if prefix not in PREFIXES or not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ShmSpaceError(WeightUpdateError):
    """The memory filesystem cannot hold an update (one line)."""


def shm_fits(size: int) -> bool:
    """Whether the memory filesystem has room for a file of ``size`` bytes."""
    st = os.statvfs(shm_dir())
    return st.f_bavail * st.f_frsize >= size


def check_space(size: int) -> None:
    """Refuse, in one line, a segment the memory filesystem cannot hold (writing past its
    free space would end the process with SIGBUS instead of an error)."""
    st = os.statvfs(shm_dir())
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise ShmSpaceError(f"shared memory: {shm_dir()} has {free / 1e6:.0f} MB free, an update needs "
                                f"{size / 1e6:.0f} MB (enlarge it, or use --rollout.weight_path gloo)")


#: Buffers made by :func:`new_shared_buffer`: id of the mapping -> its file (unlinked, and
#: forgotten, when the last array viewing the mapping is gone).
_GATHERED: dict[int, str] = {}
_AT_EXIT: list[bool] = []   # non-empty once release_gathered is registered to run at exit


def new_shared_buffer(size: int) -> np.ndarray:
    """A fresh uint8 buffer of ``size`` bytes in a memory file of its own, for the trainer
    to gather a version straight into (``gather_weights(allocate=...)``): the
    shared-memory path then hands that file to the workers without writing the bytes
    again. The file lives as long as some array views the buffer."""
    import weakref

    check_space(size)
    if not _AT_EXIT:   # an exit with buffers still referenced leaves no file either
        atexit.register(release_gathered)
        _AT_EXIT.append(True)
    path = str(shm_dir() / f"pipeline_rl_gather-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    array = _map(path, max(size, 1), create=True)
    mapping = array.base.obj  # type: ignore[union-attr]
    _GATHERED[id(mapping)] = path
    weakref.finalize(mapping, _release, id(mapping), path)
    return array[:size]


def release_gathered() -> None:
    """Unlink the files of every gather buffer still alive (their mappings stay valid):
    on close and at exit, while an update may still hold the newest buffer."""
    for key, path in list(_GATHERED.items()):
        _release(key, path)


def _release(key: int, path: str) -> None:
    _GATHERED.pop(key, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def gathered_in(update: WeightUpdate) -> tuple[str, int] | None:
    """The file and byte offset ``update`` already lies in (:func:`new_shared_buffer`), or None."""
    flat = contiguous_bytes(update.arrays)
    if flat is None:
        return None
    base = flat
    while isinstance(base.base, np.ndarray):
        base = base.base
    mapping = getattr(base.base, "obj", None)
    path = _GATHERED.get(id(mapping)) if mapping is not None else None
    if path is None:
        return None
    return path, flat.ctypes.data - base.ctypes.data


class SharedSegment:
    """The writer's segment (grown, under a new file name, when an update needs more)."""

    def __init__(self, prefix: str = "pipeline_rl_weights") -> None:
        self._prefix = prefix
        self.path: str | None = None
        self._array: np.ndarray | None = None

    def buffer(self, size: int) -> np.ndarray:
        """A writable uint8 view of at least ``size`` bytes (the same file while it fits)."""
        if self._array is None or self._array.size < size:
            self.close()
            check_space(size)
            path = str(shm_dir() / f"{self._prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            self._array = _map(path, max(size, 1), create=True)
            self.path = path
        return self._array[:size]

    def write(self, update: WeightUpdate, *, checked: bool = False) -> ShmUpdateInfo:
        """Lay ``update`` out in the segment; the info readers load it by."""
        layout = UpdateLayout.of(update)
        pack_into(self.buffer(layout.total_bytes()), update.arrays)
        assert self.path is not None
        return ShmUpdateInfo.of(layout, self.path, checked)

    def close(self) -> None:
        """Unlink the file (mappings already made stay valid)."""
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        self.path, self._array = None, None


class SegmentReader:
    """A reader's mapping of the newest segment it was pointed at (mapped once, reused
    for every version the writer lays out in the same file)."""

    def __init__(self) -> None:
        self._path: str | None = None
        self._array: np.ndarray | None = None

    def update(self, info: ShmUpdateInfo) -> WeightUpdate:
        """The update ``info`` describes, its arrays views of the segment."""
        layout = info.layout()
        size = layout.total_bytes()
        end = info.offset + size
        if self._path != info.segment or self._array is None or self._array.size < end:
            try:
                self._array = _map(info.segment, end, create=False)
            except FileNotFoundError as e:
                raise WeightUpdateError(f"shared-memory segment {info.segment} not found "
                                        f"(the trainer is on another machine? force --rollout.weight_path gloo)") from e
            self._path = info.segment
        return update_in(self._array[info.offset:end], layout)

    def close(self) -> None:
        self._path, self._array = None, None


class SharedWriter:
    """The trainer's segment for every same-node worker: each version is written once,
    by the first send that needs it (thread-safe: the publisher sends to workers in
    parallel; the others wait for that write)."""

    def __init__(self) -> None:
        import threading

        sweep_stale()   # what killed publishers left behind
        self._segment = SharedSegment()
        self._lock = threading.Lock()
        self._info: ShmUpdateInfo | None = None
        self._kept: WeightUpdate | None = None

    def write_once(self, update: WeightUpdate) -> tuple[ShmUpdateInfo, float]:
        """The segment's info for ``update`` and the seconds this call spent writing it."""
        import time

        with self._lock:
            if self._info is not None and self._info.version == update.version:
                return self._info, 0.0
            t0 = time.perf_counter()
            self._info = None
            if update.device is not None:   # gathered on a GPU: one pinned copy into the segment
                self._info = self._from_device(update)
                return self._info, time.perf_counter() - t0
            gathered = gathered_in(update)
            if gathered is not None:   # the trainer gathered it into shared memory: no write
                self._info = ShmUpdateInfo.of(UpdateLayout.of(update), gathered[0], offset=gathered[1])
                self._kept = update    # its file lives while the update does
            else:
                self._info = self._segment.write(update)
            return self._info, time.perf_counter() - t0

    def _from_device(self, update: WeightUpdate) -> ShmUpdateInfo:
        """A GPU-gathered ``update`` copied into the segment (``host_gpu``: pinned, device to
        host, no conversion on the CPU)."""
        from pipeline_rl.weight_sync.channels.host_gpu import device_to_host

        copy = update.device
        assert copy is not None
        device_to_host(copy.flat, self._segment.buffer, pinned=True)
        layout = UpdateLayout(update.version, list(update.names), [update.dtype] * len(update.names),
                              [list(s) for s in copy.shapes])
        assert self._segment.path is not None
        return ShmUpdateInfo.of(layout, self._segment.path)

    def close(self) -> None:
        with self._lock:
            self._segment.close()
            self._info = self._kept = None
        release_gathered()


class ShmTrainerChannel:
    """The ``shm`` path's ``TrainerChannel`` for one worker: the version is written into
    the shared :class:`SharedWriter` (once for all workers), then the worker's one call
    (``receive_update``: start, update -- map and check -- and finish) loads it."""

    path = ShmUpdateInfo.PATH

    def __init__(self, client: "SyncClient", writer: SharedWriter) -> None:
        self.client = client
        self._writer = writer

    @classmethod
    def open(cls, client: "SyncClient", context: "OpenContext") -> "ShmTrainerChannel":
        """Nothing to join: the context's writer holds the node's segment."""
        if not isinstance(context.shared, SharedWriter):
            raise ValueError("the shm path needs the publisher's SharedWriter (OpenContext.shared)")
        return cls(client, context.shared)

    def send(self, update: WeightUpdate) -> "SendTiming":
        import time

        from pipeline_rl.weight_sync.protocol import SendTiming, tagged

        info, write_s = self._writer.write_once(update)
        t0 = time.perf_counter()
        finish_s = self.client.receive_update(tagged(info), str(update.version))
        call_s = time.perf_counter() - t0
        return SendTiming(update.version, write_s + call_s - finish_s, finish_s, update.num_bytes, self.path)

    def close(self) -> None:
        """Nothing per worker: the writer's segment is the publisher's."""


class OfferSegment:
    """Where an update handed over in memory (an offer: Ray's object store, tests) enters
    the same calls as every path's: laid out in a segment of this process, then sent as
    the ``shm`` path's message through ``calls`` (start, update -- map and check -- and
    finish). One offer at a time (the segment is rewritten by the next)."""

    def __init__(self) -> None:
        import threading

        self._segment = SharedSegment("pipeline_rl_stage")
        self._lock = threading.Lock()

    def offer(self, calls: "WeightSyncCalls", update: WeightUpdate) -> None:
        """Send ``update`` through ``calls`` (start, update, finish); a payload that cannot
        be laid out (its dtype, its lists) raises ``WeightUpdateError`` before any call."""
        from pipeline_rl.weight_sync.protocol import receive_in_one_call, tagged

        if not isinstance(update, WeightUpdate):
            raise WeightUpdateError(f"expected a WeightUpdate, got {type(update).__name__}")
        with self._lock:
            info = self._segment.write(update)
            receive_in_one_call(calls, tagged(info), str(update.version))

    def close(self) -> None:
        with self._lock:
            self._segment.close()


class StatusCell:
    """Two int64 in a tiny shared file: the version a process worked on and how it went
    (:data:`PENDING`, :data:`READY`, :data:`FAILED`, :data:`NO_SHADOW`). The ``AsyncLLM``
    worker creates it and polls it; its engine core's backend writes it when it has
    loaded an update beside generation (``pipeline_rl.weight_sync.receive.core_staging``)."""

    PENDING, READY, FAILED, NO_SHADOW = 0, 1, 2, 3

    def __init__(self, path: str, create: bool) -> None:
        self.path = path
        self._cells = _map(path, 16, create=create).view(np.int64)

    @classmethod
    def create(cls, prefix: str = "pipeline_rl_status") -> "StatusCell":
        cell = cls(str(shm_dir() / f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}"), create=True)
        cell.set(-1, cls.PENDING)
        return cell

    def set(self, version: int, state: int) -> None:
        self._cells[1] = state          # the state first: a reader that sees the version sees it
        self._cells[0] = version

    def get(self, version: int) -> int:
        """The state for ``version`` (PENDING while the writer has not reached it)."""
        return int(self._cells[1]) if int(self._cells[0]) == version else self.PENDING

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
