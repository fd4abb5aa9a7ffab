"""The vLLM compatibility layer against both API shapes this project supports.

- The installed vLLM (0.32 on CPU) labels tokens with weight versions itself.
- vLLM 0.26's shape: no ``AsyncLLM.update_weight_version``, a ``finish_weight_update``
  that takes no version, no ``LLMEngine.set_weight_version``, and a weight-transfer
  base class that also declares its trainer half (``trainer_send_weights``) abstract.
  The installed frontend is reshaped that way (the engine core is untouched, and its
  version spans are ignored), and both engines must still start, generate, take a
  weight update in the middle of running sequences and label every token with the
  weights that sampled it: the same checks against transformers as the engines' own
  tests, run again here.
"""

from __future__ import annotations

import inspect
from abc import abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import test_engine_async as async_tests
import test_engine_inprocess as cpu_tests
from test_engine_inprocess import hf_models, model_dirs  # noqa: F401 - shared fixtures

from pipeline_rl.rollout.engines import vllm_compat as compat
from pipeline_rl.weight_sync.receive import vllm_adapter as adapter
from pipeline_rl.rollout.engines.engine import EngineConfig, GenerationEngine
from pipeline_rl.weight_sync.message import load_update


# -- the pieces, without an engine ------------------------------------------------------------
def test_installed_vllm_labels_versions_itself() -> None:
    f = compat.features()
    assert f.async_versions and f.inprocess_versions
    assert "trainer_send_weights" not in f.abstract_backend_methods


def test_version_record_splits_tokens_at_each_switch() -> None:
    record = compat.VersionRecord(3)
    record.add("running", registered=True)
    record.add("queued")                       # handed over, not yet held by vLLM
    record.add("done", registered=True)
    record.switch(4, {"running": 5})          # "done" finished before the switch
    record.registered("queued")
    record.switch(5, {"running": 9, "queued": 2})
    np.testing.assert_array_equal(record.take("running", 12), [3] * 5 + [4] * 4 + [5] * 3)
    np.testing.assert_array_equal(record.take("queued", 4), [4, 4, 5, 5])
    np.testing.assert_array_equal(record.take("done", 3), [3, 3, 3])
    np.testing.assert_array_equal(record.take("unknown", 2), [5, 5])


def test_backend_completed_under_a_base_with_an_abstract_trainer_half() -> None:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from pipeline_rl.weight_sync.receive.vllm_backend import WeightReceiver

    class Base026(WeightTransferEngine[Any, Any]):   # vLLM 0.26's base, as far as it matters here
        @staticmethod
        @abstractmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None: ...

    backend = type("Gloo026", (WeightReceiver, Base026), {})
    assert inspect.isabstract(backend)
    assert adapter.complete_backend(backend) is backend and not inspect.isabstract(backend)
    with pytest.raises(adapter.UnusedBackendMethod, match="trainer_send_weights is not part"):
        backend.trainer_send_weights(iter(()), {})


# -- both engines under vLLM 0.26's frontend ----------------------------------------------------
@pytest.fixture(scope="module")
def vllm_026() -> Iterator[None]:
    """Reshape the installed frontend to vLLM 0.26's API for this module's engines."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    async def finish_weight_update(self: Any) -> None:   # 0.26: no version argument
        await self.collective_rpc("finish_weight_update")

    with pytest.MonkeyPatch.context() as mp:
        mp.delattr(AsyncLLM, "update_weight_version")
        mp.setattr(AsyncLLM, "finish_weight_update", finish_weight_update)
        mp.delattr(LLMEngine, "set_weight_version")
        f = compat.features()
        assert not f.async_versions and not f.inprocess_versions
        yield


@pytest.fixture(scope="module")
def cpu_engine_026(vllm_026: None, model_dirs: tuple[Path, Path]) -> Iterator[GenerationEngine]:
    yield from cpu_tests._engine(model_dirs[0], "keep")


@pytest.fixture(scope="module")
def async_engine_026(vllm_026: None, model_dirs: tuple[Path, Path]) -> Iterator[GenerationEngine]:
    from pipeline_rl.rollout.engines.engine_async import AsyncEngine

    eng = AsyncEngine(EngineConfig(model_dir=str(model_dirs[0]), max_num_seqs=16, max_model_len=256))
    eng.load_update(load_update(model_dirs[0], 1))   # opens the loopback channel (same weights)
    yield eng
    eng.close()


def test_inprocess_engine_026_keeps_versions_itself(cpu_engine_026: GenerationEngine, model_dirs: tuple,
                                                    hf_models: tuple) -> None:
    assert getattr(cpu_engine_026, "_record") is not None
    cpu_tests.test_sampled_logprobs_match_transformers(cpu_engine_026, hf_models)
    cpu_tests.test_keep_update_mid_generation(cpu_engine_026, model_dirs, hf_models)


def test_async_engine_026_keeps_versions_itself(async_engine_026: Any, model_dirs: tuple,
                                                hf_models: tuple) -> None:
    assert getattr(async_engine_026, "_record") is not None
    async_tests.test_update_lands_mid_sequence_through_vllms_api(async_engine_026, model_dirs, hf_models)
    async_tests.test_not_newer_update_keeps_the_version(async_engine_026, model_dirs)
