"""Where paceline keeps what it builds once per machine: converted checkpoints, runtime snapshots, compiled
kernels, start-up profiles. Its own module so that the kernels (which the loader imports) need not import the
loader for it."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PACELINE_CACHE") or Path.home() / ".cache" / "paceline")
