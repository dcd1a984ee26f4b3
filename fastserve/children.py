"""Child processes that end with their parent: a signal during start-up (the CPU kernels'
first build runs `ninja` and the compiler for minutes) stops them too.

Python's default SIGTERM ends the process at once and leaves its children running; the
build's are started by torch's tooling, so they cannot be put in a process group of ours.
`stop_children_on_signal` stops every descendant (found through /proc) before the process ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType


def descendants(pid: int | None = None) -> list[int]:
    """The ids of `pid`'s (default: this process's) descendants, from /proc (Linux; [] where
    it cannot be read)."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            # NOTE: the name (field 2) may hold spaces and parentheses: split after its ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants(grace_s: float = 1.0) -> None:
    """SIGTERM every descendant, then SIGKILL those still there after `grace_s`."""
    pids = descendants()
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [p for p in pids if _is_running(p)]
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@contextlib.contextmanager
def stop_children_on_signal() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT stop this process's descendants, then end the
    process as the signal would have (status 128 + signal). Main thread only."""

    def stop(sig: int, frame: FrameType | None) -> None:
        kill_descendants()
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
