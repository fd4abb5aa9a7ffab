"""The weight-update message that travels from the trainer to the rollout workers.

Invariants of :class:`WeightUpdate`: ``names`` and ``arrays`` have one length and
line up; names are Hugging Face parameter names (``model.state_dict()`` keys of
the HF model); arrays are C-contiguous numpy arrays; ``version`` is the number
of optimizer steps behind these weights (DESIGN.md section 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True, eq=False)
class WeightUpdate:
    """Full model weights for one policy version."""

    version: int
    names: tuple[str, ...]
    arrays: tuple[np.ndarray, ...]

    @property
    def num_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)
