"""The run's key: a fresh secret per run that proves membership of the run.

The driver makes one (:meth:`RunKey.new`) when it starts the actors and hands it to each
actor through Ray, as a constructor argument; it is never part of the configuration, so
it is never printed, logged, written to the run folder or put in an environment
variable. What is derived from it, each under its own label (HMAC-SHA256, so one derived
value tells nothing of the key or of another):

- the replay buffer's ZeroMQ CURVE key pairs (``pipeline_rl.buffer.auth``);
- the proofs the two ends of a cross-node weight channel exchange before any weight moves
  (``pipeline_rl.weight_sync.rendezvous_auth``).

Invariants: ``repr``/``str``/``format`` never show the secret; a key compares equal
only to the same secret (in constant time). An actor process installs the key it was
handed (:func:`install`) once, in its constructor, for the code that cannot be handed
it as an argument (the weight channel, built inside vLLM's calls); :func:`installed`
is None in any other process (tests, the in-process benchmarks).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

KEY_BYTES = 32
_LABEL_PREFIX = b"pipeline_rl/"


@dataclass(frozen=True, slots=True, eq=False)
class RunKey:
    """A run's secret (32 random bytes). Pickles (Ray hands it to the actors); its text
    forms are ``RunKey(<hidden>)``."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != KEY_BYTES:
            raise ValueError(f"a run key is {KEY_BYTES} bytes")

    @classmethod
    def new(cls) -> RunKey:
        """A fresh key from the operating system's randomness (``secrets``)."""
        return cls(secrets.token_bytes(KEY_BYTES))

    def derive(self, label: str, context: bytes = b"") -> bytes:
        """32 bytes for one purpose: HMAC-SHA256 of ``label`` and ``context`` under the key.
        Different labels (or contexts) give independent values."""
        message = _LABEL_PREFIX + label.encode() + b"\0" + context
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "RunKey(<hidden>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunKey) and hmac.compare_digest(self.secret, other.secret)

    def __hash__(self) -> int:
        return hash(self.derive("hash"))


_installed: RunKey | None = None


def install(key: RunKey | None) -> None:
    """Make ``key`` this process's run key (an actor's constructor does, with the key Ray
    handed it; None: no key, as outside a run)."""
    global _installed
    _installed = key


def installed() -> RunKey | None:
    """This process's run key (:func:`install`), or None outside a run's actors."""
    return _installed
