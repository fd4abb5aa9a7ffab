"""The weight-update message that travels from the trainer to the rollout workers,
and its validation against the model a worker serves.

Invariants of :class:`WeightUpdate`: ``names`` and ``arrays`` have one length and
line up; names are Hugging Face parameter names (``model.state_dict()`` keys of
the HF model); arrays are C-contiguous numpy arrays of the update's wire dtype
(``dtype``: ``"bfloat16"`` arrays are ``uint16`` bit patterns, see
``pipeline_rl.weight_sync.dtypes``; a ``"float32"`` update may also hold float16
arrays); ``version`` is the number of optimizer steps behind these weights
(docs/design.md section 2).

A worker never applies an update it has not validated: :func:`validate_update`
checks the whole payload against the model's :class:`WeightSpec` (read from the
model folder's safetensors headers) *before* anything touches the engine, so a
bad payload raises :class:`WeightUpdateError` and the previous weights stay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline_rl.weight_sync.dtypes import WIRE_DTYPES, WireDtype, all_finite, to_torch

if TYPE_CHECKING:
    import torch

#: numpy dtypes a payload may carry (converted to the engine's dtype on load).
ACCEPTED_DTYPES: tuple[np.dtype, ...] = (np.dtype(np.float32), np.dtype(np.float16))


class WeightUpdateError(ValueError):
    """A weight payload that does not fit the served model; the message is one line."""


@dataclass(frozen=True, slots=True, eq=False)
class DeviceCopy:
    """An update's tensors still on the trainer's GPU: ``flat``, one 1-D tensor of the
    wire dtype holding them back to back in ``names`` order, with their ``shapes`` (the
    ``ipc`` path shares it as it is, ``pipeline_rl.weight_sync.channels.cuda_ipc``)."""

    flat: "torch.Tensor"
    shapes: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True, eq=False)
class OpenedUpdate:
    """An update's tensors on the worker's device, received and not yet loaded: ``flat``,
    the buffer holding them (the trainer's, opened from its IPC handle; or a receive
    buffer, typed or raw bytes) and the named views of it, in the message's order.
    Valid while this object lives (and, for a reused receive buffer, until the next
    update)."""

    version: int
    flat: "torch.Tensor"
    tensors: list[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True, slots=True, eq=False)
class WeightUpdate:
    """Full model weights for one policy version: in host memory (``arrays``), or on
    the trainer's GPU (``device``, and ``arrays`` empty; ``cuda_ipc.to_host`` copies it
    out for the paths that move bytes)."""

    version: int
    names: tuple[str, ...]
    arrays: tuple[np.ndarray, ...]
    dtype: WireDtype = "float32"
    device: DeviceCopy | None = None

    def dtype_name(self, arr: np.ndarray) -> str:
        """The wire dtype of one of this update's arrays."""
        return "bfloat16" if self.dtype == "bfloat16" else str(arr.dtype)

    @property
    def num_bytes(self) -> int:
        if self.device is not None:
            return int(self.device.flat.numel()) * int(self.device.flat.element_size())
        return sum(int(a.nbytes) for a in self.arrays)

    @property
    def num_params(self) -> int:
        if self.device is not None:
            return int(self.device.flat.numel())
        return sum(int(a.size) for a in self.arrays)


@dataclass(frozen=True, slots=True)
class WeightSpec:
    """What a full update of one model must contain: HF name -> shape."""

    shapes: dict[str, tuple[int, ...]]

    @property
    def num_params(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes.values())


@dataclass(frozen=True, slots=True, eq=False)
class CheckedUpdate:
    """A validated update, already wrapped as torch tensors (zero-copy views of the
    numpy arrays), so applying it does no checking and no conversion."""

    version: int
    tensors: tuple[tuple[str, "torch.Tensor"], ...]
    num_bytes: int


def read_weight_spec(model_dir: str | Path) -> WeightSpec:
    """Parameter names and shapes of a Hugging Face folder, from the safetensors
    headers (single file or sharded with ``model.safetensors.index.json``)."""
    from safetensors import safe_open

    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise WeightUpdateError(f"{root}: no model.safetensors (or index) to read parameter shapes from")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in files:
        with safe_open(str(root / name), framework="numpy") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    if _ties_embeddings(root):
        # A tied LM head is the embedding: the trainer's parameters name it once (as the
        # embedding), whether or not the checkpoint also stored a copy under this name.
        shapes.pop("lm_head.weight", None)
    return WeightSpec(shapes)


def _ties_embeddings(root: Path) -> bool:
    """Whether the folder's ``config.json`` ties the LM head to the input embedding."""
    try:
        config = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return False
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    return bool(config.get("tie_word_embeddings", False))


def load_update(model_dir: str | Path, version: int) -> WeightUpdate:
    """The weights stored in a Hugging Face folder as a float32 :class:`WeightUpdate`."""
    from safetensors.torch import load_file

    root = Path(model_dir)
    spec = read_weight_spec(root)
    tensors: dict[str, np.ndarray] = {}
    files = sorted(root.glob("*.safetensors"))
    for file in files:
        for key, t in load_file(str(file)).items():
            tensors[key] = np.ascontiguousarray(t.float().numpy())
    names = tuple(sorted(spec.shapes))
    return WeightUpdate(version, names, tuple(tensors[n] for n in names))


def validate_update(update: WeightUpdate, spec: WeightSpec, *, current_version: int | None = None,
                    check_values: bool = True) -> None:
    """Raise :class:`WeightUpdateError` (one line naming the first problem) unless
    ``update`` is a complete, well-formed set of weights for the model of ``spec``.

    Checked: version is an int (and newer than ``current_version`` when given);
    names and arrays line up; no duplicate, unknown or missing name; every array
    is a contiguous float32/float16 numpy array of the expected shape with only
    finite values (``check_values=False``: the caller checked the values already).
    A partial update is refused: vLLM's layerwise reload would
    leave a layer with some parameters uninitialised.
    """
    if not isinstance(update, WeightUpdate):
        raise WeightUpdateError(f"expected a WeightUpdate, got {type(update).__name__}")
    if update.dtype not in WIRE_DTYPES:
        raise WeightUpdateError(f"wire dtype {update.dtype!r} not accepted ({', '.join(WIRE_DTYPES)})")
    if not isinstance(update.version, int) or update.version < 0:
        raise WeightUpdateError(f"version must be an int >= 0 (got {update.version!r})")
    if current_version is not None and update.version <= current_version:
        raise WeightUpdateError(f"version {update.version} is not newer than the served version "
                                f"{current_version}")
    if update.device is not None:
        raise WeightUpdateError(f"weights v{update.version} are on the trainer's GPU (the ipc path's); "
                                "copy them to host memory first")
    if len(update.names) != len(update.arrays):
        raise WeightUpdateError(f"{len(update.names)} names but {len(update.arrays)} arrays")
    seen: set[str] = set()
    for name, arr in zip(update.names, update.arrays):
        _check_one(name, arr, spec, seen, check_values, update.dtype)
        seen.add(name)
    missing = sorted(set(spec.shapes) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightUpdateError(f"missing parameter {missing[0]!r}{more}: updates must be complete")


def _check_one(name: str, arr: np.ndarray, spec: WeightSpec, seen: set[str], check_values: bool,
               wire: WireDtype = "float32") -> None:
    if name in seen:
        raise WeightUpdateError(f"duplicate parameter {name!r}")
    expected = spec.shapes.get(name)
    if expected is None:
        raise WeightUpdateError(f"unknown parameter {name!r} (not in the served model)")
    if not isinstance(arr, np.ndarray):
        raise WeightUpdateError(f"{name}: expected a numpy array, got {type(arr).__name__}")
    if wire == "bfloat16":
        if arr.dtype != np.uint16:
            raise WeightUpdateError(f"{name}: a bfloat16 update carries uint16 bit patterns, got {arr.dtype}")
    elif arr.dtype not in ACCEPTED_DTYPES:
        raise WeightUpdateError(f"{name}: dtype {arr.dtype} not accepted (float32 or float16)")
    if tuple(arr.shape) != expected:
        raise WeightUpdateError(f"{name}: shape {tuple(arr.shape)} != expected {expected}")
    if not arr.flags.c_contiguous:
        raise WeightUpdateError(f"{name}: array is not C-contiguous")
    if check_values and not all_finite(arr, "bfloat16" if wire == "bfloat16" else str(arr.dtype)):
        raise WeightUpdateError(f"{name}: non-finite values")


def check_update(update: WeightUpdate, spec: WeightSpec, *,
                 current_version: int | None = None) -> CheckedUpdate:
    """Validate (see :func:`validate_update`) and wrap as torch tensors, ordered by
    name so each layer's parameters arrive together (vLLM's layerwise reload then
    processes a layer as soon as it is complete, buffering at most one layer)."""
    validate_update(update, spec, current_version=current_version)
    return as_checked(update)


def as_checked(update: WeightUpdate) -> CheckedUpdate:
    """Wrap an update that :func:`validate_update` already passed (ordered by name)."""
    order = sorted(range(len(update.names)), key=lambda i: update.names[i])
    tensors = tuple((update.names[i], _as_tensor(update.arrays[i], update.dtype_name(update.arrays[i])))
                    for i in order)
    return CheckedUpdate(update.version, tensors, update.num_bytes)


def _as_tensor(arr: np.ndarray, dtype_name: str) -> "torch.Tensor":
    if not arr.flags.writeable:  # arrays out of Ray's object store are read-only views
        arr = arr.copy()
    return to_torch(arr, dtype_name)
