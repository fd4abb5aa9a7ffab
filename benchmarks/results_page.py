"""``docs/results.md``, built from the benchmarks' own result files.

Every benchmark writes its report to ``benchmarks/results/{NAME}.md`` (``--md``). This module
puts those reports on one page, in the order of :data:`CATALOG`, each under a heading with
the command that produced it and what it measures, so the page never says more than the
result files do. ``python -m benchmarks.results_page`` rewrites the page;
``python -m benchmarks.results_page --check`` exits 1 when the page is out of date (the suite
runs the check).

Invariants: every entry names a result file that exists; every report on the page states
the machine it was measured on, either in its own text (a ``Hardware:`` line, or the
machine named in its first lines) or in the entry's ``machine``.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"

#: How a report names its machine on its own (any of these in its first five lines).
_MACHINE_WORDS = re.compile(r"Hardware:|AMD EPYC|Intel|NVIDIA|H100|H200", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class Entry:
    """One benchmark's report on the page.

    ``stem`` names ``benchmarks/results/{stem}.md``; ``machine`` is said only for reports
    that do not name their machine themselves; ``figure`` is a plot beside the report.
    """

    stem: str
    title: str
    command: str
    measures: str
    machine: str = ""
    figure: str = ""


CATALOG: tuple[Entry, ...] = (
    Entry("demo", "The default run", "python -m benchmarks.demo --repeats 3",
          "400 steps of `launch/async_grpo.py --staleness 2`: wall and training time, steps/s, and "
          "the run's own held-out evaluation before and after.",
          machine="AMD EPYC, 2 cores, 23.5 GiB, no GPU", figure="demo_eval.png"),
    Entry("real_model", "A real pretrained chat model (SmolLM2-135M-Instruct)",
          "python -m benchmarks.real_model --steps 50 --eval-every 10 -- --task.name word_problems",
          "The packaged SmolLM2-135M-Instruct on English word problems at the pretrained profile's "
          "defaults: the held-out curve, entropy, tokens/s against bare vLLM on one core with the same "
          "sampling (in the same run), weight sync and step time.", figure="real_model.png"),
    Entry("grad_checkpointing", "Gradient checkpointing on the real chat model",
          "python -m benchmarks.grad_checkpointing --rounds 1 --steps 3 --json "
          "benchmarks/results/grad_checkpointing.json --md benchmarks/results/grad_checkpointing.md",
          "The trainer alone on SmolLM2-135M-Instruct with 256-token completions (2 prompts x 4): peak "
          "resident memory and step time with `--trainer.gradient_checkpointing` and without (prompts "
          "shared, today's default; and padded rows, the layout checkpointing uses), each in a fresh "
          "process."),
    Entry("trainer_knobs", "Muon and warm-up + cosine on the real chat model",
          "python -m benchmarks.trainer_knobs --seeds 0 1 --steps 30",
          "SmolLM2-135M-Instruct on word problems, 30 steps per run, two seeds: held-out greedy accuracy "
          "every 10 steps with AdamW at a constant rate (the default), Muon (`--trainer.optimizer muon`, "
          "muon_lr 1.6e-4 by Moonlight's update-size rule) and a 3-step warm-up then cosine decay. The "
          "cosine seed-1 run shared the machine with a test run for 8 of its 12 minutes (its time "
          "only)."),
    Entry("lora_vs_full", "LoRA beside full fine-tuning on the real chat model",
          "python -m benchmarks.real_model --steps 30 -- --task.name word_problems [--lora.rank 16 "
          "[--lora.serving native]], then python -m benchmarks.lora_vs_full",
          "SmolLM2-135M-Instruct on word problems, in one sitting: full fine-tuning (30 steps), a rank-16 "
          "adapter on all seven projections in the CPU's default serving mode, merged (30 steps), and the "
          "same adapter served natively by vLLM's LoRA (10 steps, for its weight sync). The LoRA runs "
          "take the pretrained profile's LoRA rate, 4e-4."),
    Entry("peers_real_model", "Against TRL's GRPOTrainer on the real chat model",
          "python -m benchmarks.peers --model smollm2-135m-instruct --seeds 1 --systems trl,s2 --steps 40 "
          "--eval-every 10 --heldout-target 0.6 --lr 2e-5 --max-new-tokens 32 --max-model-len 512 "
          "-- --task.name word_problems",
          "SmolLM2-135M-Instruct on word problems, both sides evaluated greedily on the same held-out "
          "prompts: training and wall time to a held-out accuracy of 0.6, against TRL 1.16's GRPOTrainer "
          "in its own environment on the same machine."),
    Entry("peers", "Against TRL's GRPOTrainer (sort task)", "python -m benchmarks.peers --seeds 5 --steps 150",
          "Steps, training time and wall time to a trailing reward of 0.8, against TRL 1.16's "
          "GRPOTrainer on the same model, task and machine (TRL in an environment of its own).",
          figure="peers.png"),
    Entry("peers_rerun", "Against TRL's GRPOTrainer, a later sitting", "python -m benchmarks.peers --seeds 5 --steps 150",
          "The same comparison in a later sitting (this machine's speed drifts between hours)."),
    Entry("peers_countdown", "Against TRL's GRPOTrainer on a heavy-tailed task",
          "python -m benchmarks.peers --seeds 5 --steps 120 --systems trl,s2 --lr 5e-5 "
          "--max-new-tokens 492 --max-model-len 512 -- --task.name countdown --task.digits 3",
          "Completions of 4-492 tokens, where a synchronous round waits for its longest one.",
          figure="peers_countdown.png"),
    Entry("throughput", "Asynchronous against synchronous", "python -m benchmarks.throughput --repeats 3 --steps 40 --warmup 8",
          "Step time, tokens/s and idle shares at staleness 0-4, against the overlap bound "
          "(T_gen + T_train) / max(T_gen, T_train).", figure="throughput.png"),
    Entry("trainer_profile", "The trainer against the core's matmul rate",
          "python -m benchmarks.trainer_profile --steps 4 -- --model smollm2-135m-instruct --task.name "
          "word_problems [--lora.rank 16]",
          "The real chat model's trainer step, full and LoRA, on batches of the word-problems run's shape: "
          "the median step before and after prompts ran once per block, and the FLOP/s of the tokens "
          "trained over a dense matmul on the same core."),
    Entry("throughput_real_model", "Asynchronous against synchronous on the real chat model",
          "python -m benchmarks.throughput --workloads real_full,real_lora --configs sync_same_placement,async_s2 "
          "--steps 7 --warmup 2 --repeats 3",
          "SmolLM2-135M-Instruct on word problems, fully and with a rank-16 LoRA adapter: the pipeline at "
          "staleness 2 against the same pipeline at staleness 0 (generation and training in turn), steps per "
          "second and the overlap bound from the synchronous steps, 3 repeats."),
    Entry("heldout_async_sync", "Time to held-out +0.3 on the real chat model, asynchronous against synchronous",
          "python launch/async_grpo.py --model smollm2-135m-instruct --task.name word_problems --max-steps 30 "
          "--eval.every 5 [--staleness 0]",
          "The README's real-model command at staleness 2 and at staleness 0, one run each: held-out greedy "
          "accuracy by the time its weights were made, and the training time to +0.3."),
    Entry("prefix_cache", "Version-salted prefix caching on and off",
          "python -m benchmarks.prefix_cache --steps 6 --workloads readme fewshot",
          "The main job on SmolLM2-135M-Instruct with --rollout.prefix_caching on and off: on prompts behind a "
          "few-shot preamble of about 520 tokens, and on the README's word problems; tokens/s over the rollout "
          "worker's busy time and the step, one round."),
    Entry("prefix_cache_readme", "Prefix caching on the README's real-model task, 3 rounds",
          "python -m benchmarks.prefix_cache --steps 8 --rounds 3 --workloads readme",
          "The README's real-model command with --rollout.prefix_caching on and off in turn, 3 rounds: tokens/s "
          "over the rollout worker's busy time (short prompts: what caching costs where it saves little)."),
    Entry("step_bound", "What bounds a step", "python -m benchmarks.step_bound",
          "Each side alone on an idle core: the fastest any schedule of the two could step."),
    Entry("cpu_profile", "Where the CPU goes", "python -m benchmarks.cpu_profile",
          "CPU of every process of a running default run, per pipeline step."),
    Entry("startup", "Start-up", "python -m benchmarks.startup --repeats 5",
          "Seconds from the command to each start-up line and the first step, against the "
          "slowest actor's own start measured alone."),
    Entry("weight_sync", "Weight sync", "python -m benchmarks.weight_sync",
          "Per update: latency from publish to 'every worker generates with it', and the "
          "generation stall, per engine, model size and path."),
    Entry("lora_sync", "A LoRA adapter's weight sync", "python -m benchmarks.lora_sync --reps 5",
          "Bytes per version of a rank-16 adapter on all seven projections against full weights, the "
          "trainer's gather, merged serving's fold, load and swap against a full update's, native "
          "serving's in-place replace, and generation at fixed lengths under each serving's updates.",
          machine="2 cores (AMD EPYC), alone"),
    Entry("gpu_smoke", "The GPU check", "python -m benchmarks.gpu_smoke",
          "The GPU road end to end on one GPU: in-flight updates, the default run, a 0.5 B model."),
    Entry("gpu_weight_paths", "Weights at 0.5 B on one GPU", "python -m benchmarks.gpu_smoke --steps 0 "
          "--big-steps 10 --big-paths ipc,shm --skip-inflight --skip-fault",
          "Sync and stall per update of a 494 M-parameter model, the CUDA IPC path against shared memory."),
    Entry("ablation", "Staleness x correction", "python -m benchmarks.ablation --quick --seeds 3",
          "Final reward and reward AUC per staleness and correction, with intervals and "
          "Holm-corrected tests.", figure="ablation_bf16.png"),
    Entry("ablation_real_model", "Staleness x correction on the real chat model",
          "python -m benchmarks.ablation --model smollm2-135m-instruct --staleness 0,4,8 --corrections "
          "none,tis,icepop --dtypes bfloat16 --seeds 3 --steps 10 -- --task.name word_problems "
          "--trainer.batch_size 16 --eval.every 0",
          "SmolLM2-135M-Instruct with bf16 generation against the fp32 trainer: reward, mismatch KL, "
          "ESS and masked shares per staleness and correction, 3 seeds, intervals and Holm-corrected tests.",
          figure="ablation_real_model_bf16.png"),
    Entry("correction_study_real_model", "Corrections where stale data hurts, on the real chat model",
          "python -m benchmarks.correction_study --dtype float32 --seeds 3",
          "SmolLM2-135M-Instruct with a LoRA adapter on word problems: none at staleness 0 against staleness 8 "
          "(the regime), then seq-mask-tis, GSPO and CISPO against the generator's log-probs, and M2PO against "
          "none at staleness 8, by final held-out greedy accuracy over 3 seeds, with Holm-corrected tests, the "
          "minimum detectable difference and the wall time."),
    Entry("ablation_arms", "Staleness x every objective and correction",
          "python -m benchmarks.ablation --quick --staleness 0,8 --arms "
          "none,tis,icepop,seq-mask-tis,m2po,gspo@behaviour+none,cispo@behaviour+none --seeds 3",
          "The built-in task with bf16 generation: the design's corrections, M2PO, and the GSPO and CISPO "
          "objectives against the generator's log-probs, at staleness 0 and 8, 3 seeds, intervals and "
          "Holm-corrected tests against none.",
          figure="ablation_arms_bf16.png"),
    Entry("arms_rise", "Each objective and correction learns", "python -m benchmarks.arms_rise",
          "The default run, 60 steps per objective (every --algorithm.loss, against the generator's "
          "log-probs or in 2 passes) and correction (every preset and two compositions): the reward of its "
          "first 10 steps against its last 10."),
    Entry("ablation_full", "Staleness x correction, the full grid (one seed)", "python -m benchmarks.ablation",
          "Staleness {0,1,2,4,8} x 4 corrections x fp32/bf16 generation, 200 steps (an earlier default model)."),
    Entry("multiturn", "A multi-turn tool task learns", "python -m benchmarks.multiturn --seeds 3 --steps 200",
          "Held-out greedy success of `--task.name calc` before and after 200 steps."),
    Entry("multiturn_agent", "The same task as agent code", "python -m benchmarks.multiturn --seeds 1 --agent "
          "--json benchmarks/results/multiturn_agent.json --md benchmarks/results/multiturn_agent.md",
          "`calc` as an agent function through the rollout worker's OpenAI endpoint beside the environment "
          "form: held-out greedy success and tokens/s of each."),
    Entry("agent_overhead", "The agent endpoint's own cost", "python -m benchmarks.agent_overhead --rounds 3 "
          "--groups 500 --warmup 40 -- --model runs/calc-200/checkpoints/step_000200",
          "One rollout worker, no trainer, its agents' process on a core of its own: `calc` as its environment "
          "and as agent code through the endpoint, alternated; tokens/s, the engine's batch and the CPU per "
          "token of each thread (the checkpoint: `launch/async_grpo.py --staleness 2 --task.name calc "
          "--max-steps 200 --out-dir runs/calc-200`)."),
    Entry("agent_overhead_real_model", "The agent endpoint's own cost on the real chat model",
          "python -m benchmarks.agent_overhead --rounds 3 --groups 16 --warmup 4 --agent "
          "pipeline_rl.tasks.word_problems_agent:solve --json benchmarks/results/agent_overhead_real_model.json "
          "--md benchmarks/results/agent_overhead_real_model.md -- --model smollm2-135m-instruct "
          "--task.name word_problems",
          "The same on SmolLM2-135M-Instruct: `word_problems` as one chat request per problem through the "
          "endpoint against the plain single-turn form."),
    Entry("slow_env", "A slow environment", "python -m benchmarks.slow_env --steps 100 --warmup 20 --sleep-ms 50",
          "Steps/s with a 50 ms environment against an instant one."),
    Entry("hung_env", "A hung environment", "python -m benchmarks.slow_env --steps 60 --warmup 10 "
          "--hang-frac 0.3 --hang-s 30 --timeout-s 1",
          "Tokens/s and steps/s when 30% of environment calls hang 30 s past a 1 s timeout, "
          "against the same environment without hangs."),
    Entry("rewards", "Slow rewards", "python -m benchmarks.rewards --steps 150 --repeats 5",
          "Steps/s with slow plug-in and remote rewards against an instant one."),
    Entry("versions", "Versions under PPO epochs", "python -m benchmarks.versions --steps 20",
          "Step rows equal versions, lag within the staleness, resume from a middle checkpoint.",
          machine="AMD EPYC, 2 cores, 23.5 GiB, no GPU"),
    Entry("versions_60steps", "Versions under PPO epochs, 60 steps", "python -m benchmarks.versions --steps 60",
          "The same over 60 steps.", machine="AMD EPYC, 2 cores, 23.5 GiB, no GPU"),
    Entry("soak", "Memory over 20,000 steps", "python -m benchmarks.soak --steps 20000",
          "Resident-memory slope of every process after step 2,000 (limit 500 KiB per 1,000 steps).",
          machine="AMD EPYC, 2 cores, 23.5 GiB, no GPU"),
    Entry("chaos", "A run killed again and again", "python -m benchmarks.chaos",
          "2,000 default steps with 10 rollout-worker SIGKILLs and 3 whole-run SIGKILLs (one during a "
          "checkpoint write), each followed by `--resume RUN_DIR`: steps reached, steps twice or missing, "
          "what each kill cost, and the final held-out greedy against an unbroken run of the same seed."),
    Entry("chaos_heal", "A run that heals itself", "python -m benchmarks.chaos",
          "The same benchmark with the run healing itself: 10 rollout-worker kills (the standby takes "
          "over), 3 trainer and 2 buffer kills (the run restarts itself from its newest checkpoint), 2 "
          "whole-run kills resumed by `--resume`: what each kill cost; both runs evaluate 128 held-out prompts."),
    Entry("chaos_real_model", "A run that heals itself on the real chat model",
          "python -m benchmarks.chaos --steps 60 --worker-kills 0 --trainer-kills 2 --buffer-kills 0 --run-kills 0 "
          "--checkpoint-every 10 --eval-prompts 32 -- --model smollm2-135m-instruct --task.name word_problems "
          "--eval.every 10",
          "The README's real-model command (SmolLM2-135M-Instruct, 60 steps) with 2 trainer SIGKILLs, one of "
          "them during a checkpoint write, each healed by the run restarting itself from its newest "
          "checkpoint; then the same run unbroken: steps lost, kill to the next step, held-out greedy."),
    Entry("standby_cost", "What the standby costs a healthy run", "python -m benchmarks.standby_cost --rounds 3",
          "The default run with its insurance (a standby per rollout worker and a spare per trainer rank, "
          "built at the lowest CPU priority) against the same run without: wall time and weight sync, "
          "alternated rounds."),
    Entry("checkpoint_cost", "What checkpoints cost", "python -m benchmarks.checkpoint_cost --steps 300 --every 10",
          "The default run with a checkpoint every 10 steps against none (the state copied on the training "
          "thread, written in the background): mean step, the copy's time, the extra time of the step after "
          "each save."),
    Entry("checkpoint_cost_real_model", "What checkpoints cost on the real chat model",
          "python -m benchmarks.checkpoint_cost --steps 40 --every 10 -- --model smollm2-135m-instruct "
          "--task.name word_problems",
          "SmolLM2-135M-Instruct (a 2.3 GB checkpoint: weights, AdamW's moments, the served weights) with a "
          "checkpoint every 10 steps against none: the copy's time on the training thread, the extra time of "
          "the step after each save."),
)

_INTRO = """\
# Measured results

Every figure here comes from a benchmark under `benchmarks/` (`python -m benchmarks.NAME`,
each with `--help`) and its report in `benchmarks/results/{NAME}.md`; this page is built from
those reports by `python -m benchmarks.results_page` (the suite checks it is up to date), so
re-running a benchmark and rebuilding the page is how a figure changes. Each report names the
machine it was measured on. The CPU machines are shared and their speed drifts by tens of
percent within an hour: comparisons are ratios measured within one run, not absolute times
from different runs.

An index of every module under `benchmarks/` (what it measures, its command, its result files): [benchmarks.md](benchmarks.md).
"""


def _machine_line(entry: Entry, text: str) -> str:
    head = "\n".join(text.splitlines()[:5])
    if _MACHINE_WORDS.search(head):
        return ""
    if not entry.machine:
        raise ValueError(f"benchmarks/results/{entry.stem}.md names no machine and its catalog entry gives none")
    return f"Machine: {entry.machine}.\n\n"


def _demote(text: str) -> str:
    """Headings of a report sit below the page's own (``#`` -> ``###``)."""
    return re.sub(r"^(#+) ", lambda m: "##" + m.group(1) + " ", text, flags=re.MULTILINE)


def _relink(text: str) -> str:
    """Relative links of a report (written beside its figures) made relative to ``docs/``."""
    return re.sub(r"\]\((?!https?://|/|#)([^)]+)\)", r"](../benchmarks/results/\1)", text)


def render() -> str:
    """The whole page; raises ValueError naming a missing result file or machine."""
    parts = [_INTRO]
    parts.append("\n".join(f"- [{e.title}](#{_anchor(e.title)})" for e in CATALOG) + "\n")
    for entry in CATALOG:
        path = RESULTS / f"{entry.stem}.md"
        if not path.is_file() or (entry.figure and not (RESULTS / entry.figure).is_file()):
            raise ValueError(f"benchmarks/results/{entry.stem}.md is missing, or its figure (catalog entry {entry.stem!r})")
        text = path.read_text().strip() + "\n"
        parts.append(
            f"## {entry.title}\n\n`{entry.command}` — {entry.measures} "
            f"([{entry.stem}.md](../benchmarks/results/{entry.stem}.md))\n\n"
            + _machine_line(entry, text) + _relink(_demote(text))
            + (f"\n![{entry.title}](../benchmarks/results/{entry.figure})\n" if entry.figure else "")
        )
    return "\n".join(parts)


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = re.sub(r"[^\w\- ]", "", title.lower())
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.results_page",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when docs/results.md differs from what the result files give")
    args = parser.parse_args(argv)
    try:
        page = render()
    except ValueError as e:
        print(f"results_page: {e}", file=sys.stderr)
        return 2
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != page:
            print("results_page: docs/results.md is out of date: run python -m benchmarks.results_page",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
