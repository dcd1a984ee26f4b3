"""The LoRA adapters an engine serves, by name: loaded at start-up (`lora_modules`) or while it
serves (`add` and `remove`: the server's /v1/load_lora_adapter and /v1/unload_lora_adapter,
vLLM's endpoints).

A name maps to a slot of `LoRAWeights`, where its weights are, and requests carry the slot
(`Request.lora_id`). Removing a name stops new requests from using it at once; its slot is
given to another adapter only once no request runs with it (requests already running finish
with the adapter they started with, never with another one's weights).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

from fastserve.model.arch import ArchConfig
from fastserve.model.lora import Adapter, LoRAError, read_adapter


class AdapterSlots(Protocol):
    """Where adapters' weights go, by slot: a model's `LoRAWeights`, or every rank's
    (`DistributedExecutor`)."""

    def load(self, slot: int, adapter: Adapter) -> None: ...

    def clear(self, slot: int) -> None: ...


class LoRANotFoundError(LoRAError):
    """No adapter of that name is served."""


@dataclass(frozen=True)
class ServedAdapter:
    """A name requests use, and where its weights are."""

    name: str
    path: str  # where it was read from (`/v1/models` shows it as `root`)
    slot: int  # its weights' slot: `Request.lora_id`
    serial: int  # counts loads: the same name loaded again is another adapter

    @property
    def cache_salt(self) -> str:
        """Its requests' prefix-cache salt. NOTE: the serial too, so blocks computed by an
        earlier adapter of the same name are never found."""
        return f"lora:{self.name}:{self.serial}"


def read_lora(name: str, path: str, arch: ArchConfig, max_rank: int) -> Adapter:
    """`read_adapter`, any failure a LoRAError naming the field at fault (default `lora_path`)."""
    try:
        return read_adapter(name, path, arch, max_rank)
    except LoRAError as exc:
        exc.param = exc.param or "lora_path"
        raise
    except Exception as exc:  # unreadable: a bad JSON or safetensors file, permissions
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {path!r}: "
                        f"{type(exc).__name__}: {exc}", "lora_path") from exc


class LoRAAdapters:
    """Names -> slots of the adapters served beside the model (empty without LoRA)."""

    def __init__(self, weights: AdapterSlots | None, arch: ArchConfig, max_rank: int,
                 max_loras: int) -> None:
        self.weights = weights  # None: the model takes no adapters (LoRA off)
        self.arch = arch
        self.max_rank = max_rank
        self.max_loras = max_loras
        # NOTE: replaced, never changed in place: the server reads it from its own thread.
        self._served: dict[str, ServedAdapter] = {}
        self._serials = itertools.count()

    def __contains__(self, name: str) -> bool:
        return name in self._served

    def get(self, name: str) -> ServedAdapter | None:
        return self._served.get(name)

    @property
    def paths(self) -> dict[str, str]:
        """name -> path of each adapter served, in the order they were loaded."""
        return {a.name: a.path for a in self._served.values()}

    def requests_by_adapter(self, slots: Iterable[tuple[int, bool]]) -> dict[str, dict[str, int]]:
        """name -> {"running": n, "waiting": m} for each adapter served, from the (slot, is
        running) of each request; requests of an unloaded adapter count under "(unloaded)"."""
        names = {a.slot: a.name for a in self._served.values()}
        counts = {name: {"running": 0, "waiting": 0} for name in names.values()}
        for slot, is_running in slots:
            if slot:
                entry = counts.setdefault(names.get(slot, "(unloaded)"), {"running": 0, "waiting": 0})
                entry["running" if is_running else "waiting"] += 1
        return counts

    def read(self, name: str, path: str) -> Adapter:
        """The adapter's weights, checked against the model (slow: disk; any thread)."""
        if self.weights is None:
            raise LoRAError("LoRA adapters are off: start with --lora-modules or "
                            "--allow-runtime-lora-updating")
        return read_lora(name, path, self.arch, self.max_rank)

    def add(self, adapter: Adapter, path: str, busy_slots: Collection[int],
            replace: bool = False) -> ServedAdapter:
        """Serve `adapter` under its name. `busy_slots`: slots requests run with now (not to
        be overwritten). `replace`: a name already served is loaded again (else refused)."""
        assert self.weights is not None  # `read` refused
        old = self._served.get(adapter.name)
        if old is not None and not replace:
            raise LoRAError(f"lora_name: the adapter {adapter.name!r} is loaded already (set "
                            "load_inplace to true to load it again)", "lora_name")
        slot = self._free_slot(busy_slots, old)
        try:
            self.weights.load(slot, adapter)
        except BaseException:
            if old is not None and old.slot == slot:  # its weights are gone with the slot's
                self._served = {n: a for n, a in self._served.items() if n != old.name}
            self.weights.clear(slot)
            raise
        served = ServedAdapter(adapter.name, path, slot, next(self._serials))
        rest = {name: a for name, a in self._served.items() if name != adapter.name}
        self._served = {**rest, adapter.name: served}
        return served

    def remove(self, name: str) -> ServedAdapter:
        """Stop serving `name`; its slot is free once no request runs with it."""
        served = self._served.get(name)
        if served is None:
            raise LoRANotFoundError(f"lora_name: no adapter named {name!r} is loaded "
                                    f"(loaded: {', '.join(self._served) or 'none'})", "lora_name")
        self._served = {n: a for n, a in self._served.items() if n != name}
        return served

    def _free_slot(self, busy_slots: Collection[int], replacing: ServedAdapter | None) -> int:
        taken = {a.slot for a in self._served.values() if a is not replacing}
        if len(taken) >= self.max_loras:
            raise LoRAError(f"max_loras: {self.max_loras} adapters are loaded already; unload "
                            "one first, or serve with a higher --max-loras")
        for slot in range(1, self.max_loras + 1):
            if slot not in taken and slot not in busy_slots:
                return slot
        raise LoRAError(f"max_loras: every free slot of the {self.max_loras} still runs "
                        "requests of an adapter unloaded or replaced before; load again once "
                        "they finish")
