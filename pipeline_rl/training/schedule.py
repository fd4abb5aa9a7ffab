"""The learning rate by step (``--trainer.lr_schedule``, ``--trainer.warmup_steps``).

The rate is a pure function of the trainer's version (batches trained, one per
:meth:`Trainer.step`), so a resumed run, whose version comes back from its checkpoint, takes
the same rate at each step as an uninterrupted one without any scheduler state of its own.
With ``W`` warm-up steps, ``S = --max-steps`` and step ``s = 0, 1, ...`` (the version before
the step), the factor on every parameter group's base rate is::

    s < W:      (s + 1) / W                               linear warm-up, never 0
    otherwise:  p = (s - W) / (S - W)   (in [0, 1))
                constant: 1;  linear: 1 - p;  cosine: (1 + cos(pi p)) / 2

so the decays reach 0 at step ``S`` (one past the last). A step past ``S`` (a resumed run
given a smaller ``--max-steps``) keeps the last factor's limit, 0. PPO epochs of one batch
share its rate.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline_rl.config import LRScheduleName


def lr_factor(step: int, *, schedule: LRScheduleName, warmup_steps: int, total_steps: int) -> float:
    """The factor on the base learning rate at ``step`` (0-based; module docstring)."""
    if step < 0 or total_steps < 1 or warmup_steps < 0:
        raise ValueError(f"lr_factor: step {step}, total {total_steps}, warm-up {warmup_steps}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - p
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    raise ValueError(f"trainer.lr_schedule: unknown schedule {schedule!r}")


class LRSchedule:
    """Sets the rate of each parameter group of ``optimizer`` (DeepSpeed's engine optimizer:
    its wrappers share their inner optimizer's groups) before each step.

    Invariant: each group's base rate is the one it had when this object was made (the
    configured rates: AdamW's, and Muon's own for its group), whatever a loaded checkpoint's
    groups hold afterwards; the rate set at version ``v`` is ``base * lr_factor(v)``.
    """

    def __init__(self, optimizer: Any, *, schedule: LRScheduleName, warmup_steps: int, total_steps: int,
                 base_lr: float) -> None:
        self.optimizer = optimizer
        self.schedule, self.warmup_steps, self.total_steps = schedule, warmup_steps, total_steps
        self.base_lr = base_lr
        self.group_base = [float(g["lr"]) for g in optimizer.param_groups]

    def set(self, version: int) -> float:
        """Set every group's rate for the step from ``version``; returns the main rate
        (``--trainer.lr`` times the factor), the one reported in metrics.jsonl."""
        f = lr_factor(version, schedule=self.schedule, warmup_steps=self.warmup_steps,
                      total_steps=self.total_steps)
        for group, base in zip(self.optimizer.param_groups, self.group_base, strict=True):
            group["lr"] = base * f
        return self.base_lr * f
