"""`fastserve.core` and the simulator import without torch: what lets the simulator run the
production scheduler anywhere."""

from __future__ import annotations

import subprocess
import sys

_BLOCKED = """
import importlib, pkgutil, sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import fastserve.core, fastserve.sim
for pkg in (fastserve.core, fastserve.sim):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
from fastserve.engine.core import EngineCore
print("ok")
"""


def test_core_and_simulator_import_with_torch_blocked() -> None:
    done = subprocess.run([sys.executable, "-c", _BLOCKED], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_block_catches_an_import_of_torch() -> None:
    done = subprocess.run([sys.executable, "-c", _BLOCKED + "import fastserve.executor.attention"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "torch" in done.stderr
