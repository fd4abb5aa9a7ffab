"""The ablation's data: an arm (one treatment), a cell (an arm at one seed), the settings
every cell of a grid shares, and a cell's record. ``benchmarks/ablation.py`` runs cells and
``benchmarks/ablation_report.py`` summarises their records; both import these, neither the other.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}

CellStatus = Literal["done", "failed"]


@dataclass(frozen=True, slots=True)
class Arm:
    """One treatment of the grid: every seed of it is a cell. ``loss`` is ``--algorithm.loss``
    (named in the arm's name and label unless it is the default, reinforce); ``reference`` its
    ``--algorithm.ratio_reference`` (named, as ``loss@reference``, unless it is the default,
    proximal)."""

    dtype: str
    staleness: int
    correction: str
    loss: str = "reinforce"
    reference: str = "proximal"

    @property
    def name(self) -> str:
        label = treatment(asdict(self)).replace("+", "_").replace("@", "_")
        return f"{SHORT_DTYPE[self.dtype]}_s{self.staleness}_{label}"


def treatment(arm: dict[str, Any]) -> str:
    """An arm's label (its dict, as records store it): the correction, ``loss+correction`` when the
    loss is not reinforce. Arms are compared against the label ``none`` (reinforce, no correction)."""
    loss = arm.get("loss", "reinforce")
    ref = arm.get("reference", "proximal")
    loss = loss if ref == "proximal" else f"{loss}@{ref}"
    return arm["correction"] if loss == "reinforce" else f"{loss}+{arm['correction']}"


@dataclass(frozen=True, slots=True)
class Cell:
    """One arm at one seed: one run of the pipeline."""

    arm: Arm
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm.name}_seed{self.seed}"

    def flags(self) -> tuple[str, ...]:
        loss: tuple[str, ...] = ("--algorithm.loss", self.arm.loss) if self.arm.loss != "reinforce" else ()
        if self.arm.reference != "proximal":
            loss += ("--algorithm.ratio_reference", self.arm.reference)
        return ("--staleness", str(self.arm.staleness), "--correction.type", self.arm.correction, *loss,
                "--rollout.dtype", self.arm.dtype, "--seed", str(self.seed))

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Cell:
        return Cell(Arm(**data["arm"]), int(data["seed"]))


@dataclass(frozen=True, slots=True)
class GridSettings:
    """What every cell shares; a finished cell is reused only when these match."""

    steps: int
    model_dir: str
    flags: tuple[str, ...]

    def key(self) -> str:
        blob = json.dumps([self.steps, self.model_dir, list(self.flags)])
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(slots=True)
class CellResult:
    """A cell's record (``cell.json``): its status, wall time, the Ray node it ran on,
    its metrics rows and its held-out evaluations (``eval.jsonl``'s rows; none when the
    grid's flags leave ``--eval.every`` at 0)."""

    cell: Cell
    settings_key: str
    status: CellStatus
    wall_s: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    node: str | None = None
    evals: list[dict[str, Any]] = field(default_factory=list)
