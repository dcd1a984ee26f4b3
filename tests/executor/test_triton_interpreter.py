"""The CUDA backend's Triton kernels, checked without a GPU: tests/executor/interpreted/ run in
a subprocess under Triton's interpreter (TRITON_INTERPRET=1 has to be set before triton is
first imported, which this process may already have done)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton not installed (pip install triton, or the [test] extra)")
import torch  # noqa: E402

if torch.cuda.is_available():  # interpreted/ is collected in this same run, on the GPU itself
    pytest.skip("a GPU runs the kernels natively", allow_module_level=True)

INTERPRETED = Path(__file__).parent / "interpreted"


def test_triton_kernels_under_the_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(INTERPRETED)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
