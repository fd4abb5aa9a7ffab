"""``--correction.*``: the off-policy correction as one choice that carries its own parameters
(docs/objectives.md).

A discriminated union on ``type`` (:data:`Correction`, the type of ``Config.correction``):
:class:`PresetCorrection` (``none``, ``tis``, ``icepop``, ``seq-mask-tis``, ``m2po``, tuned by the
presets' knobs ``tis_cap``, ``icepop_*``, ``seq_*``) or :class:`CustomCorrection` (``custom``: the
composition ``weight``, ``weight_cap``, ``reject``, ``reject_lo``, ``reject_hi``). Both are a
:class:`CorrectionConfig`, which holds the add-ons any choice takes (``veto``, ``m2po``,
``m2po_tau``); ``CorrectionConfig(type=..., ...)`` builds the choice its ``type`` names.

Invariants: a table without ``type`` is ``tis``'s and a bare name is the table ``{type = NAME}``
(:func:`correction_table`); a parameter of the other choice is one line naming its flag
(``correction.weight: composes --correction.type custom; ...``). Its own module for its size;
``pipeline_rl.config`` re-exports it. Stdlib and pydantic only (``--help`` stays instant).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import ConfigDict, Field, model_validator

from pipeline_rl.config_section import Section, choice_table, foreign_keys

PresetName = Literal["none", "tis", "icepop", "seq-mask-tis", "m2po"]
CorrectionName = Literal[PresetName, "custom"]
WeightLevel = Literal["none", "token", "sequence"]
RejectLevel = Literal["none", "token", "sequence", "geometric"]


def correction_table(value: object) -> object:
    """``value`` as a table with its ``type`` (:func:`choice_table`): a table without ``type`` is
    ``tis``'s."""
    return choice_table(value, "tis")


class CorrectionConfig(Section):
    """Off-policy correction (docs/design.md section 4, docs/objectives.md): the base of both
    choices, with the add-ons any of them takes. Built directly, it is the choice ``type`` names."""

    type: CorrectionName = "tis"
    veto: float | None = Field(None, gt=0.0, lt=1.0, description="Reject a whole sequence when one of its "
                               "tokens has pi/mu below this (verl's rollout_token_veto_threshold, e.g. 1e-4); "
                               "adds to any type. Unset: off.")
    m2po: bool = Field(False, description="Add M2PO's mask (arXiv 2510.01161) to any type: the kept tokens "
                       "with the largest (log pi/mu)^2 are masked until their mean is at most "
                       "--correction.m2po_tau (the m2po preset has it).")
    m2po_tau: float = Field(0.04, gt=0.0, le=100.0, description="M2PO: the bound on the batch's second "
                            "moment mean((log pi/mu)^2) (the paper's 0.04).")

    def __new__(cls, *args: Any, **data: Any) -> "CorrectionConfig":
        # CorrectionConfig(type=...) is the choice that type names; a choice's class builds itself.
        if cls is CorrectionConfig:
            cls = CustomCorrection if data.get("type") == "custom" else PresetCorrection
        return super().__new__(cls)

    @model_validator(mode="before")
    @classmethod
    def _own_parameters(cls, data: object) -> object:
        for key in foreign_keys(cls, data):
            _refuse_foreign(key, data.get("type", "tis"))  # type: ignore[attr-defined]
        return data


def _refuse_foreign(key: str, chosen: object) -> None:
    """The one line for ``--correction.KEY`` given with ``--correction.type CHOSEN`` where
    ``KEY`` is a parameter of the other choice (an unknown key is left to pydantic)."""
    if key in CustomCorrection.model_fields:
        raise ValueError(f"correction.{key}: composes --correction.type custom; {chosen} is a preset (its "
                         "own flags set it)")
    if key in PresetCorrection.model_fields:
        raise ValueError(f"correction.{key}: tunes a preset ({', '.join(_PRESETS)}); --correction.type "
                         "custom composes its own (--correction.weight, --correction.reject)")


class PresetCorrection(CorrectionConfig):
    """A preset: none, tis, icepop, seq-mask-tis or m2po, with the presets' knobs."""

    model_config = ConfigDict(title="PRESET")   # --help: "With --correction.type PRESET: ..."

    type: PresetName = Field("tis", description="A preset: none, tis, icepop, seq-mask-tis or m2po (M2PO, "
                             "arXiv 2510.01161: the token ratio as weight, uncapped, under M2PO's mask); or "
                             "custom: the composition of --correction.weight and --correction.reject. "
                             "--correction.veto and --correction.m2po add to any of them.")
    tis_cap: float = Field(2.0, gt=1.0, le=1e6, description="TIS: cap C on exp(r).")
    icepop_alpha: float = Field(0.5, gt=0.0, lt=1.0, description="ICEPOP: lower ratio bound.")
    icepop_beta: float = Field(5.0, gt=1.0, le=1e6, description="ICEPOP: upper ratio bound.")
    seq_lo: float = Field(0.5, gt=0.0, lt=1.0, description="Seq-Mask-TIS: lower geometric-mean bound.")
    seq_hi: float = Field(2.0, gt=1.0, le=1e6, description="Seq-Mask-TIS: upper geometric-mean bound.")
    seq_cap: float = Field(2.0, gt=1.0, le=1e6, description="Seq-Mask-TIS: per-token cap C.")

    @model_validator(mode="after")
    def _ordered(self) -> "PresetCorrection":
        if not self.icepop_alpha < self.icepop_beta:
            raise ValueError(f"correction.icepop_alpha: must be < correction.icepop_beta "
                             f"(got {self.icepop_alpha} >= {self.icepop_beta})")
        if not self.seq_lo < self.seq_hi:
            raise ValueError(f"correction.seq_lo: must be < correction.seq_hi "
                             f"(got {self.seq_lo} >= {self.seq_hi})")
        return self


class CustomCorrection(CorrectionConfig):
    """custom: an importance weight and a rejection, composed (docs/objectives.md)."""

    type: Literal["custom"] = "custom"
    weight: WeightLevel = Field("none", description="The importance weight: none, token (min(pi/mu, cap) "
                                "per token) or sequence (min(prod_t pi/mu, cap) on every token of the "
                                "sequence).")
    weight_cap: float | None = Field(None, gt=0.0, le=1e6, description="The weight's cap (unset: uncapped).")
    reject: RejectLevel = Field("none", description="Rejection: none, token (a token whose pi/mu is outside "
                                "[reject_lo, reject_hi]), sequence (a sequence whose prod_t pi/mu is outside) "
                                "or geometric (a sequence whose geometric mean exp(mean_t log pi/mu) is "
                                "outside).")
    reject_lo: float | None = Field(None, ge=0.0, le=1e6, description="The rejection's lower bound "
                                    "(unset: 1 / reject_hi, as verl).")
    reject_hi: float | None = Field(None, gt=0.0, le=1e6, description="The rejection's upper bound "
                                    "(needed by a rejection).")

    @model_validator(mode="after")
    def _composed(self) -> "CustomCorrection":
        if self.weight_cap is not None and self.weight == "none":
            raise ValueError("correction.weight_cap: caps an importance weight; --correction.weight is none")
        rejects = self.reject != "none"
        if not rejects and (self.reject_lo is not None or self.reject_hi is not None):
            flag = "reject_lo" if self.reject_lo is not None else "reject_hi"
            raise ValueError(f"correction.{flag}: bounds a rejection; --correction.reject is none")
        if rejects and self.reject_hi is None:
            raise ValueError(f"correction.reject_hi: --correction.reject {self.reject} needs an upper bound")
        lo, hi = self.reject_bounds()
        if rejects and not lo < hi:
            raise ValueError(f"correction.reject_lo: must be < correction.reject_hi (got {lo} >= {hi})")
        return self

    def reject_bounds(self) -> tuple[float, float]:
        """The rejection interval ``[lo, hi]`` (``lo`` unset: ``1 / hi``; no rejection: ``[0, inf]``)."""
        if self.reject_hi is None:
            return 0.0, float("inf")
        return (1.0 / self.reject_hi if self.reject_lo is None else self.reject_lo), self.reject_hi


_PRESETS: tuple[str, ...] = get_args(PresetName)

#: ``Config.correction``'s type: one of the choices, told by ``type``.
Correction = Annotated[PresetCorrection | CustomCorrection, Field(discriminator="type")]
