"""Every weight path's name and what its choice depends on, declared once.

The names are typed here only (:data:`PathName` and the aliases built from it); what
the rest of the project decides about a path it reads from the path's row of
:data:`PATH_TABLE` (:class:`ChoiceTraits`), never by comparing its name (a test reads the
package for such comparisons). Cheap to import: the config reads it; nothing heavier
than ``dataclasses`` is imported until a row's ``refusal`` is asked.

Two tables, one row per name each, the same names in both: this one says when a path
may be taken (``paths.choose_path``, the config's checks); ``channel.PATHS`` holds its
code (its channel, its messages, what its sends need).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

#: The path of Ray's object store (``auto`` never takes it: forced only).
ObjectStorePath = Literal["object_store"]
#: The paths through vLLM's weight-transfer API.
VllmPath = Literal["shm", "gloo", "ipc", "nccl"]
#: Every path's name: the keys of :data:`PATH_TABLE`.
PathName = Literal[VllmPath, ObjectStorePath]
#: A path as asked for, ``--rollout.weight_path``'s values: one of :data:`PathName`, or
#: ``auto`` (chosen per worker).
WeightPath = Literal["auto", PathName]


@dataclass(frozen=True, slots=True)
class Fit:
    """What the trainer's and one worker's placements have in common (``paths.Placement``)."""

    same_node: bool
    both_cuda: bool
    same_gpu: bool


@dataclass(frozen=True, slots=True)
class Need:
    """One thing a path needs of a :class:`Fit`; ``refusal`` ends the one line that
    refuses it when forced (after ``--rollout.weight_path <name>: ``)."""

    holds: Callable[[Fit], bool]
    refusal: str


@dataclass(frozen=True, slots=True)
class ChoiceTraits:
    """When one path may be taken (its code's traits are ``channel.PathTraits``).

    - ``needs``: what the two placements must give, checked in this order when the path
      is forced (the first that fails refuses it); ``auto`` takes a path only where all hold;
    - ``auto``: ``host`` -- ``auto`` takes the first host path (table order) whose needs
      hold; ``gpu`` -- a CUDA path, taken before any host path, but only where it is among
      the GPU paths ``choose_path`` is given; ``never`` -- only when forced;
    - ``gpu_default``: among the GPU paths ``auto`` is given by default
      (``paths.GPU_PATHS``; ``nccl`` is not until it has run on two GPUs);
    - ``forced_needs_gpu_paths``: forced, it must still be among the given GPU paths
      (else "not available with the installed vLLM");
    - ``refusal``: asked when the config forces the path: why it cannot run on this
      machine, or None (imports what it needs only when called)."""

    needs: tuple[Need, ...]
    auto: Literal["host", "gpu", "never"]
    gpu_default: bool = False
    forced_needs_gpu_paths: bool = False
    refusal: Callable[[], str | None] | None = None

    def fits(self, fit: Fit) -> bool:
        """Every need holds."""
        return all(need.holds(fit) for need in self.needs)


def _nccl_refusal() -> str | None:
    """Why NCCL cannot run here (torch imported only for this path)."""
    from pipeline_rl.weight_sync.channels.nccl import nccl_refusal

    return nccl_refusal()


_SAME_NODE = Need(lambda f: f.same_node, "the trainer and a rollout worker are on different nodes (use gloo or auto)")
_SAME_GPU = Need(lambda f: f.same_gpu, "needs the trainer and the worker on one GPU (use auto)")
_BOTH_CUDA = Need(lambda f: f.both_cuda, "needs the trainer and the worker on GPUs (use auto)")
_OTHER_GPU = Need(lambda f: not f.same_gpu, "the trainer and the worker share one GPU (use ipc or auto)")

#: Every path, in the order ``auto`` considers them within a kind.
PATH_TABLE: dict[PathName, ChoiceTraits] = {
    "shm": ChoiceTraits((_SAME_NODE,), "host"),
    "gloo": ChoiceTraits((), "host"),
    "ipc": ChoiceTraits((_SAME_GPU,), "gpu", gpu_default=True, forced_needs_gpu_paths=True),
    "nccl": ChoiceTraits((_BOTH_CUDA, _OTHER_GPU), "gpu", refusal=_nccl_refusal),
    "object_store": ChoiceTraits((), "never"),
}

_BY_NAME: dict[str, ChoiceTraits] = {name: row for name, row in PATH_TABLE.items()}


def choice_traits(name: str) -> ChoiceTraits | None:
    """The row of ``name``, or None where it names no path (``auto``, a typo)."""
    return _BY_NAME.get(name)

