"""GPU placement: a GPU per actor where there are enough, shared where there are fewer.

The plan itself needs no Ray; the last test asks a real local Ray cluster that
declares one GPU (there is none on this machine: Ray only counts the resource) to
place one rollout worker and one trainer rank with the plan's requests, and checks
that both land on that one GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pipeline_rl.config import Config
from pipeline_rl.resources import SHARED_GPU_USABLE, plan_gpus


def _cfg(device: str = "auto", workers: int = 1, ranks: int = 1) -> Config:
    return Config.model_validate({"model": {"device": device}, "rollout": {"num_workers": workers},
                                  "trainer": {"num_ranks": ranks}})


def test_cpu_runs_have_no_gpu_plan() -> None:
    assert plan_gpus(_cfg("cpu"), 8) is None
    assert plan_gpus(_cfg("auto"), 0) is None


def test_cuda_without_a_gpu_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^--model.device cuda: the Ray cluster has no GPU") as e:
        plan_gpus(_cfg("cuda"), 0)
    assert "\n" not in str(e.value)


def test_enough_gpus_give_one_each() -> None:
    plan = plan_gpus(_cfg("auto", 2, 2), 4)
    assert plan is not None and not plan.shared
    assert plan.per_actor == 1.0 and plan.memory is None
    assert plan.describe() == "GPUs: 2 rollout worker(s) + 2 trainer rank(s) on 4 GPU(s) of the cluster's 4, one each"


@pytest.mark.parametrize("workers,ranks,gpus,per_gpu", [(1, 1, 1, 2), (2, 1, 1, 3), (4, 4, 2, 4), (3, 2, 2, 3)])
def test_fewer_gpus_are_shared(workers: int, ranks: int, gpus: int, per_gpu: int) -> None:
    plan = plan_gpus(_cfg("auto", workers, ranks), gpus)
    assert plan is not None and plan.shared and plan.per_gpu == per_gpu
    assert plan.per_gpu * plan.per_actor <= 1.0 and plan.per_actor > 1.0 / per_gpu - 1e-4
    assert plan.memory is not None and plan.per_gpu * plan.memory <= SHARED_GPU_USABLE + 1e-9
    line = plan.describe()
    assert "\n" not in line and f"share {gpus} GPU(s), up to {per_gpu} on each" in line


@pytest.fixture
def one_gpu_ray() -> Iterator[None]:
    import ray

    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, object_store_memory=80 * 2**20,
             logging_level="ERROR", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def test_one_gpu_cluster_places_a_worker_and_a_rank_on_it(one_gpu_ray: None) -> None:
    import ray

    from pipeline_rl.actors.placement import gpu_plan

    plan = gpu_plan(_cfg("auto"))
    assert plan is not None and plan.gpus == 1 and plan.per_gpu == 2

    class Probe:
        def gpu_ids(self) -> list[str]:
            return [str(g) for g in ray.get_gpu_ids()]

    probe = ray.remote(Probe).options(num_cpus=1, num_gpus=plan.per_actor)
    worker, rank = probe.remote(), probe.remote()     # as the rollout worker and the trainer rank ask
    ready, pending = ray.wait([worker.gpu_ids.remote(), rank.gpu_ids.remote()], num_returns=2, timeout=60)
    assert not pending, "Ray could not place both actors on the one GPU"
    assert ray.get(ready) == [["0"], ["0"]]
