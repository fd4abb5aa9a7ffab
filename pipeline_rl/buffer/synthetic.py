"""Synthetic groups for load tests, benchmarks and driver smoke runs.

Token arrays are shared between the groups a :class:`SyntheticGroups` makes
(only ids and versions differ), so a producer can emit groups at wire speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline_rl.samples import Completion, Group


@dataclass
class SyntheticGroups:
    """Makes groups of ``n`` completions x ``tokens`` tokens (prompt of
    ``prompt_tokens``). ``make(group_id, version)`` stamps every token with
    ``version``; arrays of one version are built once and reused."""

    worker_id: int
    n: int = 8
    tokens: int = 256
    prompt_tokens: int = 64
    seed: int = 0
    _by_version: dict[int, tuple[Completion, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self._ids = rng.integers(0, 32000, size=(self.n, self.tokens), dtype=np.int32)
        self._logprobs = -rng.exponential(1.0, size=(self.n, self.tokens)).astype(np.float32)
        self._prompt = rng.integers(0, 32000, size=self.prompt_tokens, dtype=np.int32)

    def _completions(self, version: int) -> tuple[Completion, ...]:
        comps = self._by_version.get(version)
        if comps is None:
            versions = np.full(self.tokens, version, dtype=np.int32)
            comps = tuple(Completion(self._ids[i], self._logprobs[i], versions, float(i % 2), "stop")
                          for i in range(self.n))
            self._by_version[version] = comps
        return comps

    def make(self, group_id: int, version: int = 0) -> Group:
        return Group(group_id, group_id, self.worker_id, self._prompt, self._completions(version))

    @property
    def message_bytes(self) -> int:
        """Approximate encoded size of one group."""
        return 12 * self.n * self.tokens + 4 * self.prompt_tokens + 13 * self.n + 40
