"""Launch configs of the Triton decode kernel, tuned per GPU model and decode batch size.

`benchmarks/gpu/triton_decode_sweep.py` times every config on this GPU and writes the fastest to
`$FASTSERVE_CACHE/triton/decode-<GPU>.json` (as vLLM ships fused-MoE configs per device); the
package's `configs/` folder is read first. A file maps keys to configs:

- `group1-d128-bfloat16`: every batch of that attention shape and cache dtype;
- `group1-d128-bfloat16-b32`: decode batches of at most 32 (the smallest bound that covers a
  batch wins). A small batch has few programs and short ones fill the GPU differently from
  long ones; a CUDA graph is captured per batch size, so each captured size keeps its config.

A shipped file also says where its figures come from under `_provenance` (the GPU, torch and
Triton versions, the commit, the command, the date, each shape's fastest time): keys that begin
with `_` are not configs.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fastserve.paths import cache_dir

PROVENANCE_KEY = "_provenance"


@dataclass(frozen=True)
class DecodeConfig:
    """The launch shape of the decode kernel: keys per tile, warps, pipeline stages, and
    whether a GQA group's heads go through `tl.dot` (tensor cores; rows padded to 16)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    use_dot: bool = True  # on an H200 the dot was faster for MHA too (triton_decode_sweep.py)
    # ptxas's registers per thread (Triton's `maxnreg`), None: its own choice. Fewer registers,
    # more programs per SM: at batch 32 and 32 KV heads, 64 fit all 1,024 programs of a
    # 32-key, 4-warp config on an H100's SMs at once, where 72 leave a second wave.
    max_registers: int | None = None

    @staticmethod
    def key(group: int, head_dim: int, dtype: torch.dtype, max_batch: int | None = None) -> str:
        base = f"group{group}-d{head_dim}-{str(dtype).removeprefix('torch.')}"
        return base if max_batch is None else f"{base}-b{max_batch}"


def pick_decode_config(tuned: dict[str, DecodeConfig], group: int, head_dim: int,
                       dtype: torch.dtype, num_decodes: int) -> DecodeConfig:
    """The config for a batch of `num_decodes`: the tuned entry with the smallest batch bound
    at or above it, else the shape's entry for every batch, else the default."""
    base = DecodeConfig.key(group, head_dim, dtype)
    prefix = base + "-b"
    bounds = sorted(int(k[len(prefix):]) for k in tuned
                    if k.startswith(prefix) and k[len(prefix):].isdigit())
    for bound in bounds:
        if num_decodes <= bound:
            return tuned[f"{prefix}{bound}"]
    return tuned.get(base, DecodeConfig())


@functools.cache
def tuned_decode_configs(device_name: str) -> dict[str, DecodeConfig]:
    """Configs measured for this GPU model: the package's `configs/` first, then the cache's,
    which a sweep on this machine writes. Empty when there are none."""
    found: dict[str, DecodeConfig] = {}
    for folder in (Path(__file__).parent / "configs", tuned_config_dir()):
        path = folder / tuned_config_name(device_name)
        if path.is_file():
            found.update({k: DecodeConfig(**v) for k, v in json.loads(path.read_text()).items()
                          if not k.startswith("_")})
    return found


def tuned_config_dir() -> Path:
    return cache_dir() / "triton"


def tuned_config_name(device_name: str) -> str:
    return "decode-" + "".join(c if c.isalnum() else "_" for c in device_name) + ".json"


@functools.cache
def decode_config_for(device_index: int, group: int, head_dim: int, dtype: torch.dtype,
                      num_decodes: int) -> DecodeConfig:
    """The tuned config for this GPU, shape, dtype and batch, else the default (cached: an
    eager forward pass asks once per layer)."""
    tuned = tuned_decode_configs(torch.cuda.get_device_name(device_index))
    return pick_decode_config(tuned, group, head_dim, dtype, num_decodes)


def decode_config(cache: torch.Tensor, group: int, num_decodes: int) -> DecodeConfig:
    if cache.device.type != "cuda":  # Triton's interpreter (the tests), or compiled offline
        return DecodeConfig()
    return decode_config_for(cache.device.index, group, cache.shape[-1], cache.dtype,
                             num_decodes)
