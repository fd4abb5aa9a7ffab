"""The run's key: a fresh secret per run that proves membership of the run.

The driver makes one (:meth:`RunKey.new`) when it starts the actors and hands it to each
actor through Ray, as a constructor argument; it is never part of the configuration, so
it is never printed, logged, written to the run folder or put in an environment
variable. What is derived from it, each under its own label (HMAC-SHA256, so one derived
value tells nothing of the key or of another):

the table :data:`LABELS` (this module is the only one that derives anything from a key):

- the replay buffer's ZeroMQ CURVE key pairs and its PLAIN password
  (``pipeline_rl.buffer.auth``);
- the secret with which the two ends of a weight channel (gloo, nccl) prove the run key
  to each other before any weight moves (``pipeline_rl.weight_sync.channels.rendezvous_auth``);
- the agent endpoint's bearer token (``pipeline_rl.rollout.agents``).

Invariants: ``repr``/``str``/``format`` never show the secret; a key compares equal
only to the same secret (in constant time). The key is passed explicitly, as an
argument, to every object that proves it; no process holds it in a global. Outside a run
(tests, the in-process benchmarks) a component is handed None: no proof is asked for,
except by the agent endpoint, which then gets a fresh key's token
(:func:`endpoint_token`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass, field
from enum import Enum

KEY_BYTES = 32
_LABEL_PREFIX = b"pipeline_rl/"


class Purpose(Enum):
    """What a derived value is for (each has its label in :data:`LABELS`)."""

    BUFFER_SERVER = "buffer server CURVE pair"
    BUFFER_CLIENT = "buffer client CURVE pair"
    BUFFER_PLAIN = "buffer PLAIN password"
    WEIGHTS_RENDEZVOUS = "weight channel proof"
    AGENT_ENDPOINT = "agent endpoint token"
    HASH = "the key's hash"


#: The label each purpose is derived under (fixed: changing one changes every value
#: derived for that purpose).
LABELS: dict[Purpose, str] = {
    Purpose.BUFFER_SERVER: "buffer/curve-server",
    Purpose.BUFFER_CLIENT: "buffer/curve-client",
    Purpose.BUFFER_PLAIN: "buffer/plain-password",
    Purpose.WEIGHTS_RENDEZVOUS: "weights/rendezvous",
    Purpose.AGENT_ENDPOINT: "agent-endpoint",
    Purpose.HASH: "hash",
}


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

    def derive(self, purpose: Purpose, context: bytes = b"") -> bytes:  # the only derivation
        """32 bytes for one ``purpose``: HMAC-SHA256 of its label (:data:`LABELS`) and
        ``context`` under the key. Different purposes (or contexts) give independent
        values."""
        message = _LABEL_PREFIX + LABELS[purpose].encode() + b"\0" + context
        return hmac.new(self.secret, message, hashlib.sha256).digest()

    def rendezvous_secret(self) -> bytes:
        """What both ends of a weight channel prove they hold (``rendezvous_auth``)."""
        return self.derive(Purpose.WEIGHTS_RENDEZVOUS)

    def __repr__(self) -> str:
        return "RunKey(<hidden>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunKey) and hmac.compare_digest(self.secret, other.secret)

    def __hash__(self) -> int:
        return hash(self.derive(Purpose.HASH))


def rendezvous_secret(key: RunKey | None) -> bytes:
    """The weight channels' proof secret: empty outside a run (no key to prove)."""
    return key.rendezvous_secret() if key is not None else b""


def endpoint_token(key: RunKey | None) -> str:
    """The agent endpoint's bearer token: derived from the run's key, or from a fresh
    key of its own for a worker outside a run (tests)."""
    return (key if key is not None else RunKey.new()).derive(Purpose.AGENT_ENDPOINT).hex()
