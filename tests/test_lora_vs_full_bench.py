"""``benchmarks.lora_vs_full``: a folder that is not a ``benchmarks.real_model`` run is refused
in one line (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import lora_vs_full


def test_a_folder_without_a_real_model_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "full").mkdir()
    with pytest.raises(SystemExit) as e:
        lora_vs_full.main(["--full", str(tmp_path / "full"), "--lora", str(tmp_path / "lora")])
    assert e.value.code == 2 and "not a benchmarks.real_model --out folder" in capsys.readouterr().err


def test_the_busy_rate_counts_the_evaluations_tokens() -> None:
    """Tokens/s over the worker's busy time counts every token the engine generated: a row
    whose engine was half busy with an evaluation's answers is not a slow row."""
    from benchmarks.real_model import busy_tokens_per_s

    rows = [{"tokens_per_s": 60.0, "generator_idle_frac": 0.25},
            {"tokens_per_s": 30.0, "eval_tokens_per_s": 30.0, "generator_idle_frac": 0.25},
            {"tokens_per_s": 90.0, "generator_idle_frac": 1.0}]        # all idle: no rate
    assert busy_tokens_per_s(rows) == pytest.approx(80.0)       # older rows: the median of their windows
    assert busy_tokens_per_s([{"tokens_per_s": 1.0}]) is None
    # The run's totals, where the rows carry them: all tokens over all busy seconds between two rows.
    totals = [{**rows[0], "generated_tokens": 100.0, "generated_eval_tokens": 0.0, "generator_busy_s": 10.0},
              {**rows[2], "generated_tokens": 700.0, "generated_eval_tokens": 300.0, "generator_busy_s": 20.0}]
    assert busy_tokens_per_s(totals) == pytest.approx(90.0)
