"""Long work before the first step shows one progress line; other output goes to a log.

The unit tests drive :class:`pipeline_rl.console.Progress` directly; the end-to-end ones
build the built-in model in a private cache (a short closed-loop recipe: a few steps and
one check, the real warm start code) in a child process whose console is a pipe (plain
lines, as in CI) or a pseudo-terminal (one line redrawn in place), and check that its
console shows the progress and no third-party output (DeepSpeed's accelerator warning,
transformers' bars), which lands in the build's log instead.
"""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from pipeline_rl.console import Progress, quiet_console

ROOT = Path(__file__).resolve().parent.parent
#: What third-party libraries print during a build, when it reaches the console.
THIRD_PARTY = re.compile(r"\[WARNING\]|real_accelerator|Setting accelerator|Writing model shards|Loading weights"
                         r"|UserWarning|FutureWarning")
#: A progress line: what (training, a check, the probe), percentage, done/total, elapsed<left, rate.
PROGRESS = re.compile(r"(warm start|check \d|probe) \(sort\): +\d+% \d+/\d+ \[\d\d:\d\d<[\d:?]+, "
                      r"+[\d.?]+ ?(step/s|s/step|token/s|s/token)")


def test_plain_output_is_whole_lines_with_rate_and_time_left() -> None:
    out = io.StringIO()
    with Progress("work", 4, note="starting", stream=out, tty=False, every_s=0.2, refresh_s=0.05) as bar:
        bar.update(2)
        time.sleep(0.5)                      # a line every every_s, though nothing changed but the time
        bar.note("checking")
        bar.update(2)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert lines[0].startswith("work:   0% 0/4 [00:00<?") and lines[0].endswith(", starting]")
    assert any(line.startswith("work:  50% 2/4 [00:00<00:00") for line in lines), lines
    assert any(line.endswith("checking]") for line in lines) and lines[-1].startswith("work: 100% 4/4")
    assert all(re.search(r"step/s|s/step|\?step/s", line) for line in lines), lines
    assert len(lines) == len(set(lines)) >= 4


def test_a_terminal_gets_one_line_redrawn_and_cleared() -> None:
    out = io.StringIO()
    with Progress("work", 3, stream=out, tty=True, refresh_s=0.05) as bar:
        for _ in range(3):
            bar.update()
            time.sleep(0.1)
        bar.note("saving")
        bar.set_total(5)
    text = out.getvalue()
    assert "\n" not in text and text.count("\r") >= 3, repr(text)
    assert "3/5" in text and "saving" in text and "step/s" in text
    assert text.endswith("\r")                # cleared: the next line starts at the left


def test_a_phase_counts_on_the_same_line_and_the_work_resumes_after_it() -> None:
    out = io.StringIO()
    with Progress("train", 10, stream=out, tty=False, refresh_s=0.05) as bar:
        bar.update(4)
        before = bar.phase("check 1", 5, unit="token", note="sampling")
        bar.update(5)
        bar.resume(before, note="check 1: 0.2")
        bar.update(1)
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("train:  40% 4/10 [00:00<00:00")                  # where training paused
    assert lines[2].startswith("check 1:   0% 0/5 [") and lines[2].endswith("token/s, sampling]"), lines
    assert lines[3].startswith("check 1: 100% 5/5 [00:00<00:00")                 # where the check ended
    assert lines[4].startswith("train:  40% 4/10 [00:00<?") and lines[4].endswith("check 1: 0.2]"), lines
    assert lines[-1].startswith("train:  50% 5/10") and "step/s" in lines[-1]


def test_a_closed_progress_writes_nothing_more() -> None:
    out = io.StringIO()
    bar = Progress("work", 2, stream=out, tty=False, refresh_s=0.01)
    bar.close()
    written = out.getvalue()
    bar.update()
    bar.note("late")
    time.sleep(0.05)
    assert out.getvalue() == written and bar.close() >= 0.0


def test_quiet_console_sends_the_process_output_to_the_log(tmp_path: Path) -> None:
    code = (
        "import logging, os, sys, warnings\n"
        "from pathlib import Path\n"
        "from pipeline_rl.console import quiet_console\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        f"with quiet_console(Path({str(tmp_path / 'q.log')!r})) as console:\n"
        "    print('py stdout'); print('py stderr', file=sys.stderr)\n"
        "    os.write(1, b'fd 1\\n'); os.write(2, b'fd 2\\n')\n"
        "    logging.getLogger('lib').warning('a library warning')\n"
        "    warnings.warn('a python warning')\n"
        "    console.write('progress\\n')\n"
        "print('after'); print('after err', file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "after\n" and done.stderr == "progress\nafter err\n"
    log = (tmp_path / "q.log").read_text()
    for text in ("py stdout", "py stderr", "fd 1", "fd 2", "a library warning", "a python warning"):
        assert text in log


_BUILD = """\
import logging, sys
from pathlib import Path
from pipeline_rl.config import ModelConfig, TaskConfig
from pipeline_rl.models import WarmStartRecipe, default_model_dir
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s", stream=sys.stderr)
logging.getLogger("pipeline_rl").setLevel(logging.INFO)
recipe = WarmStartRecipe(steps=3, batch_size=8, smoothing=0.0, decoy_frac=0.75, stop_reward=0.99,
                         chunk=2, max_chunks=1, probe_prompts=4, probe_tokens=4)
print(default_model_dir(ModelConfig(), TaskConfig(name="sort", digits=3), recipe=recipe,
                        cache_dir=Path(sys.argv[1])))
"""


def _build_env() -> dict[str, str]:
    """A user's environment: no ``DS_ACCELERATOR`` (the suite's conftest sets it), so DeepSpeed,
    imported by transformers' save through accelerate, prints its accelerator warning."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    env.pop("DS_ACCELERATOR", None)
    return env


def _build_log(cache: Path) -> str:
    logs = sorted(cache.glob("builtin-*.log"))
    assert len(logs) == 1, sorted(p.name for p in cache.iterdir())
    return logs[0].read_text()


def test_a_warm_start_on_a_pipe_shows_plain_progress_and_no_third_party_output(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", _BUILD, str(tmp_path)], capture_output=True, text=True,
                          cwd=ROOT, env=_build_env(), timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("pipeline_rl.models: building the built-in model builtin-sort3-")
    assert lines[-2].startswith("pipeline_rl.models: built in ") and "its output: " in lines[-2]
    assert re.match(r"pipeline_rl.models: warm start builtin-sort3-\w+: no check reached sampled reward 0.99 in "
                    r"1 chunks \(\[\(5, 0.0\)\]\)$", lines[-1]), lines[-1]    # the project's own warning stays
    progress = lines[1:-2]
    assert progress and all(PROGRESS.match(line) for line in progress), progress
    assert any(line.startswith("warm start (sort): 100% 5/5") for line in progress)   # 3 steps + a chunk of 2
    assert any(line.startswith("check 1 (sort): ") for line in progress)               # 1 + 4 tokens at most
    assert any(line.endswith("check 1: reward 0.000 (stop at 0.990)]") for line in progress)
    assert progress[-1].startswith("probe (sort): ") and progress[-1].endswith(", saving]")
    assert not THIRD_PARTY.search(done.stdout + done.stderr), done.stdout + done.stderr
    assert done.stdout.strip().startswith(str(tmp_path / "builtin-sort3-"))
    if _accelerate_installed():   # then transformers' save imports DeepSpeed, which warns: in the log
        assert "Setting accelerator to CPU" in _build_log(tmp_path)


def test_a_warm_start_on_a_terminal_is_one_line(tmp_path: Path) -> None:
    out = _run_on_a_terminal([sys.executable, "-c", _BUILD, str(tmp_path)])
    text = out.replace("\r\n", "\n")
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if "building the built-in model" in line)
    assert lines[start + 1].startswith("\r") and "built in " in lines[start + 1], lines[start:start + 3]
    bar = lines[start + 1].rpartition("\r")[0]          # the redrawn line, before "built in ..."
    assert bar.count("\r") >= 3 and re.search(r"warm start \(sort\): 100%\|[^\r]*5/5", bar), repr(bar)
    assert not THIRD_PARTY.search(text), text
    if _accelerate_installed():
        assert "Setting accelerator to CPU" in _build_log(tmp_path)


def _accelerate_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def _run_on_a_terminal(argv: list[str]) -> str:
    """Run ``argv`` with a 120-column pseudo-terminal as its console; returns what it wrote."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(argv, stdin=child, stdout=child, stderr=child, cwd=ROOT, env=_build_env(),
                            close_fds=True)
    os.close(child)
    chunks = []
    try:
        while True:
            try:
                data = os.read(main, 65536)
            except OSError:                 # the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(main)
        assert proc.wait(timeout=600) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode(errors="replace")
