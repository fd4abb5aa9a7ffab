"""Weight dtypes on the wire. numpy has no bfloat16, so a bfloat16 array travels as
``uint16`` holding the bit patterns (the upper half of each float32), tagged
``"bfloat16"`` by the message that carries it (``WeightUpdate.dtype``, the wire
infos' ``dtype_names``); torch reads it back with a zero-copy ``view``.

Invariant: the wire dtype of an update is the served model's dtype (bfloat16 or
float16 engines get 16-bit weights; a float32 engine keeps float32), so a worker
never receives more bytes than the model it serves holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

WireDtype = Literal["float32", "float16", "bfloat16"]
WIRE_DTYPES: tuple[WireDtype, ...] = ("float32", "float16", "bfloat16")

#: numpy storage of each wire dtype.
STORAGE: dict[str, type] = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def itemsize(name: str) -> int:
    return int(np.dtype(STORAGE[name]).itemsize)


def served_wire_dtype(served: str) -> WireDtype:
    """The wire dtype for an engine serving ``served`` (``float32``/``bfloat16``/``float16``)."""
    if served not in WIRE_DTYPES:
        raise ValueError(f"no wire dtype for a model served in {served!r}")
    return served  # type: ignore[return-value]


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def to_torch(arr: np.ndarray, name: str) -> "torch.Tensor":
    """A torch view of ``arr`` (no copy) with the wire dtype ``name``."""
    import torch

    t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if name == "bfloat16" else t


def from_torch(t: "torch.Tensor") -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 as its uint16 bits)."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def all_finite(arr: np.ndarray, name: str) -> bool:
    """Whether every value is finite (torch's vectorised check, bfloat16 included)."""
    import torch

    if arr.size == 0:
        return True
    if not arr.flags.writeable:   # torch will not wrap a read-only array: numpy's own check
        if name == "bfloat16":
            return not bool(((arr & 0x7F80) == 0x7F80).any())
        return bool(np.isfinite(arr).all())
    return bool(torch.isfinite(to_torch(np.ascontiguousarray(arr), name)).all())
