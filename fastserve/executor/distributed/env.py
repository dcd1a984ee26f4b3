"""How this process was launched. Pure Python (no torch): the CLI asks before importing more."""

from __future__ import annotations

import os


def launched_by_torchrun() -> bool:
    """`torchrun` (or any env:// launcher) sets RANK and WORLD_SIZE for every process it starts."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def env_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_local_world_size() -> int:
    """Processes torchrun started on this machine."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_torchrun_worker() -> bool:
    """Ranks > 0 of a torchrun launch run the worker loop; rank 0 runs the command itself."""
    return launched_by_torchrun() and env_rank() != 0
