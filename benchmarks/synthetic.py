"""Synthetic groups for tests and benchmarks: the trainer, buffer and transport fed without a generator.

``synthetic_groups``: random but well-formed groups (lengths, rewards and versions vary).

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


def synthetic_groups(num_groups: int, n: int, *, prompt_len: int = 8, max_completion_len: int = 16,
                     vocab_size: int = 128, first_token: int = 3, version: int = 0,
                     version_spread: int = 0, seed: int = 0, first_group_id: int = 0) -> list[Group]:
    """Random but well-formed groups (for tests, benchmarks and dry runs without a generator).

    Token ids are drawn from ``[first_token, vocab_size)`` (the built-in tokenizer's specials are
    below 3), completion lengths from ``[1, max_completion_len]``, behaviour log-probs from
    ``-U(0.1, 5)``, rewards are 0/1 (each group has at least one of each, so GRPO advantages are
    non-zero). Token versions lie in ``[version - version_spread, version]`` and are
    non-decreasing; some completions span two versions when ``version_spread > 0``.
    """
    rng = np.random.default_rng(seed)
    groups = []
    for gi in range(num_groups):
        prompt = rng.integers(first_token, vocab_size, prompt_len, dtype=np.int32)
        rewards = rng.permutation([1.0] + [0.0] + list(rng.integers(0, 2, n - 2).astype(float)))
        comps = []
        for ci in range(n):
            t = int(rng.integers(1, max_completion_len + 1))
            start = version - int(rng.integers(0, version_spread + 1))
            versions = np.full(t, start, dtype=np.int32)
            if version_spread and t > 1 and start < version:
                versions[int(rng.integers(1, t)):] = start + 1
            comps.append(Completion(
                token_ids=rng.integers(first_token, vocab_size, t, dtype=np.int32),
                logprobs=-rng.uniform(0.1, 5.0, t).astype(np.float32),
                versions=versions, reward=float(rewards[ci]),
                finish_reason="length" if t == max_completion_len else "stop"))
        groups.append(Group(group_id=first_group_id + gi, prompt_id=first_group_id + gi, worker_id=0,
                            prompt_ids=prompt, completions=tuple(comps)))
    return groups
