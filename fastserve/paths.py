"""Where fastserve keeps what it makes once and reuses: the generated models, the compiled CPU
kernels, start-up profiles and Triton configs, all under one cache root.

NOTE: a leaf module (standard library only, `.importlinter`'s `paths-leaf`): any layer may ask
for the cache root, from the CLI down to the executor, without importing the model package."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FASTSERVE_CACHE"


def cache_dir() -> Path:
    """`$FASTSERVE_CACHE`, else ~/.cache/fastserve."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "fastserve"
