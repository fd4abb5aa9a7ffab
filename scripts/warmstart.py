"""Build (or reuse) the cached warm-started built-in model, and optionally check that it learns under RL.

    python scripts/warmstart.py                       # build/reuse the default (task from the config defaults)
    python scripts/warmstart.py --task sort --digits 4 --rl-check --rl-steps 150 --json out.json

The model folder is what ``launch/async_grpo.py`` uses when no ``--model`` is given
(``pipeline_rl.models.default_model_dir``). ``--rl-check`` runs the pure-torch GRPO
probe (``benchmarks/rl_probe.py``): the pipeline's objective in one process,
to show the reward curve the full system should reproduce.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline_rl.config import ModelConfig, TaskConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    defaults = TaskConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["addition", "sort"], default=defaults.name)
    ap.add_argument("--digits", type=int, default=defaults.digits)
    ap.add_argument("--cache-dir", type=Path, default=None, help="Cache root (default: models.cache_root()).")
    ap.add_argument("--warm-steps", type=int, default=None, help="Override the recipe's SFT steps.")
    ap.add_argument("--target-reward", type=float, default=None, help="Override the recipe's target sampled reward.")
    ap.add_argument("--rl-check", action="store_true", help="Run the pure-torch GRPO probe afterwards.")
    ap.add_argument("--rl-steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=None, help="RL learning rate (default: TrainerConfig().lr).")
    ap.add_argument("--lag", type=int, default=2, help="Behaviour policy age in steps (the staleness).")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--json", type=Path, default=None, help="Write the results here.")
    args = ap.parse_args(argv)

    import torch

    from pipeline_rl.config import TrainerConfig
    from pipeline_rl.models import default_model_dir, recipe_for
    from pipeline_rl.models.default import INFO_FILE
    from benchmarks.rl_probe import RLProbeConfig, grpo_probe
    from pipeline_rl.tasks.build import build_task

    torch.set_num_threads(1)
    task_cfg = TaskConfig(name=args.task, digits=args.digits)
    recipe = None
    if args.warm_steps is not None or args.target_reward is not None:
        recipe = recipe_for(args.task, args.digits, steps=args.warm_steps,
                            **({"target_reward": args.target_reward} if args.target_reward is not None else {}))
    t0 = time.perf_counter()
    model_dir = default_model_dir(ModelConfig(), task_cfg, recipe=recipe, cache_dir=args.cache_dir)
    info = json.loads((model_dir / INFO_FILE).read_text())
    print(f"model: {model_dir} ({time.perf_counter() - t0:.1f}s)\nwarm start: {json.dumps(info)}", flush=True)
    out: dict[str, object] = {"model_dir": str(model_dir), "warmstart": info, "rl": []}
    if args.rl_check:
        lr = args.lr if args.lr is not None else TrainerConfig().lr
        task = build_task(task_cfg)
        for seed in args.seeds:
            cfg = RLProbeConfig(steps=args.rl_steps, lr=lr, lag=args.lag, seed=seed, probe_every=50)
            res = grpo_probe(model_dir, task, cfg)
            mm = res.moving_mean()
            summary = {"config": asdict(cfg), "first10": round(mm[9], 3) if len(mm) >= 10 else None,
                       "last10": round(mm[-1], 3), "steps_to_0.8": res.steps_to(0.8),
                       "curve10": [round(m, 3) for m in mm[9::10]], "probes": res.probes,
                       "rewards": res.rewards, "wall_s": round(res.wall_s, 1)}
            print(json.dumps({k: v for k, v in summary.items() if k not in ("rewards", "config")}), flush=True)
            out["rl"].append(summary)  # type: ignore[attr-defined]
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
