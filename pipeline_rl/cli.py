"""Command line for :class:`pipeline_rl.config.Config`, generated from the model, and the
``pipeline-rl`` command (:func:`main`).

Each section becomes an argparse group (``--rollout.n``); each field's
description is its help. A usage error prints exactly one line,
``error: --FLAG: what is wrong``, and exits with status 2.

``pipeline-rl run ARGS`` is ``python launch/async_grpo.py ARGS``: both call
:func:`train_main`. ``pipeline-rl ablate ARGS`` is ``python -m benchmarks.ablation ARGS``
(from the repository root). ``python -m pipeline_rl.cli`` is the same command without the
installed script.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from pipeline_rl.config import Config
from pipeline_rl.config.config_renames import renamed_line
from pipeline_rl.models.pretrained import PRETRAINED
from pipeline_rl.profiles import PRETRAINED_DEFAULTS, PRETRAINED_LORA_DEFAULTS


class UsageError(ValueError):
    """A bad command line or configuration; the message is one line naming the flag."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(_rephrase_argparse(message))


def _rephrase_argparse(message: str) -> str:
    """argparse's messages, rephrased to start with the flag: ``--flag: what is wrong``."""
    if message.startswith("argument "):
        flag, _, rest = message.removeprefix("argument ").partition(": ")
        return f"{flag.split('/')[0]}: {rest}"
    if message.startswith("unrecognized arguments: "):
        flag = message.removeprefix("unrecognized arguments: ").split()[0].partition("=")[0]
        moved = renamed_line(flag.removeprefix("--"))
        return f"--{moved}" if moved else f"{flag}: unknown flag (see --help)"
    return message


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _nullable(conv: Any) -> Any:
    def parse(text: str) -> Any:
        return None if text.lower() in ("none", "null", "") else conv(text)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _choices_of(info: Any) -> dict[str, type[BaseModel]] | None:
    """A field that is a choice of sections told by a discriminator (``trainer.optimizer``):
    each choice's tag -> its model; None for any other field."""
    if not isinstance(info.discriminator, str) or get_origin(info.annotation) not in (Union, types.UnionType):
        return None
    models = [m for m in get_args(info.annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    return {tag: m for m in models for tag in get_args(m.model_fields[info.discriminator].annotation)}


def _add_choice_section(parser: argparse.ArgumentParser, sec: str, info: Any,
                        choices: dict[str, type[BaseModel]]) -> None:
    """A section that is one choice (``correction``): ``--SEC.TYPE TAG`` picks it; every parameter
    is ``--SEC.PARAM``, those of one choice only helped as ``With --SEC.TYPE TAG: ``."""
    disc, models = info.discriminator, list(dict.fromkeys(choices.values()))
    group = parser.add_argument_group(sec, (info.description or "").strip())
    shared = set.intersection(*(set(m.model_fields) for m in models))
    default = getattr(info.get_default(call_default_factory=True), disc)
    tags = list(choices)
    dfield = models[0].model_fields[disc]
    group.add_argument(f"--{sec}.{disc}", dest=f"{sec}.{disc}", default=argparse.SUPPRESS, choices=tags,
                       metavar="{" + ",".join(tags) + "}",
                       help=(dfield.description or "").replace("%", "%%") + f" (default: {default})")
    seen = {disc}
    for model in models:
        own = model.model_config.get("title") or ",".join(t for t, m in choices.items() if m is model)
        for name, finfo in model.model_fields.items():
            if name not in seen:
                seen.add(name)
                prefix = "" if name in shared else f"With --{sec}.{disc} {own}: "
                _add_field(group, f"{sec}.{name}", f"{sec}.{name}", finfo, prefix)


def _add_choice(group: Any, dest: str, info: Any, choices: dict[str, type[BaseModel]]) -> None:
    """``--DEST TAG`` picks the choice (its discriminator); ``--DEST.PARAM`` sets a parameter of
    the choice that has it (the help names which)."""
    tags = list(choices)
    default = info.get_default(call_default_factory=True)
    group.add_argument(f"--{dest}", dest=f"{dest}.{info.discriminator}", default=argparse.SUPPRESS,
                       choices=tags, metavar="{" + ",".join(tags) + "}",
                       help=(info.description or "").replace("%", "%%")
                       + f" (default: {getattr(default, info.discriminator)})")
    seen = {info.discriminator}
    for tag, model in choices.items():
        for name, finfo in model.model_fields.items():
            if name not in seen:
                seen.add(name)
                _add_field(group, f"{dest}.{name}", f"{dest}.{name}", finfo, f"With --{dest} {tag}: ")


def _add_field(group: Any, dest: str, name: str, info: Any, prefix: str = "") -> None:
    union = _choices_of(info)
    if union is not None:
        _add_choice(group, dest, info, union)
        return
    tp, optional = _unwrap_optional(info.annotation)
    kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS}
    default = info.get_default(call_default_factory=True)
    pretrained = PRETRAINED_DEFAULTS.get(dest)
    shown = "unset" if info.is_required() else f"{default}"
    shown += "" if pretrained is None else f"; --profile pretrained: {pretrained}"
    if dest in PRETRAINED_LORA_DEFAULTS:
        shown += f", with --lora.rank > 0: {PRETRAINED_LORA_DEFAULTS[dest]}"
    help_text = prefix + (info.description or "").replace("%", "%%") + f" (default: {shown})"
    if get_origin(tp) is Literal:
        choices = list(get_args(tp))
        kwargs.update(choices=choices, metavar="{" + ",".join(map(str, choices)) + "}")
        conv: Any = type(choices[0])
    elif tp is bool:
        conv = _parse_bool
        kwargs["metavar"] = "BOOL"
    else:
        conv = tp
        kwargs["metavar"] = getattr(tp, "__name__", "VALUE").upper()
    kwargs["type"] = _nullable(conv) if optional else conv
    group.add_argument(f"--{name}", help=help_text, **kwargs)


def build_parser(prog: str = "async_grpo.py", description: str | None = None) -> argparse.ArgumentParser:
    """The argument parser: top-level flags first, then one group per section."""
    parser = _Parser(prog=prog, description=description or "Fully asynchronous GRPO: vLLM rollouts, "
                     "ZeroMQ buffer, DeepSpeed trainer, in-flight weight updates, Ray placement.")
    top = parser.add_argument_group("general")   # not "run": that is the restart limits' section
    top.add_argument("--config", default=None, metavar="FILE.toml",
                     help="TOML file with the same keys (sections as tables); flags override it.")
    top.add_argument("--dry-run", action="store_true", dest="dry_run",
                     help="Print the resolved configuration as JSON and exit.")
    top.add_argument("--model", dest="model.path", default=argparse.SUPPRESS, metavar="PATH_OR_NAME",
                     help="Shorthand for --model.path: a model folder, a cached hub id, or "
                     f"{' or '.join(PRETRAINED)} (a pretrained chat model from a package).")
    top.add_argument("--dataset", dest="task.dataset", default=argparse.SUPPRESS, metavar="FILE",
                     help="Shorthand for --task.dataset (a local .jsonl/.json/.parquet/.arrow/.csv "
                     "file or a save_to_disk folder).")
    top.add_argument("--ray-address", dest="ray.address", default=argparse.SUPPRESS, metavar="ADDRESS",
                     help="Shorthand for --ray.address (join an existing cluster).")
    sections = [(name, info) for name, info in Config.model_fields.items()
                if _section_of(info) is not None or _choices_of(info) is not None]
    for name, info in Config.model_fields.items():
        if name not in dict(sections):
            _add_field(top, name, name.replace("_", "-"), info)
    for sec_name, info in sections:
        model, union = _section_of(info), _choices_of(info)
        if union is not None:   # a section that is one choice (correction)
            _add_choice_section(parser, sec_name, info, union)
            continue
        assert model is not None
        group = parser.add_argument_group(sec_name, (model.__doc__ or "").strip())
        for name, finfo in model.model_fields.items():
            _add_field(group, f"{sec_name}.{name}", f"{sec_name}.{name}", finfo)
    return parser


def _section_of(info: Any) -> type[BaseModel] | None:
    """The model of a section field (``rollout``), or of an optional one (``lora``: None when off)."""
    ann, _ = _unwrap_optional(info.annotation)
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _choice_tables(data: dict[str, Any]) -> dict[str, Any]:
    """A TOML file's bare choice (``optimizer = "muon"``) as its table, so that flags of the
    choice's parameters merge into it."""
    out = dict(data)
    for sec, info in Config.model_fields.items():
        model = info.annotation
        if _choices_of(info) is not None and isinstance(out.get(sec), str):   # correction = "icepop"
            out[sec] = {info.discriminator: out[sec]}
        if not (isinstance(out.get(sec), dict) and isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for name, finfo in model.model_fields.items():
            choices = _choices_of(finfo)
            if choices is not None and isinstance(out[sec].get(name), str):
                out[sec] = {**out[sec], name: {finfo.discriminator: out[sec][name]}}
    return out


def _flag_of(loc: tuple[Any, ...]) -> str:
    """The flag of pydantic's location; a choice's tag (``trainer.optimizer.muon.momentum``) is
    no part of it (``--trainer.optimizer.momentum``)."""
    parts: list[str] = []
    model: type[BaseModel] | None = Config
    tags: dict[str, type[BaseModel]] = {}   # the choices of the field just passed, if a choice
    info: Any = None
    for p in (str(p) for p in loc if not str(p).startswith("function-")):
        if p in tags:
            model, tags = tags[p], {}
            continue
        parts.append(p)
        info = model.model_fields.get(p) if model is not None else None
        tags = (_choices_of(info) or {}) if info is not None else {}
        model = _section_of(info) if info is not None else None
    if tags and len(parts) == 1 and info is not None:   # a section that is a choice: its tag's flag
        parts.append(str(info.discriminator))
    return "--" + ".".join(parts) if parts else "config"


def format_validation_error(err: ValidationError) -> str:
    """The first problem as one line: ``--flag: message (got value)``.

    Cross-field validators already phrase their message as ``section.field: ...``;
    field errors get the flag from pydantic's location.
    """
    first = err.errors()[0]
    msg = str(first["msg"]).removeprefix("Value error, ")
    head = msg.split(": ", 1)[0]
    if ": " in msg and head.replace(".", "").replace("_", "").isalnum() and "." in head:
        return "--" + msg
    got = first.get("input")
    suffix = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
    return f"{_flag_of(tuple(first.get('loc', ())))}: {msg}{suffix}"


def parse_config(argv: list[str] | None = None, *, check_cpu: bool | None = None) -> tuple[Config, bool]:
    """Parse flags (and ``--config``) into a validated Config. Returns (config, dry_run).

    Raises UsageError with a one-line message on any problem. ``check_cpu``
    (default: when no CUDA device is visible) also rejects head dimensions that
    vLLM's CPU backend cannot run.
    """
    ns = vars(build_parser().parse_args(argv))
    config_file, dry_run = ns.pop("config"), ns.pop("dry_run")
    data: dict[str, Any] = {}
    try:
        if config_file:
            data = _choice_tables(load_toml(config_file))
        data = _merge(data, _nest(ns))
        cfg = Config.model_validate(data)
        cpu_only = check_cpu if check_cpu is not None else not _cuda_visible()
        if cpu_only:
            from pipeline_rl.models.check import check_cpu_head_dim

            check_cpu_head_dim(cfg.model)
            if cfg.model.device == "cuda":
                raise UsageError("--model.device: cuda asked for, but this machine has no CUDA GPU")
    except ValidationError as e:
        raise UsageError(format_validation_error(e)) from None
    except ValueError as e:
        msg = str(e)
        raise UsageError(msg if msg.startswith("--") else "--" + msg) from None
    return cfg, dry_run


def _cuda_visible() -> bool:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def main_config(argv: list[str] | None = None, prog: str = "async_grpo.py") -> Config | None:
    """Entry helper for launch scripts: parse, print errors as one line and exit 2,
    print the config and return None on ``--dry-run``."""
    try:
        cfg, dry_run = parse_config(argv)
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if dry_run:   # the resolved values: the profile's defaults filled in
        print(json.dumps(cfg.model_dump(), indent=2))
        return None
    return cfg


def load_toml(path: str | Path) -> dict[str, object]:
    """Read a TOML config file (same keys as the flags, sections as tables)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config: no such file: {p}")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config: {p} is not valid TOML: {e}") from None


# --- the `pipeline-rl` command ----------------------------------------------------------------

#: The installed command's name (``[project.scripts]`` in pyproject.toml).
PROG = "pipeline-rl"


def train_main(argv: list[str] | None = None) -> int:
    """The main job, ``python launch/async_grpo.py`` and ``pipeline-rl run`` alike: parse the
    flags (a usage error is one line, exit 2), print the configuration on ``--dry-run``, else run
    it; returns the exit status."""
    cfg = main_config(argv)
    if cfg is None:
        return 0
    from pipeline_rl.driver import run

    return run(cfg)


def _ablate_main(argv: list[str]) -> int:
    """``python -m benchmarks.ablation ARGS`` in a process of its own, from the repository root
    (the working directory): the benchmarks are a folder of the checkout, not of the installed
    package, and the package never imports them (they import it). Returns its exit status."""
    import subprocess

    here = Path.cwd()
    if not (here / "benchmarks" / "ablation.py").is_file():
        print(f"{PROG}: error: ablate: benchmarks/ablation.py is not in {here}; run "
              f"{PROG} ablate from the repository root", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, "-m", "benchmarks.ablation", *argv], cwd=here).returncode


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One subcommand of ``pipeline-rl``: its one line of help, and its main, which takes the
    arguments after the subcommand's name and returns the exit status."""

    summary: str
    main: Callable[[list[str]], int]


SUBCOMMANDS: dict[str, Subcommand] = {
    "run": Subcommand("the main job, as python launch/async_grpo.py (pipeline-rl run --help: its flags)",
                      lambda argv: train_main(argv)),   # looked up when called
    "ablate": Subcommand("the staleness x correction grid, as python -m benchmarks.ablation "
                         "(from the repository root)", _ablate_main),
}

#: Names asked for that are no subcommand (yet), with what to use instead.
NOT_SUBCOMMANDS: dict[str, str] = {
    "eval": "there is no evaluation of a checkpoint on its own; a run evaluates held-out prompts "
            "as it trains (pipeline-rl run --eval.every N; the results are in its folder's eval.jsonl)",
}


def command_help() -> str:
    """``pipeline-rl --help``: the usage line and one line per subcommand."""
    width = max(map(len, SUBCOMMANDS))
    rows = [f"  {name:<{width}}  {sub.summary}" for name, sub in SUBCOMMANDS.items()]
    return "\n".join([f"usage: {PROG} {{{','.join(SUBCOMMANDS)}}} [ARGS ...]", "",
                      "Fully asynchronous pipeline RL for language models.", "", "subcommands:", *rows])


def main(argv: list[str] | None = None) -> int:
    """``pipeline-rl SUBCOMMAND ARGS``: the subcommand's main gets ARGS and its exit status is
    returned. ``--help`` lists the subcommands; none, or an unknown one, is one line, status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(command_help())
        return 0
    choices = ", ".join(SUBCOMMANDS)
    if not args:
        print(f"{PROG}: error: name a subcommand: {choices} (see {PROG} --help)", file=sys.stderr)
        return 2
    name, rest = args[0], args[1:]
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        why = NOT_SUBCOMMANDS.get(name, f"unknown subcommand (choose from {choices}; see {PROG} --help)")
        print(f"{PROG}: error: {name}: {why}", file=sys.stderr)
        return 2
    return sub.main(rest)


if __name__ == "__main__":   # python -m pipeline_rl.cli: the package's module, not a copy as __main__
    from pipeline_rl.cli import main as _main

    raise SystemExit(_main())
