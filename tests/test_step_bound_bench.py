"""benchmarks/step_bound.py: its report, and bad flags (the measurement itself runs the real
engine and trainer on the default model and is left to the benchmark)."""

from __future__ import annotations

import pytest

from benchmarks import step_bound


def test_report_names_both_sides_and_the_bound() -> None:
    gen = {"batch_ms": 25.0, "engine_step_ms": 4.0, "engine_steps_per_round": 6.2, "prompt_tokens": 11,
           "completion_tokens_max": 6, "completion_tokens_mean": 5.0}
    r = {"hardware": {"cpu": "x", "cores": 2, "memory_gib": 1.0}, "batches": 3, "staleness": 2, "in_flight": 3,
         "threads": 2, "batch_shape": "4 prompts x 8 completions", "generate_1": gen,
         "generate_k": {**gen, "batch_ms": 12.0}, "trainer_step_ms": {1: 18.0, 2: 17.5}, "bound_step_ms": 18.0,
         "peers": "p.json", "trl_step_ms": 30.0, "bound_vs_trl": 0.6}
    md = step_bound.markdown(r)
    assert "| trainer step, 1 thread | 18.0 |" in md and "| vLLM, 3 batches in flight | 12.0 |" in md
    assert "**18.0 ms**" in md and "**0.6x** it" in md


@pytest.mark.parametrize("argv, message", [(["--batches", "0"], "--batches must be >= 1"),
                                           (["--threads", "0"], "--threads must be >= 1"),
                                           (["--peers", "/nonexistent.json"], "--peers: no such file")])
def test_bad_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        step_bound.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
