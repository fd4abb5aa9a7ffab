"""README.md's flags exist and the defaults it states are the defaults.

The launcher's flags are read from its parser (``pipeline_rl.cli.build_parser``, what
``launch/async_grpo.py --help`` prints) and its defaults from the configuration model;
a benchmark's or script's flags from its source (``add_argument`` calls; ``case``
patterns of a shell script). Nothing is run.

The README's conventions, which this test reads:

1. **Whose flag.** A ``--flag`` belongs to the program named last before it in the same
   command: a fenced code block's line (joined over trailing ``\\``; a ``#`` comment is
   a command of its own) or, in prose, the inline code spans of one paragraph (a bullet
   is a paragraph), in order. ``launch/async_grpo.py`` is the launcher; a benchmark
   (``benchmarks.NAME`` or its file) that benchmark; a script of ``scripts/`` (``setup.sh``,
   ``wheelhouse.py``, with or without its folder) that script; a bare ``--`` in a benchmark's
   command hands the rest to the launcher. Where no program is named yet, the flag is the
   launcher's. A dotted flag (``--task.reward_timeout_s``) is always the launcher's.
   Flags of other programs (``pip --no-index``, ``python -m venv --system-site-packages``,
   ``ray start --head``) are not checked: name the program in the span or command
   (:data:`OTHER_PROGRAMS`), or list the flag in :data:`OTHER_FLAGS`.
2. **Values.** A launcher flag followed by a value in a command or span
   (``--correction.type icepop``) must take that value when the flag has fixed choices;
   a placeholder (upper case like ``DIR``, or with ``|``, ``<``, ``...``) is not checked.
3. **Stated defaults.** A launcher flag's default is stated in one of two ways:

   - right after its code span: ``\\`--task.reward_timeout_s\\` (default 60)`` (also
     ``(default: 60)``, and the value may be in backquotes);
   - a Markdown table with a ``Flag`` column and a ``Default`` column.

   The stated value is converted as the command line would convert it (``60`` for a
   float field is 60.0; ``true``/``false``; ``none``/``unset`` for an unset field) and
   compared with the configuration's default. Any other way of writing a default is not
   checked, so do not write one.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LAUNCHER = "launcher"

#: Programs whose flags the README may show but this test does not check.
OTHER_PROGRAMS = frozenset({"pip", "pip3", "uv", "python", "python3", "venv", "git", "ldd", "bash", "sh",
                            "pytest", "ray", "conda", "docker", "nvidia-smi", "tensorboard", "curl", "wget"})
#: Flags of other programs the README shows without naming the program in the same span.
OTHER_FLAGS = frozenset({"--system-site-packages"})   # python -m venv's, which scripts/setup.sh passes

_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|[|<>]|\.\.\.")
_DEFAULT_AFTER = re.compile(r"`(--[\w.-]+)[^`]*`\s*\(default:?\s*`?([^)`]*)`?\)")


@dataclass(frozen=True)
class Mention:
    """A flag as the README shows it: whose (:data:`LAUNCHER`, ``benchmarks.NAME``,
    ``scripts/`` and a script's file name, or None: another program's), the value after it, its line."""

    flag: str
    tool: str | None
    value: str | None
    line: int


def _tool_of(token: str) -> str | None | bool:
    """The program a token names: a tool key, None (another program), False (not a program)."""
    token = token.strip("`'\"(),;:")
    if token.endswith("async_grpo.py"):
        return LAUNCHER
    if (m := re.match(r"^(?:.*/)?benchmarks[./](\w+)(?:\.py)?$", token)):
        return f"benchmarks.{m.group(1)}"
    if (m := re.match(r"^(?:.*/)?(?:scripts/)?(setup\.sh|test\.sh|wheelhouse\.py|warmstart\.py)$", token)):
        return f"scripts/{m.group(1)}"
    if token.rsplit("/", 1)[-1] in OTHER_PROGRAMS:
        return None
    return False


def _walk(tokens: list[str], tool: str | None, line: int) -> tuple[list[Mention], str | None]:
    """Mentions among ``tokens`` (one command), starting as ``tool``'s; returns them and
    the program named last."""
    out = []
    for i, raw in enumerate(tokens):
        token = raw.strip("`,;:()")
        named = _tool_of(raw)
        if named is not False:
            tool = named if not isinstance(named, bool) else tool
            continue
        if token == "--" and tool is not None and tool != LAUNCHER:
            tool = LAUNCHER
        elif re.match(r"^--[a-z][\w.-]*(=.*)?$", token):
            flag, _, value = token.partition("=")
            nxt = tokens[i + 1].strip("`,;:()") if i + 1 < len(tokens) else ""
            value = value or (nxt if nxt and not nxt.startswith("-") and _tool_of(nxt) is False else "")
            whose = LAUNCHER if "." in flag else tool
            out.append(Mention(flag, None if flag in OTHER_FLAGS else whose, value or None, line))
    return out, tool


def _paragraphs(text: str) -> Iterator[tuple[int, str, bool]]:
    """``(first line, text, is code)``: each fenced block's logical lines, each prose paragraph."""
    lines = text.splitlines()
    i, start = 0, 0
    para: list[str] = []
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            if para:
                yield start, "\n".join(para), False
                para = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                first, logical = i + 1, lines[i]
                while logical.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    logical = logical[:-1] + " " + lines[i]
                yield first, logical, True
                i += 1
        elif not line.strip() or re.match(r"^\s*([-*]|\d+\.) ", line):
            if para:
                yield start, "\n".join(para), False
            para, start = ([line], i + 1) if line.strip() else ([], i + 1)
        else:
            if not para:
                start = i + 1
            para.append(line)
        i += 1
    if para:
        yield start, "\n".join(para), False


def mentions(text: str) -> list[Mention]:
    """Every flag the Markdown ``text`` shows, with whose it is (see the module docstring)."""
    out: list[Mention] = []
    for line, para, code in _paragraphs(text):
        if code:
            command, _, comment = para.partition(" #")
            found, _ = _walk(command.split(), LAUNCHER, line)
            out += found
            for span in re.findall(r"`([^`]+)`", comment):
                out += _walk(span.split(), LAUNCHER, line)[0]
            continue
        tool: str | None = LAUNCHER
        for m in re.finditer(r"`([^`]+)`", para):
            found, tool = _walk(m.group(1).split(), tool, line + para[:m.start()].count("\n"))
            out += found
    return out


def stated_defaults(text: str) -> list[tuple[str, str, int]]:
    """``(flag, stated default, line)`` by the two conventions of the module docstring."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        out += [(m.group(1), m.group(2).strip(), n) for m in _DEFAULT_AFTER.finditer(line)]
    header: list[str] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip().lower() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif "flag" in header and "default" in header and not all(re.fullmatch(r":?-+:?", c) for c in cells):
            raw = [c.strip() for c in line.strip().strip("|").split("|")]
            flags = re.findall(r"`(--[\w.-]+)", raw[header.index("flag")])
            default = raw[header.index("default")].strip("` ")
            out += [(f, default, n) for f in flags]
    return out


# -- the programs' flags --------------------------------------------------------------------

def launcher_actions() -> dict[str, Any]:
    """Option string -> argparse action of the launcher's parser (what ``--help`` lists)."""
    from pipeline_rl.cli import build_parser

    parser = build_parser()
    return {opt: action for action in parser._actions for opt in action.option_strings}


def source_flags(tool: str) -> set[str]:
    """The flags a benchmark's or script's source defines (``add_argument``; a shell
    script's ``case`` patterns); a benchmark has ``benchmarks/common.py``'s too."""
    if tool.startswith("benchmarks."):
        files = [ROOT / "benchmarks" / f"{tool.split('.', 1)[1]}.py", ROOT / "benchmarks" / "common.py"]
    else:
        files = [ROOT / tool]
    flags = {"-h", "--help"}
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text()
        if path.suffix == ".sh":
            flags |= set(re.findall(r"^\s*(?:-\w\|)?(--[\w-]+)(?:=\*)?\)", text, re.M))
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                          and a.value.startswith("-")}
    return flags


def config_default(dest: str) -> Any:
    """The configuration's default for an argparse ``dest`` (``task.reward_timeout_s``): a section
    that is a choice (``correction``, ``trainer.optimizer``) is read from its default's model, an
    optional one (``lora``, None by default) from the model it is when given."""
    import types
    from typing import get_args

    from pydantic import BaseModel

    from pipeline_rl.config import Config

    model: Any = Config
    *sections, leaf = dest.split(".")
    for name in sections:
        info = model.model_fields[name]
        default = info.get_default(call_default_factory=True)
        ann = info.annotation
        if isinstance(default, BaseModel):
            model = type(default)
        elif isinstance(ann, types.UnionType):
            model = next(a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel))
        else:
            model = ann
    return model.model_fields[leaf].get_default(call_default_factory=True)


def _convert(action: Any, text: str) -> Any:
    if text.lower() in ("unset", "none", "null"):
        return None
    try:
        return action.type(text) if action.type is not None else text
    except (TypeError, ValueError):
        return text


def wrong_flags(text: str) -> list[str]:
    """``line: flag (whose)`` for every flag ``text`` shows that its program does not have."""
    actions = launcher_actions()
    cache: dict[str, set[str]] = {}
    out = []
    for m in mentions(text):
        if m.tool is None:
            continue
        known = set(actions) | {"-h", "--help"} if m.tool == LAUNCHER else cache.setdefault(m.tool, source_flags(m.tool))
        if m.flag not in known:
            out.append(f"README.md:{m.line}: {m.flag} ({m.tool} has no such flag)")
    return out


def wrong_values(text: str) -> list[str]:
    """``line: flag value`` for a launcher flag shown with a value outside its choices."""
    actions = launcher_actions()
    out = []
    for m in mentions(text):
        action = actions.get(m.flag) if m.tool == LAUNCHER else None
        if action is None or not action.choices or m.value is None or _PLACEHOLDER.search(m.value):
            continue
        if _convert(action, m.value) not in action.choices:
            out.append(f"README.md:{m.line}: {m.flag} {m.value} (choices: {', '.join(map(str, action.choices))})")
    return out


def wrong_defaults(text: str) -> list[str]:
    """``line: flag (default X) but the default is Y`` for every stated default that is not."""
    actions = launcher_actions()
    out = []
    for flag, stated, line in stated_defaults(text):
        action = actions.get(flag)
        if action is None or action.dest in ("help", "config", "dry_run"):
            out.append(f"README.md:{line}: {flag} (default {stated}): the launcher has no such setting")
            continue
        default = config_default(action.dest)
        if _convert(action, stated) != default and stated != str(default):
            out.append(f"README.md:{line}: {flag} (default {stated}), but the default is {default}")
    return out


# -- the README ------------------------------------------------------------------------------

def test_every_flag_the_readme_shows_exists() -> None:
    assert wrong_flags(README.read_text()) == []


def test_every_value_the_readme_gives_a_choice_flag_is_a_choice() -> None:
    assert wrong_values(README.read_text()) == []


def test_every_default_the_readme_states_is_the_default() -> None:
    assert wrong_defaults(README.read_text()) == []


# -- the reader, on a README made up here ----------------------------------------------------

SAMPLE = """\
# Sample

Run `python launch/async_grpo.py --staleness 2` or with `--task.name countdown`;
`--no.such_flag` is wrong, as is `--rollout.engine turbo`, and `--rollout.engine MODE` is a placeholder.

```bash
python launch/async_grpo.py --max-steps 20 \\
    --correction.type icepop --bogus 1
python -m benchmarks.peers --seeds 5 --not-a-peers-flag -- --task.digits 3
bash scripts/setup.sh --wheelhouse wheels/   # then `pip list --format=freeze`
```

- `python -m benchmarks.demo --repeats 3`; also `--steps 40` and `--max-steps`.
- `pip --no-index`, `--anything-pip`; `python -m venv --system-site-packages`.

`--task.reward_timeout_s` (default 60) and `--staleness` (default: `3`) and `--watchdog-s` (default 120)

| Flag | Default | What |
|---|---|---|
| `--rollout.n` | 8 | samples per prompt |
| `--eval.every` | 1 | wrong |
"""


def test_the_reader_sees_whose_each_flag_is() -> None:
    seen = {(m.flag, m.tool) for m in mentions(SAMPLE)}
    assert {("--staleness", LAUNCHER), ("--task.name", LAUNCHER), ("--max-steps", LAUNCHER),
            ("--correction.type", LAUNCHER), ("--seeds", "benchmarks.peers"), ("--task.digits", LAUNCHER),
            ("--wheelhouse", "scripts/setup.sh"), ("--format", None), ("--repeats", "benchmarks.demo"),
            ("--steps", "benchmarks.demo"), ("--max-steps", "benchmarks.demo"), ("--no-index", None),
            ("--anything-pip", None), ("--system-site-packages", None)} <= seen


def test_a_wrong_flag_value_or_default_fails() -> None:
    assert [w.split(": ", 1)[1] for w in wrong_flags(SAMPLE)] == [
        "--no.such_flag (launcher has no such flag)", "--bogus (launcher has no such flag)",
        "--not-a-peers-flag (benchmarks.peers has no such flag)", "--max-steps (benchmarks.demo has no such flag)"]
    assert [w.split(": ", 1)[1] for w in wrong_values(SAMPLE)] == [
        "--rollout.engine turbo (choices: auto, inprocess, async)"]
    assert wrong_defaults(SAMPLE) == ["README.md:16: --staleness (default 3), but the default is 2",
                                      "README.md:21: --eval.every (default 1), but the default is 50"]
    assert stated_defaults(SAMPLE) == [("--task.reward_timeout_s", "60", 16), ("--staleness", "3", 16),
                                       ("--watchdog-s", "120", 16), ("--rollout.n", "8", 20), ("--eval.every", "1", 21)]


@pytest.mark.parametrize("flag,stated", [("--rollout.n", "8"), ("--task.reward_timeout_s", "60.0"),
                                         ("--model.path", "unset"), ("--rollout.engine", "`auto`")])
def test_a_right_default_passes(flag: str, stated: str) -> None:
    assert wrong_defaults(f"`{flag}` (default {stated})\n") == []


def test_the_readme_stays_at_most_260_lines() -> None:
    """The front page stays short; detail goes in docs/."""
    assert len(README.read_text().splitlines()) <= 260


def test_the_python_requirement_is_the_same_everywhere() -> None:
    """pyproject.toml, scripts/setup.sh's check and the README state one requirement, and it
    is one the code meets (``tomllib``, imported by the command line, is Python 3.11's)."""
    found = re.search(r'requires-python = ">=(\d+)\.(\d+)"', (ROOT / "pyproject.toml").read_text())
    assert found is not None
    major, minor = int(found.group(1)), int(found.group(2))
    assert (major, minor) >= (3, 11)
    assert f"Python ≥ {major}.{minor}" in README.read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"sys.version_info >= ({major}, {minor})" in setup and f"Python >= {major}.{minor} is required" in setup
