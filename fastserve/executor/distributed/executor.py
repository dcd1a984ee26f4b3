"""The driver's executor (rank 0): the engine's side of the distributed ranks.

`execute(plan)` runs one iteration through every rank (the `Executor` protocol). For pipeline
parallelism, `submit(plan)` / `collect()` keep several batches in flight (the
`PipelinedExecutor` protocol): `submit` sends the plan to every other rank and computes stage
0's share here, handing the activations to stage 1 without waiting for them to be taken;
`collect` waits for the oldest batch's tokens from the sampler rank (tensor-parallel rank 0 of
the last stage). Stages take batches in submission order, so while stage 1 works on batch k
the driver is already computing batch k+1.

Any failure (a collective erroring or timing out, the heartbeat, a spawned worker exiting) is
fatal: the ranks may have diverged, so the executor marks itself dead and every later call
raises `ExecutorDeadError`.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import subprocess
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastserve.core.plan import ExecutorOutput, SchedulerOutput
from fastserve.executor.base import ExecutorDeadError, PipelineResult
from fastserve.executor.distributed.comm import (
    TAG_EXTRAS,
    TAG_TOKENS,
    Groups,
    Pending,
    isend_object,
    recv_object,
    recv_tensor,
)
from fastserve.executor.distributed.heartbeat import Heartbeat
from fastserve.executor.distributed.layout import RankLayout
from fastserve.executor.distributed.messages import (
    ClearLoRA,
    LoadLoRA,
    RankStats,
    SamplerExtras,
    StatsRequest,
    Step,
    Stop,
)
from fastserve.executor.distributed.stage import StageRunner, pool_sizes
from fastserve.executor.distributed.worker import Init
from fastserve.executor.grammar import GrammarMasks, StructuredOutputs
from fastserve.executor.model_runner import Launched
from fastserve.model.lora import Adapter

logger = logging.getLogger(__name__)

STOP_WAIT_S = 10.0  # how long shutdown waits for workers to take `Stop` and exit
FAILURE_CAUSE_WAIT_S = 2.0  # how long a failed call waits for the heartbeat to name the cause


def _for_workers(plan: SchedulerOutput) -> SchedulerOutput:
    """The plan as the workers get it: without the offline logits processors, which need not
    pickle and run only where the driver samples (the engine refuses them otherwise)."""
    if not any(s.params.logits_processors for s in plan.scheduled):
        return plan
    scheduled = [dataclasses.replace(s, params=dataclasses.replace(s.params, logits_processors=()))
                 if s.params.logits_processors else s for s in plan.scheduled]
    return dataclasses.replace(plan, scheduled=scheduled)


@dataclass(frozen=True)
class _Batch:
    seq: int  # submission number: sends up to it have landed once its tokens are back
    plan: SchedulerOutput
    start_s: float
    local: ExecutorOutput  # the driver's own share (the tokens, when it samples)


@dataclass(frozen=True)
class _Launch:
    seq: int  # submission number, as `_Batch.seq`
    local: Launched  # the driver's share, its tokens not read back yet


class DistributedExecutor:
    """Rank 0's executor over `tensor_parallel_size x pipeline_parallel_size` ranks."""

    def __init__(
        self,
        init: Init,
        layout: RankLayout,
        groups: Groups,
        stage: StageRunner,
        processes: Sequence[subprocess.Popen[bytes]] = (),
        caller_threads: int | None = None,
    ) -> None:
        """`processes`: the workers this process started (none under torchrun);
        `caller_threads`: the torch thread count to give back at shutdown."""
        self.layout = layout
        self.groups = groups
        self.stage = stage
        self.arch = stage.full_arch
        sizes = pool_sizes(init.config, self.arch)
        self.num_blocks = sizes.num_device_blocks
        self.num_host_blocks = sizes.num_host_blocks
        self.block_bytes = sizes.block_bytes
        self.max_in_flight = layout.pp_size  # one batch per stage
        self.timeout_s = init.config.parallel.worker_timeout_s
        self.processes = {rank: p for rank, p in enumerate(processes, start=1)}  # spawned here
        self.dead_reason: str | None = None
        self._in_flight: deque[_Batch] = deque()
        self._sends: deque[tuple[int, Pending]] = deque()  # plans on their way, by submission
        self._seq = 0
        self._closed = False
        self._caller_threads = caller_threads
        # The engine's structured requests' grammars, which a pipeline's driver fills masks
        # from for its sampler rank (`_send`); the driver's own sampler reads them itself.
        self.grammars: StructuredOutputs | None = None
        # What runs, as chosen at start-up (the ranks' own choices are not gathered yet).
        self.info = {"device": init.config.model.device.split(":")[0],
                     "dtype": init.config.model.dtype}
        self.heartbeat = Heartbeat(groups.heartbeat, self.timeout_s, is_driver=True,
                                   on_failure=self._on_failure, processes=self.processes)
        self.heartbeat.start()
        atexit.register(self.shutdown)  # workers exit with the driver even if nobody asks

    # -- the Executor and PipelinedExecutor protocols -------------------------------------

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        """One iteration through every stage, waited for."""
        self.submit(plan)
        if plan.is_empty:
            return ExecutorOutput(sampled_token_ids=[], duration_s=0.0)
        return self.collect().out

    def submit(self, plan: SchedulerOutput, now: float = 0.0) -> None:
        """Send the plan to every rank and compute stage 0's share. A plan with no batch (only
        swaps and finished ids) completes here and is not collected."""
        if plan.is_empty and not (plan.swap_out or plan.swap_in or plan.finished_ids):
            return  # nothing for any rank to do
        with self._fatal():
            start_s = time.perf_counter()
            seq, masks = self._send(plan)
            local = self.stage.execute(plan)
            if not plan.is_empty:
                # The sampler rank sends FAILED_TOKEN for a failed grammar; why, the driver knows.
                if masks is not None and masks.failed:
                    local = dataclasses.replace(local, failed={**local.failed, **masks.failed})
                self._in_flight.append(_Batch(seq, plan, start_s, local))

    def collect(self, now: float = 0.0) -> PipelineResult:
        """The oldest batch in flight: its tokens, and how long the driver waited for them."""
        with self._fatal():
            batch = self._in_flight.popleft()
            wait_start_s = time.perf_counter()
            local = batch.local
            tokens = local.sampled_token_ids
            extras = SamplerExtras.of(local)  # the driver's own, when it samples
            sampler = self.layout.sampler_rank
            if not self.layout.is_sampler:
                # The tokens, then a flag: whether `SamplerExtras` follow (`StageRunner._emit`).
                buf = torch.empty(len(batch.plan.scheduled) + 1, dtype=torch.long,
                                  device=self.stage.device)
                *tokens, ships = recv_tensor(buf, sampler, TAG_TOKENS, self.timeout_s).tolist()
                if ships:
                    got = recv_object(sampler, self.groups.ctrl, self.timeout_s, TAG_EXTRAS)
                    assert isinstance(got, SamplerExtras)
                    extras = dataclasses.replace(got, failed={**local.failed, **got.failed})
            end_s = time.perf_counter()
            self._sent(batch.seq)
            out = ExecutorOutput(tokens, end_s - batch.start_s, local.swap_wait_s, extras.failed,
                                 sample_logprobs=extras.sample_logprobs,
                                 prompt_logprobs=extras.prompt_logprobs,
                                 verified_token_ids=extras.verified_token_ids,
                                 verified_logprobs=extras.verified_logprobs)
            return PipelineResult(out, end_s - wait_start_s)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # -- the AsyncExecutor protocol (one pipeline stage) ------------------------------------

    def launch(self, plan: SchedulerOutput) -> _Launch:
        """Send the plan to every rank and start the driver's share, without reading its
        tokens back: async scheduling launches the next plan first. A decode fed a pending
        token gets it from the driver, which drew it (`StageRunner._pending_tokens`)."""
        if self.layout.pp_size > 1:
            raise RuntimeError("launch/finish are for one stage: a pipeline uses submit/collect")
        with self._fatal():
            seq, _ = self._send(plan)  # (one stage: the driver samples, with the grammars)
            return _Launch(seq, self.stage.launch(plan))

    def draw(self, launched: _Launch) -> _Launch:
        """The driver samples a launched plan that waited for its grammars (one stage: its
        peers sample nothing)."""
        with self._fatal():
            return dataclasses.replace(launched, local=self.stage.draw(launched.local))

    def finish(self, launched: _Launch) -> ExecutorOutput:
        """The launched plan's tokens (the driver samples them)."""
        with self._fatal():
            out = self.stage.finish(launched.local)
            self._sent(launched.seq)
            return out

    def _send(self, plan: SchedulerOutput) -> tuple[int, GrammarMasks | None]:
        """Post the plan to every other rank (stage 0's peers first: they start now); returns
        its submission number, and the grammar masks sent to a sampler rank elsewhere."""
        self._seq += 1
        step = Step(_for_workers(plan))
        masks = None
        to_sampler: dict[int, object] = {}
        if not self.layout.is_sampler and self.grammars is not None and len(self.grammars):
            # NOTE: a request's grammar has taken its previous token: a pipeline schedules a
            # request again only once that batch is back.
            masks = self.grammars.fill([s for s in plan.scheduled if s.samples], copy=True)
            to_sampler[self.layout.sampler_rank] = dataclasses.replace(step, masks=masks)
        self._post(step, self._seq, to_sampler)
        return self._seq, masks

    def _post(self, msg: object, seq: int, instead: dict[int, object] | None = None) -> None:
        """Post `msg` (or `instead[rank]`) to every other rank; its sends are waited for once
        batch `seq` is back (the workers took it by then: they take messages in order)."""
        pending = Pending()
        for rank in range(1, self.layout.world_size):
            pending.add(isend_object((instead or {}).get(rank, msg), rank, self.groups.ctrl))
        self._sends.append((seq, pending))

    # -- LoRA adapters (`LoRAAdapters.weights`) ---------------------------------------------

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put the adapter in `slot` on every rank: here, then on the workers, which load
        their shards before the next plan (the control channel keeps the order)."""
        self.check_health()
        assert self.stage.lora is not None, "LoRA is off"
        self.stage.lora.load(slot, adapter)  # NOTE: a failure here has sent nothing yet
        with self._fatal():
            self._post(LoadLoRA(slot, adapter), self._seq + 1)

    def clear(self, slot: int) -> None:
        self.check_health()
        assert self.stage.lora is not None, "LoRA is off"
        self.stage.lora.clear(slot)
        with self._fatal():
            self._post(ClearLoRA(slot), self._seq + 1)

    def _sent(self, seq: int) -> None:
        """Wait for the sends of the plans up to `seq`: taken, since its batch is through."""
        while self._sends and self._sends[0][0] <= seq:
            self._sends.popleft()[1].wait(self.timeout_s)

    # -- what the engine asks besides plans (`fastserve.engine.builder.EngineExecutor`) ------

    @property
    def is_sampler(self) -> bool:
        """Whether this process samples (a pipeline's last stage samples on another rank)."""
        return self.layout.is_sampler

    @property
    def copies_overlap_compute(self) -> bool | None:
        """Not known here: each rank copies its own shards (the profile's setting stands)."""
        return None

    def use_grammars(self, grammars: StructuredOutputs) -> None:
        """Mask structured requests' tokens with `grammars`: this process's sampler does, or
        (a pipeline's driver) the masks it fills and sends to the rank that samples."""
        if self.stage.is_sampler:
            self.stage.use_grammars(grammars)
        else:
            self.grammars = grammars

    # -- health, stats, shutdown ----------------------------------------------------------

    def check_health(self) -> None:
        """Raise `ExecutorDeadError` once a rank has failed or stopped answering."""
        if self.dead_reason is not None:
            raise ExecutorDeadError(self.dead_reason)

    def rank_stats(self, reset: bool = False) -> list[RankStats]:
        """Every rank's busy time since the last reset (waits for batches in flight first)."""
        with self._fatal():
            if self._in_flight:
                raise RuntimeError("collect the batches in flight before asking for stats")
            stats = [self.stage.stats(reset)]
            for rank in range(1, self.layout.world_size):
                isend_object(StatsRequest(reset), rank, self.groups.ctrl).wait(self.timeout_s)
                reply = recv_object(rank, self.groups.ctrl, self.timeout_s)
                assert isinstance(reply, RankStats)
                stats.append(reply)
            return stats

    def shutdown(self) -> None:
        """Stop the workers and leave the process groups; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)  # the registry would hold this executor, its KV pool too
        if self.dead_reason is None:
            try:
                while self._in_flight:  # their last sends wait for the driver to take them
                    self.collect()
            except ExecutorDeadError:
                pass
        self.heartbeat.stop()
        if self.dead_reason is None:
            try:
                stops = Pending()  # all posted before any is waited on: workers leave at once
                for rank in range(1, self.layout.world_size):
                    stops.add(isend_object(Stop(), rank, self.groups.ctrl))
                stops.wait(STOP_WAIT_S)
            except Exception as exc:  # a worker already gone: it is reaped below
                logger.warning("fastserve: could not stop every worker: %s", exc)
        self._reap_processes()
        self.stage.close()
        dist.destroy_process_group()
        if self._caller_threads is not None:
            torch.set_num_threads(self._caller_threads)

    # -- failures ---------------------------------------------------------------------------

    @contextmanager
    def _fatal(self) -> Iterator[None]:
        self.check_health()
        try:
            yield
        except ExecutorDeadError:
            raise
        except Exception as exc:
            # The heartbeat usually names the cause (which rank, its exit code) a moment later.
            cause = self.heartbeat.wait_failure(FAILURE_CAUSE_WAIT_S)
            self.heartbeat.stop()
            self._on_failure(cause or f"{type(exc).__name__}: {exc}")
            assert self.dead_reason is not None
            raise ExecutorDeadError(self.dead_reason) from exc

    def _on_failure(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = f"a distributed rank failed: {reason}"
            logger.error("fastserve: %s", self.dead_reason)
        # Spawned workers would only wait for their own timeouts (or, stopped, forever): end
        # them now. They hold nothing that needs a graceful exit.
        for p in self.processes.values():
            if p.poll() is None:
                p.kill()

    def _reap_processes(self) -> None:
        deadline = time.monotonic() + STOP_WAIT_S
        for rank, p in self.processes.items():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("fastserve: worker rank %d did not exit; killing it", rank)
                p.kill()
                p.wait()
