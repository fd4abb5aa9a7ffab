"""LoRA beside full fine-tuning on the real chat model: one table of ratios from
``benchmarks.real_model`` runs made in one sitting.

It reads the ``--out`` folders of three ``benchmarks.real_model`` runs of the same model,
task and batch (their ``real_model.json`` and ``run/metrics.jsonl``):

- ``--full``: full fine-tuning;
- ``--lora``: ``--lora.rank R`` in the default serving mode of the device (CPU: merged);
- ``--native``: the same adapter with ``--lora.serving native`` (may be shorter: 10 steps; its
  weight sync, stall p50 and tokens/s over busy time over steps 4-10 are read, each set against
  full's, so that a shorter sync is never shown without the generation it costs).

and reports, LoRA against full: held-out greedy accuracy and the training time to +0.3,
the entropy's largest ratio to step 1's over the first 20 steps, the mismatch KL, the
trainer's step (median ``train_step_s``: forward, backward and optimizer, the publish not
included), the median pipeline step, generated tokens/s over the worker's busy time (every
token its engine generated, held-out evaluations' included, over the seconds it was not idle
on the admission budget, from the run's totals between step 4 and the last step), stall
p50 and weight sync p50 (step end to every worker generating with the new version) in both
serving modes; and the tokens/s over steps 4-10 with the completions' median length, since
tokens/s follows the lengths the two policies learn. ``--lora-sync`` adds the bytes per version and the parts of a sync from
``benchmarks.lora_sync``'s JSON. Steps 1-3 (start-up) are left out of every median, as
``benchmarks.real_model`` does. ``--from-json`` renders an earlier ``--json`` again (the ratios
recomputed from its figures), reading no run folder.

Usage::

    python -m benchmarks.real_model --steps 30 --out F -- --task.name word_problems
    python -m benchmarks.real_model --steps 30 --out L -- --task.name word_problems --lora.rank 16
    python -m benchmarks.real_model --steps 10 --out N -- --task.name word_problems --lora.rank 16 \\
        --lora.serving native
    python -m benchmarks.lora_vs_full --full F --lora L --native N [--lora-sync JSON] [--md PATH]
    python -m benchmarks.lora_vs_full --from-json benchmarks/results/lora_vs_full.json [--json PATH] [--md PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import BadFlag, Outcome, main as bench_main
from benchmarks.real_model import WARMUP_STEPS, busy_tokens_per_s

#: The early window (steps 4-10), before two policies' completion lengths part: tokens/s
#: follows them (a decode step on a CPU reads every weight however few sequences it still
#: carries, so a batch whose completions end early makes fewer tokens per step).
EARLY_STEPS = 10


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--full", type=Path, default=None, metavar="DIR", help="The full fine-tuning run's --out folder.")
    p.add_argument("--lora", type=Path, default=None, metavar="DIR",
                   help="The LoRA run's --out folder (the device's default serving mode).")
    p.add_argument("--native", type=Path, default=None, metavar="DIR",
                   help="The LoRA run's --out folder with --lora.serving native (optional).")
    p.add_argument("--lora-sync", type=Path, default=None, metavar="JSON",
                   help="benchmarks.lora_sync's JSON: bytes per version and a sync's parts (optional).")
    p.add_argument("--from-json", type=Path, default=None, metavar="JSON",
                   help="Render this earlier --json again (ratios recomputed) instead of reading run folders.")


def _read(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``real_model.json`` and the metrics rows of one run folder; BadFlag when missing."""
    res, rows = folder / "real_model.json", folder / "run" / "metrics.jsonl"
    if not res.is_file() or not rows.is_file():
        raise BadFlag(f"{folder}: not a benchmarks.real_model --out folder (no real_model.json or run/metrics.jsonl)")
    return json.loads(res.read_text()), [json.loads(x) for x in rows.read_text().splitlines() if x.strip()]


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows[WARMUP_STEPS:] if r.get(key) is not None]
    return statistics.median(values) if values else None


def _side(folder: Path) -> dict[str, Any]:
    """One run's figures for the table."""
    res, rows = _read(folder)
    f = res["figures"]
    return {"completion_len": _median(rows, "completion_len_mean"),
            "tokens_per_s_busy_early": busy_tokens_per_s(rows[WARMUP_STEPS:EARLY_STEPS]), "flags": res["flags"], "greedy_first": f["greedy_first"], "greedy_last": f["greedy_last"],
            "greedy_gain": f["greedy_gain_reached"], "entropy_ratio": f["entropy_max_ratio_first20"],
            "mismatch_kl_max": f["mismatch_kl_max_first20"], "train_step_s": _median(rows, "train_step_s"),
            "step_s": f["step_time_s_median"], "tokens_per_s_busy": f["tokens_per_s_busy"],
            "stall_ms_p50": f["stall_ms_p50"], "sync_ms_p50": f["weight_sync_ms_p50"], "steps": f["steps"],
            "train_s": f["train_s"], "hardware": res["hardware"], "model": res["model"]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _cell(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _gain(side: dict[str, Any]) -> str:
    g = side["greedy_gain"]
    return "not reached" if g is None else f"{g['train_s']:.0f} s (step {g['step']})"


def _run(args: argparse.Namespace) -> Outcome:
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        result = {**saved, "ratios": _ratios(saved["full"], saved["lora"], saved["native"])}
        return Outcome(result, _markdown(result))
    if args.full is None or args.lora is None:
        raise BadFlag("--full and --lora are both needed (or --from-json)")
    full, lora = _side(args.full), _side(args.lora)
    native = _side(args.native) if args.native is not None else None
    sync = json.loads(args.lora_sync.read_text()) if args.lora_sync is not None else None
    result = {"full": full, "lora": lora, "native": native, "lora_sync": sync, "ratios": _ratios(full, lora, native)}
    return Outcome(result, _markdown(result))


def _ratios(full: dict[str, Any], lora: dict[str, Any], native: dict[str, Any] | None) -> dict[str, float | None]:
    """LoRA's figures over full's; native serving's sync, stall and tokens/s over steps 4-10
    (the window both runs have) over full's (None without a native run)."""
    nat = native or {}
    return {
        "train_step": _ratio(lora["train_step_s"], full["train_step_s"]),
        "step": _ratio(lora["step_s"], full["step_s"]),
        "tokens_per_s_busy": _ratio(lora["tokens_per_s_busy"], full["tokens_per_s_busy"]),
        "tokens_per_s_busy_early": _ratio(lora["tokens_per_s_busy_early"], full["tokens_per_s_busy_early"]),
        "completion_len": _ratio(lora["completion_len"], full["completion_len"]),
        "stall_p50": _ratio(lora["stall_ms_p50"], full["stall_ms_p50"]),
        "sync_p50_default": _ratio(lora["sync_ms_p50"], full["sync_ms_p50"]),
        "sync_p50_native": _ratio(nat.get("sync_ms_p50"), full["sync_ms_p50"]),
        "stall_p50_native": _ratio(nat.get("stall_ms_p50"), full["stall_ms_p50"]),
        "tokens_per_s_busy_early_native": _ratio(nat.get("tokens_per_s_busy_early"), full["tokens_per_s_busy_early"])}


def _markdown(r: dict[str, Any]) -> str:
    full, lora, native, q = r["full"], r["lora"], r["native"], r["ratios"]
    hw = full["hardware"]
    rows = [
        ("held-out greedy, step 0 -> last", f"{full['greedy_first']:.3f} -> {full['greedy_last']:.3f}",
         f"{lora['greedy_first']:.3f} -> {lora['greedy_last']:.3f}", "-"),
        ("training time to greedy +0.3", _gain(full), _gain(lora), "-"),
        ("entropy, largest ratio to step 1 (first 20 steps)", _cell(full["entropy_ratio"], ".2f"),
         _cell(lora["entropy_ratio"], ".2f"), "-"),
        ("mismatch KL, largest (first 20 steps)", _cell(full["mismatch_kl_max"], ".2e"),
         _cell(lora["mismatch_kl_max"], ".2e"), "-"),
        ("trainer's step, median (s)", _cell(full["train_step_s"], ".2f"), _cell(lora["train_step_s"], ".2f"),
         _cell(q["train_step"], ".2f")),
        ("pipeline step, median (s)", _cell(full["step_s"], ".2f"), _cell(lora["step_s"], ".2f"),
         _cell(q["step"], ".2f")),
        ("tokens/s over the worker's busy time (evaluations' included)", _cell(full["tokens_per_s_busy"], ".1f"),
         _cell(lora["tokens_per_s_busy"], ".1f"), _cell(q["tokens_per_s_busy"], ".2f")),
        ("the same, steps 4-10", _cell(full["tokens_per_s_busy_early"], ".1f"),
         _cell(lora["tokens_per_s_busy_early"], ".1f"), _cell(q["tokens_per_s_busy_early"], ".2f")),
        ("completion length, median of the steps' means (tokens)", _cell(full["completion_len"], ".1f"),
         _cell(lora["completion_len"], ".1f"), _cell(q["completion_len"], ".2f")),
        ("stall p50 (ms)", _cell(full["stall_ms_p50"], ".1f"), _cell(lora["stall_ms_p50"], ".1f"),
         _cell(q["stall_p50"], ".2f")),
        ("weight sync p50 (ms), default serving", _cell(full["sync_ms_p50"], ".0f"), _cell(lora["sync_ms_p50"], ".0f"),
         _cell(q["sync_p50_default"], ".2f")),
    ]
    if native is not None:
        rows += [("weight sync p50 (ms), native serving", _cell(full["sync_ms_p50"], ".0f"),
                  _cell(native["sync_ms_p50"], ".0f"), _cell(q["sync_p50_native"], ".2f")),
                 ("tokens/s over the worker's busy time, steps 4-10, native serving",
                  _cell(full["tokens_per_s_busy_early"], ".1f"), _cell(native["tokens_per_s_busy_early"], ".1f"),
                  _cell(q["tokens_per_s_busy_early_native"], ".2f")),
                 ("stall p50 (ms), native serving", _cell(full["stall_ms_p50"], ".1f"),
                  _cell(native["stall_ms_p50"], ".1f"), _cell(q["stall_p50_native"], ".2f"))]
    lines = [f"# LoRA beside full fine-tuning on {full['model']}", "",
             f"Hardware: {hw['cpu']}, {hw['cores']} cores, {hw['memory_gib']} GiB, no GPU. "
             f"Full: `{' '.join(full['flags'])}`, {full['steps']} steps. LoRA: `{' '.join(lora['flags'])}`, "
             f"{lora['steps']} steps"
             + (f"; native: `{' '.join(native['flags'])}`, {native['steps']} steps." if native else "."), "",
             "| figure | full | LoRA | LoRA / full |", "|---|---:|---:|---:|",
             *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]]
    sync = r["lora_sync"]
    if sync is not None:
        lines += ["", f"A sync's parts (`benchmarks.lora_sync`, the model alone, p50 of {sync['reps']}): "
                  f"bytes per version {sync['bytes_adapter'] / 1e6:.1f} MB against {sync['bytes_full'] / 1e6:.1f} MB "
                  f"({sync['bytes_ratio']:.3f}); the trainer's gather {sync['gather_adapter_s'] * 1e3:.1f} ms against "
                  f"{sync['gather_full_s'] * 1e3:.1f} ms; merged serving's fold {sync['merged_merge_s'] * 1e3:.0f} ms, "
                  f"then {_merged_load(sync)}; native serving's in-place replace "
                  f"{sync['native_replace_s'] * 1e3:.1f} ms.{_fixed_lengths(sync)}"]
    lines += ["", "The trainer's step: forward, backward and optimizer (`train_step_s`, the publish not included). "
              "Medians leave out steps 1-3 (start-up). Weight sync: from a step's end until every worker "
              "generates with the new version.", ""]
    return "\n".join(lines)


def _merged_load(sync: dict[str, Any]) -> str:
    """Merged serving's load, as ``benchmarks.lora_sync`` measured it (older results: none)."""
    if "merged_load_s" not in sync:
        return "a full update's load"
    both = (sync["merged_merge_s"] + sync["merged_load_s"]) / sync["full_load_s"]
    return (f"its load into the engine's shadow {sync['merged_load_s'] * 1e3:.0f} ms against a full update's "
            f"{sync['full_load_s'] * 1e3:.0f} ms (fold and load {both:.2f}x)")


def _fixed_lengths(sync: dict[str, Any]) -> str:
    """``benchmarks.lora_sync``'s generation under updates (older results: none)."""
    gen, at = sync.get("generation") or {}, sync.get("generation_settings")
    if "merged" not in gen or at is None:
        return ""
    ratio = gen["merged"]["tokens_per_s"] / gen["full"]["tokens_per_s"]
    return (f" Generation under updates at fixed lengths (the worker's engine, {at['sequences']} sequences of "
            f"{at['tokens']} tokens in flight, a version every {at['update_every_s']:g} s): merged serving "
            f"{ratio:.3f}x full weights' tokens/s.")


def main(argv: list[str] | None = None) -> int:
    return bench_main("lora_vs_full", __doc__, argv, _run, flags=_flags)


if __name__ == "__main__":
    raise SystemExit(main())
