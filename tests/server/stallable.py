"""`python -m tests.server.stallable serve ARGS`: the real `fastserve serve`, whose engine loop
freezes inside an iteration while the file named by $FASTSERVE_TEST_STALL_FILE exists (a
kernel that never returns, as far as the server can tell): what the watchdog and the
shutdown backstop are tested against."""

from __future__ import annotations

import os
import sys
import time

from fastserve import cli
from fastserve.engine.llm_engine import LLMEngine
from fastserve.request import RequestOutput

STALL_FILE_ENV = "FASTSERVE_TEST_STALL_FILE"


def main() -> int:
    path = os.environ[STALL_FILE_ENV]
    step = LLMEngine.step

    def stalling_step(self: LLMEngine) -> list[RequestOutput]:
        while os.path.exists(path):
            time.sleep(0.05)
        return step(self)

    LLMEngine.step = stalling_step  # type: ignore[method-assign]
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
