"""A LoRA run's updates (``pipeline_rl.weight_sync.receive.lora_update``): the adapter alone travels
every CPU path bit-exact through the one channel interface; it is checked against the served
model as full weights are (one line naming what is wrong); merged serving folds it into the
base exactly as PEFT's ``merge_and_unload`` does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pipeline_rl.config.lora_config import LoraConfig
from pipeline_rl.weight_sync.publish.gather import gather_weights
from pipeline_rl.weight_sync.receive.lora_update import LoraServing, Merger, adapter_spec
from pipeline_rl.weight_sync.message import WeightUpdate, WeightUpdateError, read_weight_spec, validate_update
from pipeline_rl.weight_sync.protocol import OpenContext
from pipeline_rl.weight_sync.channels.shm import SharedWriter
from staging_helpers import ShmClient, ThreadClient

SERVING = LoraServing(rank=4, alpha=32.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                    "up_proj", "down_proj"), mode="merged")


def peft_model(model_dir: str, seed: int) -> Any:
    """The tiny model wrapped as the trainer wraps it, with B made non-zero (a trained adapter)."""
    from transformers import AutoModelForCausalLM

    from pipeline_rl.training.lora import wrap

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = wrap(base, LoraConfig(rank=SERVING.rank, alpha=SERVING.alpha), model_dir, seed)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return model.eval()


def adapter_update(model: Any, version: int, dtype: str = "float32") -> WeightUpdate:
    from pipeline_rl.training.lora import adapter_parameters

    return gather_weights(model, version, zero_stage=0, dtype=dtype,  # type: ignore[arg-type]
                          named=adapter_parameters(model))


@pytest.mark.parametrize("path", ["shm", "gloo", "nccl"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_adapter_round_trips_bit_exact_through_every_cpu_path(path: str, dtype: str, tiny_model_dir: str) -> None:
    from pipeline_rl.weight_sync.channels.channel import open_channel
    from pipeline_rl.weight_sync.channels.nccl import NcclTrainerChannel

    spec = adapter_spec(read_weight_spec(tiny_model_dir), SERVING)
    client = ShmClient() if path == "shm" else ThreadClient()
    shared = SharedWriter()
    context = OpenContext(shared=shared, bucket_bytes=8 << 10, timeout_s=5.0)
    channel = (NcclTrainerChannel.open(client, context, backend="gloo") if path == "nccl"
               else open_channel(path, client, context))  # type: ignore[arg-type]
    try:
        for v in (1, 2):
            sent = adapter_update(peft_model(tiny_model_dir, seed=v), v, dtype)
            validate_update(sent, spec)                      # the adapter alone, complete
            assert channel.send(sent).num_bytes == sent.num_bytes
            got = client.got[-1]
            assert got.version == v and got.names == sent.names
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(sent.arrays, got.arrays))
    finally:
        channel.close()
        shared.close()


def test_an_adapter_that_does_not_fit_is_refused_in_one_line(tiny_model_dir: str) -> None:
    spec = adapter_spec(read_weight_spec(tiny_model_dir), SERVING)
    good = adapter_update(peft_model(tiny_model_dir, seed=1), 1)
    wrong_rank = adapter_spec(read_weight_spec(tiny_model_dir), LoraServing(8, 32.0, SERVING.targets, "merged"))
    with pytest.raises(WeightUpdateError, match=r"lora_A.weight: shape \(4, 64\) != expected \(8, 64\)"):
        validate_update(good, wrong_rank)
    fewer = WeightUpdate(1, good.names[:-2], good.arrays[:-2])
    with pytest.raises(WeightUpdateError, match="missing parameter .*lora_A.weight"):
        validate_update(fewer, spec)
    with pytest.raises(WeightUpdateError, match="no weight of the adapter's targets w_proj"):
        adapter_spec(read_weight_spec(tiny_model_dir), LoraServing(4, 32.0, ("w_proj",), "merged"))


def test_merged_serving_folds_the_adapter_as_peft_does(tiny_model_dir: str) -> None:
    """W0 + alpha/r * B A for each targeted weight, W0 for the others, a complete update: the
    weights of PEFT's ``merge_and_unload``."""
    from pipeline_rl.weight_sync.message import as_checked

    model = peft_model(tiny_model_dir, seed=3)
    checked = as_checked(adapter_update(model, 5))
    merged = Merger(tiny_model_dir, SERVING).merge(5, checked.tensors)
    want = {n: p.detach() for n, p in model.merge_and_unload().named_parameters()}
    got = dict(merged.tensors)
    assert merged.version == 5 and sorted(got) == sorted(read_weight_spec(tiny_model_dir).shapes)
    changed = 0
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, atol=1e-6, rtol=1e-5, msg=name)
        changed += name.endswith("_proj.weight")
    assert changed == 7 * 2


def test_a_partial_merge_holds_the_names_asked_for_in_buffers_the_next_merge_rewrites(tiny_model_dir: str) -> None:
    """``names``: those weights only (targeted ones merged, others W0); a targeted weight's
    tensor is the merger's own buffer, valid until the next merge."""
    from pipeline_rl.weight_sync.message import as_checked

    merger = Merger(tiny_model_dir, SERVING)
    first = as_checked(adapter_update(peft_model(tiny_model_dir, seed=3), 1))
    second = as_checked(adapter_update(peft_model(tiny_model_dir, seed=4), 2))
    complete = {n: t.clone() for n, t in merger.merge(1, first.tensors).tensors}
    untargeted = next(n for n in complete if n not in merger.targeted)
    target = sorted(merger.targeted)[0]
    names = frozenset({target, untargeted})
    partial = merger.merge(1, first.tensors, names)
    got = dict(partial.tensors)
    assert sorted(got) == sorted(names) and partial.num_bytes == sum(int(t.nbytes) for t in got.values())
    assert torch.equal(got[target], complete[target]) and torch.equal(got[untargeted], complete[untargeted])
    merger.merge(2, second.tensors, names)
    assert not torch.equal(got[target], complete[target])   # rewritten in place by version 2
