"""CPU kernels compiled on first use with torch's C++ extension tooling.

Optional by design: if no C++ compiler is present (or FASTSERVE_NO_CPU_KERNELS=1), callers get
None and fall back to plain PyTorch ops, which are correct but slower for decode.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType

from fastserve.model.make_model import cache_dir

logger = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "decode_attention.cpp"


@functools.cache
def decode_attention_kernel() -> ModuleType | None:
    if os.environ.get("FASTSERVE_NO_CPU_KERNELS") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load

        # One build folder per source version: checkouts of different versions sharing a
        # cache (old vs new in a benchmark, worktrees) neither rebuild over each other nor
        # load each other's kernel.
        digest = hashlib.sha256(_SRC.read_bytes()).hexdigest()[:12]
        build = cache_dir() / "torch_extensions" / f"decode_attention-{digest}"
        build.mkdir(parents=True, exist_ok=True)
        return load(
            name="fastserve_decode_attention",
            sources=[str(_SRC)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # no compiler, or a failed build: fall back, loudly
        logger.warning("CPU decode-attention kernel unavailable, using PyTorch ops: %s", exc)
        return None
