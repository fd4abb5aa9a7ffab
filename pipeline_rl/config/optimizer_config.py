"""``--trainer.optimizer``: the optimizer as one choice that carries its own parameters.

A discriminated union on ``type``: :class:`AdamWConfig` (no parameters of its own: it runs at
``--trainer.lr`` with ``--trainer.weight_decay``) or :class:`MuonConfig` (Muon's ``lr`` and
``momentum``, flags ``--trainer.optimizer.lr`` and ``--trainer.optimizer.momentum``). A section
field of :class:`pipeline_rl.config.trainer_config.TrainerConfig`, in a module of its own like ``lora_config.py``;
it imports no torch, vLLM, DeepSpeed or Ray.

Invariants: a table without ``type`` is AdamW's, and a bare name (``optimizer = "muon"`` in a
TOML file, ``"muon"`` from Python) is the table ``{type = "muon"}``
(:func:`optimizer_table`); a parameter of the other choice is a one-line error naming it;
a DeepSpeed without Muon is refused while the configuration is validated
(:func:`muon_refusal`), before anything starts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pipeline_rl.config_section import Section, choice_table, foreign_keys

#: The first DeepSpeed release whose Muon every ZeRO stage takes (``training/optimizers.py``).
MUON_MIN_DEEPSPEED = (0, 18, 2)


def muon_refusal() -> str | None:
    """Why this installation cannot run ``--trainer.optimizer muon`` (one line), or None: the
    installed DeepSpeed's version, read from its metadata (nothing imported)."""
    from importlib import metadata

    try:
        version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return "muon is DeepSpeed's optimizer and DeepSpeed is not installed"
    parts = tuple(int(p) if p.isdigit() else 0 for p in version.split("+")[0].split(".")[:3])
    if parts < MUON_MIN_DEEPSPEED:
        need = ".".join(map(str, MUON_MIN_DEEPSPEED))
        return f"muon needs DeepSpeed >= {need} (installed: {version}); scripts/setup.sh installs one"
    return None


def optimizer_table(value: object) -> object:
    """``value`` as a table with its ``type`` (:func:`choice_table`): a table without ``type`` is
    AdamW's."""
    return choice_table(value, "adamw")


class _OptimizerChoice(Section):
    """Base of each choice: a key that is not the choice's own is one line naming its flag."""

    @model_validator(mode="before")
    @classmethod
    def _own_parameters(cls, data: object) -> object:
        for key in foreign_keys(cls, data):
            raise ValueError(f"trainer.optimizer.{key}: not a parameter of --trainer.optimizer "
                             f"{data.get('type')} ({_parameters()})")  # type: ignore[attr-defined]
        return data


def _parameters() -> str:
    """Each choice's parameters, for an error line: ``adamw: none; muon: lr, momentum``."""
    return "; ".join(f"{m.model_fields['type'].default}: {', '.join(n for n in m.model_fields if n != 'type') or 'none'}"
                     for m in (AdamWConfig, MuonConfig))


class AdamWConfig(_OptimizerChoice):
    """torch's fused AdamW, at --trainer.lr."""

    type: Literal["adamw"] = "adamw"


class MuonConfig(_OptimizerChoice):
    """DeepSpeed's Muon for the 2-D hidden matrices, AdamW (at --trainer.lr) for the rest."""

    type: Literal["muon"] = "muon"
    lr: float | None = Field(None, gt=0.0, le=1.0, description="Muon's learning rate for the hidden "
                             "matrices (its update is orthogonalised: about 1/sqrt(width) per entry, "
                             "so it is usually set well above AdamW's). Unset: --trainer.lr.")
    momentum: float = Field(0.95, ge=0.0, lt=1.0, description="Muon's momentum (Nesterov).")

    @model_validator(mode="after")
    def _deepspeed_has_muon(self) -> "MuonConfig":
        why = muon_refusal()
        if why is not None:
            raise ValueError(f"trainer.optimizer: {why}")
        return self


#: ``TrainerConfig.optimizer``'s type: one of the choices, told by ``type``.
OptimizerConfig = Annotated[AdamWConfig | MuonConfig, Field(discriminator="type")]
