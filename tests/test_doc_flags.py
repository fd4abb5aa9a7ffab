"""Every dotted launcher flag that README.md, docs/*.md and presets/*.toml name still works:
it is one of the parser's flags (``pipeline_rl.cli.build_parser``, what ``launch/async_grpo.py
--help`` prints), or a moved key whose old spelling is one line naming the new one
(``pipeline_rl.config.config_renames``; results pages may quote a run's flags as they were).
A dotted flag (``--section.key``) is always the launcher's (tests/test_readme.py's convention);
the README's other flags, values and defaults are tests/test_readme.py's. Nothing is run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline_rl.cli import UsageError, build_parser, parse_config
from pipeline_rl.config.config_renames import renamed_line

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "presets").glob("*.toml"))]
#: ``--section.key`` (a dotted key may go deeper: ``--trainer.optimizer.lr``), not a word's tail.
DOTTED = re.compile(r"(?<![\w-])--([a-z_]+(?:\.[a-z_][a-z0-9_]*)+)")


def named_flags(text: str) -> set[str]:
    """The dotted flags ``text`` names, without their leading ``--``."""
    return set(DOTTED.findall(text))


def _where() -> dict[str, list[str]]:
    """Each dotted flag -> the files that name it."""
    found: dict[str, list[str]] = {}
    for path in SOURCES:
        for flag in named_flags(path.read_text()):
            found.setdefault(flag, []).append(str(path.relative_to(ROOT)))
    return found


def test_the_sources_name_flags() -> None:
    flags = _where()
    assert "rollout.n" in flags and "correction.type" in flags and "lora.rank" in flags


def test_every_dotted_flag_is_the_parsers_or_moved() -> None:
    options = {o for action in build_parser()._actions for o in action.option_strings}
    bad = [f"--{flag} ({', '.join(files)})" for flag, files in sorted(_where().items())
           if f"--{flag}" not in options and renamed_line(flag) is None]
    assert not bad, "flags no parser takes: " + "; ".join(bad)


@pytest.mark.parametrize("text, flags", [
    ("`--rollout.n 8` and --correction.type icepop", {"rollout.n", "correction.type"}),
    ("--trainer.optimizer.lr 0.02, not a--b.c, nor --staleness", {"trainer.optimizer.lr"}),
])
def test_the_reader_finds_dotted_flags(text: str, flags: set[str]) -> None:
    assert named_flags(text) == flags


def test_a_moved_flag_fails_in_one_line_naming_the_new_one() -> None:
    from pipeline_rl.config.config_renames import RENAMED

    for old, new in RENAMED.items():
        with pytest.raises(UsageError) as err:
            parse_config([f"--{old}", "1"], check_cpu=False)
        assert "\n" not in str(err.value) and f"--{new}" in str(err.value), str(err.value)


def _group(help_text: str, title: str) -> str:
    """The text of one argument group of ``--help`` (from ``title:`` to the next group)."""
    start = help_text.index(f"\n{title}:\n")
    end = re.search(r"\n\n[a-z]+:\n", help_text[start + 2:])
    return help_text[start: start + 2 + end.start()] if end else help_text[start:]


def test_help_shows_each_choice_with_its_parameters_under_its_section() -> None:
    """The unions: the correction's choice and each choice's parameters in the correction group,
    the optimizer's in the trainer group, the weight path's choices in the rollout group; no two
    groups share a title."""
    text = " ".join(build_parser().format_help().split(" "))
    titles = re.findall(r"\n([a-z]+):\n", text)
    assert len(titles) == len(set(titles)), titles
    correction = " ".join(_group(text, "correction").split())
    assert "--correction.type {none,tis,icepop,seq-mask-tis,m2po,custom}" in correction
    for flag in ("weight", "weight_cap", "reject", "reject_lo", "reject_hi"):
        assert f"--correction.{flag} " in correction and "With --correction.type custom:" in correction
    assert "With --correction.type PRESET: TIS: cap C" in correction
    trainer = " ".join(_group(text, "trainer").split())
    assert "--trainer.optimizer {adamw,muon}" in trainer and "With --trainer.optimizer muon: Muon's" in trainer
    rollout = " ".join(_group(text, "rollout").split())
    assert "--rollout.weight_path {auto,shm,gloo,ipc,nccl,object_store}" in rollout


def test_the_weight_transport_is_the_weight_path_now(tmp_path: Path) -> None:
    """``--rollout.weight_transport object_store`` (flag or --config key) is one line naming
    ``--rollout.weight_path object_store``, which parses."""
    toml = tmp_path / "run.toml"
    toml.write_text("[rollout]\nweight_transport = 'object_store'\n")
    for argv in (["--rollout.weight_transport", "object_store"], ["--config", str(toml)]):
        with pytest.raises(UsageError) as err:
            parse_config(argv, check_cpu=False)
        assert "\n" not in str(err.value) and "use --rollout.weight_path object_store" in str(err.value)
    cfg, _ = parse_config(["--rollout.weight_path", "object_store"], check_cpu=False)
    assert cfg.rollout.weight_path == "object_store"
