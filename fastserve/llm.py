"""The offline API, mirroring vLLM's: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from fastserve.args import engine_config
from fastserve.engine.llm_engine import LLMEngine
from fastserve.executor.openmp import has_released, note_parallel_ops
from fastserve.executor.platform import platform_for
from fastserve.request import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)
# How often a loop with nothing to run but requests waiting for their grammars looks again.
_PREPARATION_POLL_S = 0.005


class LLM:
    """Every engine option is a keyword argument (`max_batch_size=`, `kv_cache_gib=`, ...).

    `shutdown()`, or leaving `with LLM(...) as llm:`, releases the model, the KV cache and any
    distributed workers, so another LLM can start in the same process.
    """

    def __init__(self, model: str | None = None, profile: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(profile_path=profile, model=model, **kwargs))
        # NOTE: the engine's: "auto" device and dtype resolved, the KV pool and batch sized
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self._is_shut_down = False
        self._built_on = threading.current_thread()
        note_parallel_ops()  # (its team is this LLM's now, whatever it released before)
        self._is_thread_warned = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the distributed workers and free the model and the KV cache (device and host
        memory). Safe to call more than once; the LLM generates no more afterwards."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self.engine.shutdown()
        del self.engine  # NOTE: the last reference to the model and the KV tensors
        gc.collect()  # they sit in reference cycles (modules, hooks); free them now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def load_lora(self, name: str, path: str, replace: bool = False) -> None:
        """Serve the PEFT adapter at `path` as `name` from now on (with `lora_modules` or
        `allow_runtime_lora_updating`; `max_loras` at once). `replace`: load a name already
        served again. Raises LoRAError naming what is wrong."""
        self.engine.add_lora(self.engine.loras.read(name, path), path, replace=replace)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`. Raises LoRANotFoundError."""
        self.engine.remove_lora(name)

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora: str | None | Sequence[str | None] = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt together; returns one final output per prompt, in order.

        With `n` (or `best_of`) > 1 a prompt's output is its sequence 0's (the best, with
        `best_of`), and `outputs` lists the final output of each of its `n` sequences.
        `lora`: the LoRA adapter (a name of `lora_modules`) every prompt, or each, runs with."""
        if self._is_shut_down:
            raise RuntimeError("this LLM has been shut down; create a new one")
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        loras = [lora] * len(prompt_list) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} LoRA adapter names for {len(prompt_list)} prompts")
        self._warn_off_thread()
        ids = []
        for prompt, p, adapter in zip(prompt_list, param_list, loras, strict=True):
            # Only the final outputs are returned: none is built per token.
            p = p if p.final_only else dataclasses.replace(p, final_only=True)
            ids.append(self.engine.add_request(prompt, p, lora=adapter).request_id)
        results: dict[str, list[RequestOutput]] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished:
                if self.engine.is_waiting_on_preparation:  # a grammar compiles: do not spin
                    time.sleep(_PREPARATION_POLL_S)
                for out in self.engine.step():
                    if out.finished:
                        results.setdefault(out.request_id, []).append(out)
                    if out.ends_request:
                        bar.update(1)
        return [_with_outputs(results[i]) for i in ids]

    def _warn_off_thread(self) -> None:
        """Once, on CPU: generating on another thread than the one that built this LLM, while
        that one lives, makes every op of the forward pass wait for sleeping OpenMP workers
        (fastserve/executor/openmp.py)."""
        here = threading.current_thread()
        if (self._is_thread_warned or here is self._built_on or not self._built_on.is_alive()
                or not platform_for(self.config.model.device).runs_on_host_cores
                or has_released(self._built_on)):
            return
        self._is_thread_warned = True
        logger.warning(
            "LLM.generate runs on thread %r, not on %r, which built this LLM and still runs: "
            "its OpenMP workers slow every op here (a decode step 1.5x on 2 cores). Build the "
            "LLM on the thread that generates, or call "
            "fastserve.executor.openmp.release_thread_team() on %r once it is built.",
            here.name, self._built_on.name, self._built_on.name)


def _with_outputs(finals: list[RequestOutput]) -> RequestOutput:
    """Sequence 0's output, listing every sequence's in `outputs`."""
    finals.sort(key=lambda o: o.index)
    return dataclasses.replace(finals[0], outputs=finals)
