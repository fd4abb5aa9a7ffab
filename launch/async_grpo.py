"""Run fully asynchronous GRPO: ``python launch/async_grpo.py --staleness 2``.

With no ``--model`` the built-in small model and task are used, so the command
runs on a fresh CPU machine with nothing downloaded. ``pipeline-rl run`` (the installed
command, ``pipeline_rl/cli.py``) calls the same :func:`main`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline_rl.cli import train_main as main  # noqa: E402  (the same main as ``pipeline-rl run``)


if __name__ == "__main__":
    raise SystemExit(main())
