"""`dtype="auto"`: the model's compute dtype chosen for this machine, measured on a CPU.

On a GPU, the checkpoint's own half type (bfloat16 when it was saved in float32 or says
nothing), float16 where the GPU has no bfloat16 (`device_choice.gpu_half_dtype`). On a CPU the faster of float32 and bfloat16 depends on the instructions it has:
with AVX-512 BF16 or AMX, oneDNN multiplies bfloat16 at 2-3x float32's speed; without them
bfloat16 is emulated and several times slower. So rather than guess from flag names, the
choice times one decode-sized matmul of this model's shape (a batch of 32 rows through its
MLP's up projection, each dtype's weights packed as the CPU backend packs them) in
both dtypes, a few milliseconds, and takes the faster; bfloat16 is not tried where oneDNN
reports no bf16 support, or with the CPU kernels off (FASTSERVE_CPU_KERNELS=0).
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fastserve.config import EngineConfig
from fastserve.executor.cpu_kernels import cpu_kernels_enabled
from fastserve.executor.cpu_linear import packed_weight
from fastserve.executor.device_choice import choose_device, gpu_half_dtype
from fastserve.model.arch import ArchConfig
from fastserve.model.loader import read_arch_config

logger = logging.getLogger(__name__)

PROBE_ROWS = 32  # a decode batch


@dataclass(frozen=True)
class DtypeChoice:
    """What `auto` resolved to, and why (logged, and shown in /metrics)."""

    dtype: str
    reason: str
    probe_ms: dict[str, float]  # dtype -> median time of the probe matmul (CPU only)


def choose_dtype(arch: ArchConfig, device: str) -> DtypeChoice:
    """The dtype `auto` means for this checkpoint on this device (see the module docstring)."""
    if not device.startswith("cpu"):
        dtype, reason = gpu_half_dtype(arch.torch_dtype, torch.cuda.is_bf16_supported())
        return DtypeChoice(dtype, f"{reason}; {torch.cuda.get_device_name(device)}", {})
    if not cpu_kernels_enabled():
        return DtypeChoice("float32", "CPU kernels off (FASTSERVE_CPU_KERNELS=0)", {})
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return DtypeChoice("float32", "no bfloat16 instructions on this CPU (oneDNN)", {})
    ms = {name: _probe_ms(arch, getattr(torch, name)) for name in ("float32", "bfloat16")}
    best = min(ms, key=ms.__getitem__)
    return DtypeChoice(best, "the faster decode-sized matmul on this CPU", ms)


def _probe_ms(arch: ArchConfig, dtype: torch.dtype, reps: int = 9) -> float:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(arch.intermediate_size, arch.hidden_size, generator=g).to(dtype)
    x = torch.randn(PROBE_ROWS, arch.hidden_size, generator=g).to(dtype)
    packed = packed_weight(w)  # as the CPU backend packs its weights

    def run() -> None:
        if packed is None:  # no fast path for this dtype: what the model would run
            torch.nn.functional.linear(x, w)
        else:
            packed.matmul(x, packed.weight, None)

    run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def resolve_config(config: EngineConfig, model_path: Path) -> tuple[EngineConfig, DtypeChoice]:
    """The config with `model.device` and `model.dtype` resolved (no-ops unless "auto"), and
    the dtype choice."""
    device = resolve_device(config.model.device)
    choice = resolve_dtype(config.model.dtype, model_path, device)
    model = dataclasses.replace(config.model, device=device, dtype=choice.dtype)
    return dataclasses.replace(config, model=model), choice


def resolve_device(asked: str) -> str:
    """`asked`, or for "auto" CUDA where torch sees a GPU, else the CPU (logged)."""
    device = choose_device(asked, torch.cuda.is_available())
    if asked == "auto":
        logger.info("device auto -> %s (%s)", device,
                    torch.cuda.get_device_name(device) if device.startswith("cuda")
                    else "torch sees no CUDA device")
    return device


def resolve_dtype(dtype: str, model_path: Path, device: str) -> DtypeChoice:
    """`dtype` itself when named, or for "auto" the choice above (logged)."""
    if dtype != "auto":
        return DtypeChoice(dtype, "asked for", {})
    arch = read_arch_config(model_path)
    choice = choose_dtype(arch, device)
    probe = ", ".join(f"{k} {v:.3f} ms" for k, v in choice.probe_ms.items())
    logger.info("dtype auto -> %s (%s%s)", choice.dtype, choice.reason,
                f": {PROBE_ROWS}x{arch.hidden_size} @ {arch.hidden_size}x"
                f"{arch.intermediate_size} took {probe}" if probe else "")
    return choice
