"""The attention backends and the registry that picks one, once, per runner.

`ModelConfig.attention_backend` names one ("triton", "cpu", "torch") or leaves the choice to
`auto`: the first of `AUTO_ORDER` that runs on the device with the cache's dtype.

- triton (`triton_attn.py`): CUDA; needs the `triton` package (it ships with torch's CUDA
  builds). Captures decode iterations as CUDA graphs.
- cpu (`cpu.py`): the C++ kernels of `executor/cpu_kernels.py`, a float32, bfloat16 or
  float16 cache on CPU.
- torch (`torch_sdpa.py`): per-request SDPA on any device (on CUDA without cuDNN's SDPA).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from fastserve.config import ATTENTION_BACKENDS
from fastserve.executor.attention import PagedAttention
from fastserve.executor.backends.cpu import CpuAttention
from fastserve.executor.backends.torch_sdpa import TorchAttention, TorchCudaAttention
from fastserve.executor.cpu_kernels import decode_attention_kernel

logger = logging.getLogger(__name__)


def _why_not_triton(cache_dtype: torch.dtype) -> str:
    if not _triton_backends():
        return "triton is not importable"
    return f"it does not run a {str(cache_dtype).removeprefix('torch.')} KV cache on this GPU"


def _triton_backends() -> list[type[PagedAttention]]:
    # NOTE: imported on first need, not with this module: triton is optional, and importing
    # it costs seconds that a CPU process (every distributed worker too) has no use for.
    try:
        from fastserve.executor.backends.triton_attn import TritonAttention
    except ImportError as exc:
        logger.info("triton attention backend unavailable: %s", exc)
        return []
    return [TritonAttention]


# Name -> the classes answering to it, most specific first (`is_supported` picks).
_BACKENDS: dict[str, Callable[[], list[type[PagedAttention]]]] = {
    "triton": _triton_backends,
    "cpu": lambda: [CpuAttention],
    "torch": lambda: [TorchCudaAttention, TorchAttention],
}
# `auto` tries these names in turn.
AUTO_ORDER = ("triton", "cpu", "torch")


def backend_classes(name: str, device: torch.device) -> list[type[PagedAttention]]:
    """The classes registered under `name` that may run on `device`'s type: triton is looked
    for on CUDA (or on CPU under Triton's interpreter, which the tests use) only."""
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return []
    return _BACKENDS[name]()


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A cache may also be float8 (CacheConfig.kv_cache_dtype "fp8").
KV_TORCH_DTYPES = {**TORCH_DTYPES, "fp8": torch.float8_e4m3fn}


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: `name` (CacheConfig.kv_cache_dtype), or for `auto` the model's,
    except that a half-precision model on a CPU without the C++ kernels keeps a float32 cache
    (the portable path's half-precision attention is several times slower per call; the
    kernels read a half cache directly, at half the bytes)."""
    if name != "auto":
        return KV_TORCH_DTYPES[name]
    if (device.type == "cpu" and model_dtype in (torch.bfloat16, torch.float16)
            and decode_attention_kernel() is None):
        return torch.float32
    return model_dtype


def attention_backend(name: str, device: torch.device,
                      cache_dtype: torch.dtype) -> type[PagedAttention]:
    """The backend class for `name` ("auto" or one of `BACKENDS`) on this device and cache
    dtype; a clear error when the named one cannot run here."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {name!r}")
    for candidate in AUTO_ORDER if name == "auto" else (name,):
        for cls in backend_classes(candidate, device):
            if cls.is_supported(device, cache_dtype):
                if name == "auto" and device.type == "cuda" and candidate != "triton":
                    logger.warning(
                        "CUDA without the triton backend (%s): attention runs as per-request "
                        "torch SDPA without CUDA graphs, measured at 11x-50x the weight floor; "
                        "install triton (torch's CUDA wheels ship it)", _why_not_triton(cache_dtype))
                return cls
    if name == "triton" and device.type == "cuda":
        raise ValueError("attention_backend='triton' needs the triton package (pip install triton)")
    raise ValueError(
        f"attention_backend={name!r} does not run on device {device.type!r} with a "
        f"{str(cache_dtype).removeprefix('torch.')} KV cache"
    )
