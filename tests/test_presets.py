"""Every ``presets/*.toml`` loads through the real configuration parser (``--config FILE``,
``pipeline_rl.cli.parse_config``) and holds the values the README names for it; nothing is run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeline_rl.cli import parse_config
from pipeline_rl.config import Config

PRESETS = Path(__file__).resolve().parent.parent / "presets"
REAL_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Expected:
    """What a preset must resolve to (README.md's flags for that run)."""

    model: str | None
    task: str
    max_steps: int
    eval_every: int
    lora_rank: int = 0
    agent: str | None = None


EXPECTED: dict[str, Expected] = {
    "smollm2-word-problems": Expected(REAL_MODEL, "word_problems", 60, 10),
    "smollm2-word-problems-lora": Expected(REAL_MODEL, "word_problems", 60, 10, lora_rank=16),
    "smollm2-word-problems-agent": Expected(REAL_MODEL, "word_problems", 60, 10,
                                            agent="pipeline_rl.tasks.word_problems_agent:solve"),
    "calc-agent": Expected(None, "calc", 200, 50, agent="pipeline_rl.tasks.calc_agent:calc"),
}


def _load(name: str, *flags: str) -> Config:
    cfg, dry_run = parse_config(["--config", str(PRESETS / f"{name}.toml"), *flags], check_cpu=False)
    assert not dry_run
    return cfg


def test_every_preset_is_checked() -> None:
    assert sorted(p.stem for p in PRESETS.glob("*.toml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_preset_loads_with_the_values_the_readme_names(name: str) -> None:
    cfg, want = _load(name), EXPECTED[name]
    got = Expected(cfg.model.path, cfg.task.name, cfg.max_steps, cfg.eval.every, cfg.lora.rank if cfg.lora else 0,
                   cfg.task.agent)
    assert got == want


def test_a_flag_after_the_preset_overrides_it() -> None:
    cfg = _load("smollm2-word-problems", "--max-steps", "5", "--eval.every", "0")
    assert (cfg.max_steps, cfg.eval.every, cfg.task.name) == (5, 0, "word_problems")
