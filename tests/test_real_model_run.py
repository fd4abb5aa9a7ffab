"""The packaged real model end to end: ``launch/async_grpo.py --model smollm2-135m-instruct``
for 3 steps on two-digit additions, at the pretrained profile's defaults.

Costs the suite the model's conversion once (about a minute on 2 cores; then cached in
.cache/pipeline_rl/), the run's start-up (vLLM loading 538 MB) and 3 steps of a 135 M model
with 2 groups of 4 completions of at most 32 tokens."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_rl.metrics import read_metrics

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900


def test_three_steps_of_the_real_model(tmp_path: Path) -> None:
    rng = random.Random(0)
    data = tmp_path / "additions.jsonl"
    with data.open("w") as f:
        for _ in range(200):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"What is {a} + {b}? Reply with the number only.", "answer": a + b}) + "\n")
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch" / "async_grpo.py"), "--model", "smollm2-135m-instruct",
           "--dataset", str(data), "--max-steps", "3", "--eval.every", "0", "--rollout.n", "4",
           "--trainer.batch_size", "8", "--trainer.micro_batch_size", "8", "--out-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("| model: smollm2-135m-instruct | profile: pretrained (lr 2e-05, kl 0, temperature 1, max_new_tokens 32, "
            "max_model_len 512)") in proc.stderr
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0.0 < r["entropy"] < 10.0 and abs(r["mismatch_kl"]) < 0.1, r
