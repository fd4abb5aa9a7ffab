"""The checkpoint-cost benchmark runs end to end in a tiny configuration (real Ray, vLLM,
DeepSpeed, ZeroMQ): both runs, the saves it finds and the copy times it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import checkpoint_cost
from tiny_run import TINY_RUN_FLAGS

pytestmark = pytest.mark.slow


def test_checkpoint_cost_quick(tiny_model_dir: str, tmp_path: Path) -> None:
    assert checkpoint_cost.main(["--quick", "--json", str(tmp_path / "c.json"), "--md", str(tmp_path / "c.md"),
                                 "--", "--model.path", tiny_model_dir, *TINY_RUN_FLAGS]) == 0
    res = json.loads((tmp_path / "c.json").read_text())
    (with_, without) = res["arms"]
    assert (with_["every"], with_["saves"], len(with_["copy_s"])) == (4, 2, 2)   # after steps 4 and 8
    assert (without["every"], without["saves"], without["copy_s"]) == (0, 0, [])
    assert with_["steps"] == without["steps"] == 12 and res["ratio"] > 0
    assert "Mean step with checkpoints against without" in (tmp_path / "c.md").read_text()
