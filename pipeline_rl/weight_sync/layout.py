"""The byte layout of one update, shared by every path (gloo buckets, shared memory).

An update is its tensors back to back in the order of :class:`UpdateLayout`
(``names``/``dtype_names``/``shapes`` line up), each at the offset
:meth:`UpdateLayout.offsets` gives: a receiver cuts a flat byte buffer into the
update's arrays with :func:`arrays_in` (views, no copy), and a sender fills one
with :func:`pack_into`. The gloo channel moves that buffer in buckets
(:func:`bucket_plan`); the shared-memory path hands over the buffer itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from pipeline_rl.weight_sync.dtypes import STORAGE, WIRE_DTYPES, itemsize
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError


@dataclass(frozen=True, slots=True)
class UpdateLayout:
    """One update's metadata; lists line up. ``dtype_names`` are wire dtype names
    (``float32``/``float16``/``bfloat16``, see ``pipeline_rl.weight_sync.dtypes``)."""

    version: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise WeightUpdateError(f"update info lists differ in length: {len(self.names)} names, "
                                    f"{len(self.dtype_names)} dtypes, {len(self.shapes)} shapes")
        bad = next((d for d in self.dtype_names if d not in STORAGE), None)
        if bad is not None:
            raise WeightUpdateError(f"dtype {bad!r} not accepted on the wire ({', '.join(WIRE_DTYPES)})")

    @classmethod
    def of(cls, update: WeightUpdate) -> Self:
        return cls(update.version, list(update.names), [update.dtype_name(a) for a in update.arrays],
                   [list(a.shape) for a in update.arrays])

    def layout(self) -> "UpdateLayout":
        """The layout itself (a path's info that extends it answers as the others do)."""
        return UpdateLayout(self.version, self.names, self.dtype_names, self.shapes)

    def nbytes(self) -> list[int]:
        """Bytes of each tensor, in order."""
        return [int(np.prod(s, dtype=np.int64)) * itemsize(d) for d, s in zip(self.dtype_names, self.shapes)]

    def total_bytes(self) -> int:
        return sum(self.nbytes())

    @property
    def wire_dtype(self) -> str:
        """The update's dtype: ``bfloat16`` when its tensors are, else ``float32``."""
        return "bfloat16" if "bfloat16" in self.dtype_names else "float32"


def arrays_in(flat: np.ndarray, layout: UpdateLayout) -> list[np.ndarray]:
    """The update's arrays as views of ``flat`` (uint8, at least ``total_bytes`` long)."""
    out: list[np.ndarray] = []
    offset = 0
    for n, d, s in zip(layout.nbytes(), layout.dtype_names, layout.shapes):
        out.append(flat[offset:offset + n].view(STORAGE[d]).reshape(s))
        offset += n
    return out


def update_in(flat: np.ndarray, layout: UpdateLayout) -> WeightUpdate:
    """The :class:`WeightUpdate` laid out in ``flat`` (arrays are views of it)."""
    return WeightUpdate(layout.version, tuple(layout.names), tuple(arrays_in(flat, layout)),
                        dtype=layout.wire_dtype)  # type: ignore[arg-type]


def pack_into(flat: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """Copy ``arrays`` back to back into ``flat`` (uint8), in order."""
    offset = 0
    for a in arrays:
        src = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        flat[offset:offset + src.size] = src
        offset += src.size


def contiguous_bytes(arrays: Sequence[np.ndarray]) -> np.ndarray | None:
    """One uint8 view over ``arrays`` when they already lie back to back in one buffer
    (``gather_weights`` writes them so), else None."""
    if not arrays or not all(a.flags.c_contiguous for a in arrays):
        return None
    base: Any = arrays[0]
    while isinstance(getattr(base, "base", None), np.ndarray):
        base = base.base
    start = arrays[0].ctypes.data
    end = start
    for a in arrays:
        if a.ctypes.data != end:
            return None
        end += a.nbytes
    flat = base.reshape(-1).view(np.uint8) if isinstance(base, np.ndarray) and base.flags.c_contiguous else None
    if flat is None:
        return None
    first = start - flat.ctypes.data
    if first < 0 or first + (end - start) > flat.size:
        return None
    return flat[first:first + (end - start)]


def bucket_plan(nbytes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Consecutive index ranges whose byte totals stay within ``bucket_bytes`` (a
    tensor larger than that is a bucket alone). Sender and receiver cut alike."""
    buckets: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(nbytes):
        if i > start and size + n > bucket_bytes:
            buckets.append(range(start, i))
            start, size = i, 0
        size += n
    if start < len(nbytes):
        buckets.append(range(start, len(nbytes)))
    return buckets
