"""Bounded-time failure detection: every rank meets the others in a monitored barrier.

A daemon thread on every rank calls `torch.distributed.monitored_barrier` on the heartbeat
group. The driver paces the rounds (every `interval_s`); a worker that died or stopped
answering makes the driver's barrier fail within `timeout_s`, naming the rank. A worker's
barrier fails the same way when the driver is gone, so workers never outlive it. Processes the
driver spawned itself are also watched directly, so their death is noticed at once.

It runs beside the compute on its own group: the engine thread is never interrupted, it learns
of the failure from `Heartbeat.failure` (or from its own collective failing first).
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)


class Heartbeat:
    """The heartbeat thread of one rank. `on_failure(reason)` runs once, on that thread."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        timeout_s: float,
        is_driver: bool,
        on_failure: Callable[[str], None],
        processes: Mapping[int, subprocess.Popen[bytes]] | None = None,
    ) -> None:
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        self.interval_s = min(1.0, timeout_s / 4)
        self.is_driver = is_driver
        self.on_failure = on_failure
        self.processes = dict(processes or {})  # rank -> the worker the driver started
        self.failure: str | None = None
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastserve-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float = 2.0) -> None:
        """Stop after the current round; a failure seen from now on is not reported.

        NOTE: the driver stops its heartbeat before telling the workers to exit, so their
        leaving is not taken for a failure.
        """
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(join_s)

    def wait_failure(self, timeout_s: float) -> str | None:
        """The failure's description, waiting up to `timeout_s` for one to be seen."""
        self._failed.wait(timeout_s)
        return self.failure

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.is_driver:
                    self._pause()
                    if self._stop.is_set():
                        return
                dist.monitored_barrier(self.group, self.timeout, wait_all_ranks=self.is_driver)
        except Exception as exc:  # NOTE: any failure of the barrier means a rank is gone
            if not self._stop.is_set():
                self._fail(f"{'a worker' if self.is_driver else 'the driver'} stopped answering "
                           f"within {self.timeout.total_seconds():g} s: {exc}")

    def _pause(self) -> None:
        """Wait one interval; fail if a worker this process started has exited."""
        self._stop.wait(self.interval_s)
        dead = {r: p.returncode for r, p in self.processes.items() if p.poll() is not None}
        if dead and not self._stop.is_set():
            names = ", ".join(f"rank {r} (exit code {code})" for r, code in dead.items())
            self._fail(f"worker process exited: {names}")
            self._stop.set()

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = reason
            self._failed.set()
            logger.error("fastserve: %s", reason)
            self.on_failure(reason)
