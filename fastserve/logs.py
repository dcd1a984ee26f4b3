"""The commands' log lines: a timestamp on each, written so that tqdm's progress bars survive,
and the start-up steps timed (a first start on a small machine takes minutes; each step says
what it does and how long it took)."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
# A step shorter than this logs only its end line at DEBUG: a cached start stays quiet.
SLOW_STEP_S = 1.0


class _TqdmHandler(logging.Handler):
    """Writes through `tqdm.write`, which clears the progress bars of the terminal, prints
    the line and redraws them (a plain write lands inside a bar and breaks it). To the
    `sys.stderr` of the moment (a test's capture replaces it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def configure_logging(level: str = "info") -> None:
    """Every log line of the process on stderr as `date time.ms LEVEL logger: message`.
    Replaces the plain stream handlers set earlier (calling it twice is harmless; other
    handlers, e.g. a test runner's capture, stay)."""
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        if type(old) in (_TqdmHandler, logging.StreamHandler):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


@contextlib.contextmanager
def startup_step(logger: logging.Logger, what: str, *, expect_slow: bool = True) -> Iterator[None]:
    """Log `what` as it starts (when `expect_slow`) and its duration as it ends: the start-up
    steps (model load, kernel build, cost profile, warm-up, graph capture) of a first start
    take from seconds to minutes, and a user watching the log should see which one runs."""
    if expect_slow:
        logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    took_s = time.perf_counter() - start
    level = logging.INFO if expect_slow or took_s >= SLOW_STEP_S else logging.DEBUG
    logger.log(level, "%s: done in %.1f s", what, took_s)
