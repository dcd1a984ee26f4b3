"""Load a Hugging Face checkpoint directory into `LlamaForCausalLM`.

Reads `config.json` and safetensors files only (never pickle). Each checkpoint
tensor is routed to its (possibly fused, possibly sharded) parameter through that
parameter's `weight_loader`, so the same code serves every tensor-parallel rank.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from fastserve.model.arch import ArchConfig
from fastserve.model.layers import default_weight_loader
from fastserve.model.llama import LlamaForCausalLM

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some old checkpoints saved; we recompute them.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# Experts are loaded under Qwen3-MoE's names (`experts.{i}.gate_proj.weight`, ...). Mixtral's
# checkpoints name the block `block_sparse_moe` and the projections w1 (gate), w3 (up) and w2
# (down); transformers v5 keeps each layer's experts as two stacked tensors.
_MIXTRAL_EXPERT = re.compile(r"^(.*\.experts\.\d+)\.(w1|w2|w3)\.weight$")
_MIXTRAL_LEAVES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class ModelLoadError(ValueError):
    """The checkpoint directory cannot be loaded; the message names the problem."""


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: tuple[int, int] | None = None,
    load_format: str = "auto",
) -> tuple[LlamaForCausalLM, ArchConfig]:
    """Build the model for `path`'s config.json and fill it from its safetensors files.

    Returns the model in eval mode, in `dtype` on `device`, holding the
    (tp_rank, tp_size) shard of every parallel layer, and only layers [start, end)
    when `layers` names a pipeline stage's range (tensors of other stages are skipped).
    With `load_format="dummy"` no file but config.json is read: the weights are random,
    made on the device (`fill_dummy_weights`).
    """
    root = Path(path)
    if not root.is_dir():
        raise ModelLoadError(_not_a_checkpoint(root))
    if load_format not in ("auto", "dummy"):
        raise ModelLoadError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    arch = read_arch_config(root)
    files = find_safetensors_files(root) if load_format == "auto" else []
    for file in files:  # every header read before the model is allocated
        check_safetensors(file)
    with _default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(arch, tp_rank=tp_rank, tp_size=tp_size, layers=layers)
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        load_weights(model, iter_safetensors(files))
    return model.eval(), arch


def fill_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights drawn on the model's device, as vLLM's `--load-format dummy` does.

    Scaled so activations stay O(1) and the logits are neither flat nor one-hot, which keeps
    greedy decoding, sampling and the kernels on realistic values: matrices N(0, 1/fan_in),
    norm weights 1. A weight's values depend on `seed` and its name, not on other weights.
    """
    with torch.no_grad():
        for i, (_, param) in enumerate(sorted(model.named_parameters())):
            if param.dim() == 1:
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + i)
            fan_in = param.shape[-1]
            param.normal_(0.0, fan_in**-0.5, generator=gen)


def read_arch_config(root: Path) -> ArchConfig:
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(_not_a_checkpoint(root))
    try:
        with open(config_path, encoding="utf-8") as f:
            cfg = json.load(f)
        return ArchConfig.from_hf_config(cfg)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_path} is not valid JSON: {e}") from e
    except ValueError as e:
        raise ModelLoadError(f"{config_path}: {e}") from e


# What a model argument may be, said by every refusal of one.
_SUPPORTED = ("fastserve serves a local Hugging Face-format directory (config.json, "
              "tokenizer.json and *.safetensors weights, or config.json alone with "
              "--load-format dummy) or a built-in preset (`fastserve make-model --preset NAME "
              "--out DIR`)")


def _not_a_checkpoint(root: Path) -> str:
    """Why `root` cannot be served, what can be, and how to get it in that form."""
    text = str(root)
    if root.suffix.lower() == ".gguf":
        return (f"{text!r}: GGUF files are not supported; {_SUPPORTED}. Download the model's "
                "original checkpoint instead: huggingface-cli download ORG/NAME --local-dir DIR")
    if root.is_dir():
        return f"{text!r} has no config.json; {_SUPPORTED}"
    if not root.exists() and text.count("/") == 1 and not text.startswith((".", "~")):
        return (f"{text!r} is not a local directory (models are not fetched from the Hugging "
                f"Face Hub); {_SUPPORTED}. Download it first: huggingface-cli download {text} "
                "--local-dir DIR, then serve DIR")
    if not root.exists():
        return f"{text!r} does not exist; {_SUPPORTED}"
    return f"{text!r} is not a model directory; {_SUPPORTED}"


def find_safetensors_files(root: Path) -> list[Path]:
    """The checkpoint's shard files: those named by the index, else model.safetensors, else *.safetensors."""
    index_path = root / SAFETENSORS_INDEX
    if index_path.is_file():
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f).get("weight_map", {})
        if not weight_map:
            raise ModelLoadError(f"{index_path} has an empty weight_map")
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise ModelLoadError(
                f"{index_path.name} names missing shard file(s): {', '.join(missing)}"
            )
        return files
    if (root / SAFETENSORS_FILE).is_file():
        return [root / SAFETENSORS_FILE]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"no *.safetensors files in {str(root)!r} (pickle checkpoints are not supported; "
            "--load-format dummy serves its config.json with random weights)"
        )
    return files


def check_safetensors(file: Path) -> None:
    """Raise ModelLoadError naming `file` unless its header is whole and its tensors fit in
    it (safetensors checks both when it opens a file: a truncated download, another format)."""
    try:
        with safe_open(str(file), framework="pt", device="cpu"):
            pass
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"{file}: not a whole safetensors file ({exc}); download it "
                             "again") from None


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Tensor]]:
    """(HF name, CPU tensor) for every tensor of every file, one tensor in memory at a time."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: cannot read a tensor ({exc}); download it "
                                 "again") from None


def load_weights(model: LlamaForCausalLM, weights: Iterator[tuple[str, Tensor]]) -> None:
    """Copy HF-named tensors into `model`; raise naming any weight the model needs but did not get."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = model.arch.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in canonical_weights(weights):
        if name.endswith(_SKIPPED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if not model.holds_weight(name):  # another pipeline stage's tensor
            continue
        target, shard_id = _map_name(model, name)
        if tied and target not in params and name == "model.embed_tokens.weight":
            target = name = "lm_head.weight"  # a last stage's tied head, without the embedding
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            with torch.no_grad():
                loader(param, tensor, shard_id)
        except ValueError as e:
            raise ModelLoadError(f"cannot load checkpoint tensor {name!r}: {e}") from e
        loaded.add(name)
    if unexpected:
        raise ModelLoadError(
            f"checkpoint has tensor(s) this {model.arch.architecture} does not use: {', '.join(unexpected[:5])}"
        )
    missing = [_hub_name(model.arch, n) for n in expected_weight_names(model) if n not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"checkpoint is missing weight(s): {shown}")


def canonical_weights(weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors with MoE experts under one naming: Mixtral's renamed and
    stacked expert tensors ([experts, 2 x intermediate, hidden] gate then up, [experts,
    hidden, intermediate]) split into one tensor per expert and projection."""
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if (m := _MIXTRAL_EXPERT.match(name)) is not None:
            yield f"{m.group(1)}.{_MIXTRAL_LEAVES[m.group(2)]}.weight", tensor
        elif (m := _STACKED_EXPERTS.match(name)) is not None and tensor.dim() == 3:
            for i, expert in enumerate(tensor.unbind(0)):
                prefix = f"{m.group(1)}.{i}"
                if m.group(2) == "down_proj":
                    yield f"{prefix}.down_proj.weight", expert
                else:
                    gate, up = expert.chunk(2, dim=0)
                    yield f"{prefix}.gate_proj.weight", gate
                    yield f"{prefix}.up_proj.weight", up
        else:
            yield name, tensor


def _hub_name(arch: ArchConfig, name: str) -> str:
    """`name` (as `canonical_weights` names it) as the architecture's hub checkpoints spell it."""
    if arch.architecture != "MixtralForCausalLM" or ".experts." not in name:
        return name
    leaf = {v: k for k, v in _MIXTRAL_LEAVES.items()}
    module_path, _, kind = name.rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    return f"{parent.replace('.mlp.', '.block_sparse_moe.')}.{leaf.get(proj, proj)}.{kind}"


def expected_weight_names(model: LlamaForCausalLM) -> list[str]:
    """The HF tensor names a complete checkpoint for `model` must contain."""
    unfused: dict[str, list[str]] = {
        fused: [] for fused, _ in model.packed_modules_mapping.values()
    }
    for hf_name, (fused, _) in model.packed_modules_mapping.items():
        unfused[fused].append(hf_name)
    names: list[str] = []
    for name, _ in model.named_parameters():  # a tied lm_head is listed once, as embed_tokens
        module_path, _, param_kind = name.rpartition(".")
        parent, _, leaf = module_path.rpartition(".")
        if leaf not in unfused:
            names.append(name)
            continue
        names.extend(f"{parent}.{hf_leaf}.{param_kind}" for hf_leaf in unfused[leaf])
    return names


def _map_name(model: LlamaForCausalLM, hf_name: str) -> tuple[str, str | int | None]:
    module_path, _, param_kind = hf_name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    packed = model.packed_modules_mapping.get(leaf)
    if packed is None:
        return hf_name, None
    fused, shard_id = packed
    return f"{parent}.{fused}.{param_kind}", shard_id


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created directly in the target dtype: no float32 copy first.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
