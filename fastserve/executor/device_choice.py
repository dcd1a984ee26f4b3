"""What `--device auto` and a GPU's `--dtype auto` mean: pure choices over what the machine
reports (`dtype_choice.resolve_config` asks torch and calls these), tested on a CPU."""

from __future__ import annotations

HALF_DTYPES = ("bfloat16", "float16")


def choose_device(asked: str, cuda_available: bool) -> str:
    """`asked` itself, or for "auto" the first GPU where CUDA is available, else the CPU."""
    if asked != "auto":
        return asked
    return "cuda" if cuda_available else "cpu"


def gpu_half_dtype(saved: str | None, bf16_supported: bool) -> tuple[str, str]:
    """A GPU's dtype for `--dtype auto`, and why: the checkpoint's half type (bfloat16 when
    it was saved in float32 or says nothing), but float16 where the device has no bfloat16
    (before Ampere: graph capture and the kernels would fail rather than fall back)."""
    wanted = saved if saved in HALF_DTYPES else "bfloat16"
    if wanted == "bfloat16" and not bf16_supported:
        return "float16", "this GPU has no bfloat16 (torch.cuda.is_bf16_supported() is False)"
    return wanted, "the checkpoint's half type" if saved in HALF_DTYPES else \
        f"the checkpoint is {saved or 'of no stated dtype'}; bfloat16 runs on this GPU"
