"""Run fully asynchronous GRPO: ``python launch/async_grpo.py --staleness 2``.

With no ``--model`` the built-in small model and task are used, so the command
runs on a fresh CPU machine with nothing downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline_rl.cli import main_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    cfg = main_config(argv)
    if cfg is None:
        return 0
    from pipeline_rl.driver import run

    return run(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
