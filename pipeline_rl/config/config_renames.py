"""Configuration keys that moved: the old spelling, as a flag or as a key of a ``--config`` TOML
file (or a dict given to ``Config.model_validate``), is one line naming the new one. Stdlib only.

Invariant: an old key is never a field of the configuration any more, so naming it is always a
mistake; the check runs before the fields are validated (``Config``'s first validator, and
``cli``'s reading of an unrecognised flag).
"""

from __future__ import annotations

#: Old dotted key -> its new dotted key.
RENAMED: dict[str, str] = {
    "rollout.max_restarts": "run.max_worker_restarts",
    "trainer.muon_lr": "trainer.optimizer.lr",
    "trainer.muon_momentum": "trainer.optimizer.momentum",
    "rollout.weight_transport": "rollout.weight_path",
}

#: What the new key needs beside it, where it needs something.
_WITH: dict[str, str] = {
    "trainer.optimizer.lr": " with --trainer.optimizer muon",
    "trainer.optimizer.momentum": " with --trainer.optimizer muon",
    "rollout.weight_path": " object_store for Ray's object store (vllm: one of its other values)",
}


def renamed_line(old: str) -> str | None:
    """The one line for the old dotted key ``old`` (no leading ``--``), or None if it never
    moved: ``rollout.max_restarts: renamed; use --run.max_worker_restarts (in a --config file: ...)``."""
    new = RENAMED.get(old)
    if new is None:
        return None
    parent, _, leaf = new.rpartition(".")
    return f"{old}: renamed; use --{new}{_WITH.get(new, '')} (in a --config file: {leaf} under [{parent}])"


def check_renamed(data: dict[str, object]) -> None:
    """Raise ValueError with :func:`renamed_line` for the first old key present in the nested
    ``data`` (sections as dicts)."""
    for old in RENAMED:
        *parents, leaf = old.split(".")
        node: object = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node:
            raise ValueError(renamed_line(old))
