"""Start-up shared by every rank, and the loop that ranks > 0 run.

Start-up (collective, every rank in this order): join the default group, create the control
group, receive the driver's `Init` (so every rank runs the driver's configuration, whatever its
own command line said), create the other groups, load this rank's shard, and agree that every
rank loaded. Then a worker carries out the driver's messages until `Stop`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from fastserve.config import EngineConfig, ModelConfig, ParallelConfig
from fastserve.executor.distributed.comm import (
    Groups,
    data_backend,
    isend_object,
    new_ctrl_group,
    new_groups,
    recv_object,
)
from fastserve.executor.distributed.heartbeat import Heartbeat
from fastserve.executor.distributed.layout import RankLayout
from fastserve.executor.distributed.messages import ClearLoRA, LoadLoRA, StatsRequest, Step, Stop
from fastserve.executor.distributed.stage import StageRunner, load_stage, rank_device
from fastserve.executor.platform import platform_for
from fastserve.logs import DATE_FORMAT
from fastserve.model.make_model import resolve_model_path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Init:
    """What the driver tells every rank at start-up."""

    config: EngineConfig
    num_layers: int
    eos_token_ids: list[int]  # the sampler masks them before min_tokens


def set_cpu_threads(config: EngineConfig, local_world_size: int) -> None:
    """CPU ranks on one machine share its cores: `num_threads` each if given, else an equal
    share (at least one)."""
    if platform_for(config.model.device).runs_on_host_cores:
        share = max(1, (os.cpu_count() or 1) // local_world_size)
        torch.set_num_threads(config.model.num_threads or share)


def init_default_group(config: EngineConfig, **kwargs: object) -> None:
    dist.init_process_group(
        data_backend(torch.device(config.model.device)),
        timeout=timedelta(seconds=config.parallel.worker_timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )


def join(rank: int, local_rank: int, init: Init | None) -> tuple[Init, RankLayout, Groups, StageRunner]:
    """Every rank's start-up after `init_process_group`; the driver passes `init`.

    Raises RuntimeError, on every rank, when any rank failed to load.
    """
    ctrl = new_ctrl_group()
    box: list[Init | None] = [init]
    dist.broadcast_object_list(box, src=0, group=ctrl)
    init = box[0]
    assert init is not None
    if platform_for(init.config.model.device).runs_on_host_cores and init.config.model.num_threads:
        torch.set_num_threads(init.config.model.num_threads)  # the driver's explicit setting
    p = init.config.parallel
    layout = RankLayout(rank, p.tensor_parallel_size, p.pipeline_parallel_size, init.num_layers)
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"{dist.get_world_size()} processes were started but tensor_parallel_size x "
            f"pipeline_parallel_size = {layout.world_size}"
        )
    device = torch.device(rank_device(init.config.model.device, local_rank))
    groups = new_groups(layout, data_backend(device), p.worker_timeout_s, ctrl)
    stage: StageRunner | None = None
    error: str | None = None
    try:
        # NOTE: each machine resolves the path itself (the tiny preset lives in its own cache).
        path = resolve_model_path(init.config.model.model)
        stage = load_stage(init.config, path, layout, local_rank, init.eos_token_ids, groups)
    except Exception as exc:  # reported to every rank below
        logger.exception("rank %d failed to load its shard", rank)
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    errors: list[str | None] = [None] * layout.world_size
    dist.all_gather_object(errors, error, group=ctrl)
    failed = [e for e in errors if e is not None]
    if failed:
        raise RuntimeError("distributed start-up failed: " + "; ".join(failed))
    assert stage is not None
    return init, layout, groups, stage


def serve(stage: StageRunner, groups: Groups) -> None:
    """Carry out the driver's messages, in order, until `Stop`."""
    while True:
        msg = recv_object(0, groups.ctrl)
        if isinstance(msg, Step):
            if stage.is_sampler:
                stage.sampler.grammars = msg.masks
            stage.execute(msg.plan)
        elif isinstance(msg, LoadLoRA | ClearLoRA):
            assert stage.lora is not None, "LoRA adapters sent to a rank started without LoRA"
            if isinstance(msg, LoadLoRA):
                stage.lora.load(msg.slot, msg.adapter)
            else:
                stage.lora.clear(msg.slot)
        elif isinstance(msg, StatsRequest):
            isend_object(stage.stats(msg.reset), 0, groups.ctrl).wait()
        elif isinstance(msg, Stop):
            return
        else:
            raise RuntimeError(f"unexpected message from the driver: {msg!r}")


def run_worker(rank: int, local_rank: int) -> None:
    """A worker's life after `init_process_group`; never returns (exit code 0 after `Stop`).

    NOTE: it ignores SIGINT and SIGTERM (a terminal's Ctrl-C, torchrun's agent passing on a
    SIGTERM): the driver drains its requests first and then says `Stop`; a driver that is gone
    instead is noticed by the heartbeat.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        init, layout, groups, stage = join(rank, local_rank, None)
        heartbeat = Heartbeat(groups.heartbeat, init.config.parallel.worker_timeout_s,
                              is_driver=False, on_failure=lambda reason: _exit(1))
        heartbeat.start()
        serve(stage, groups)
    except Exception:
        logger.exception("fastserve worker %d failed", rank)
        _exit(1)
    _exit(0)


def spawned_main(argv: list[str] | None = None) -> None:
    """Entry point of a worker the driver started on its own machine (`python -m
    fastserve.executor.distributed.worker ...`, see `launch.spawn_workers`)."""
    parser = argparse.ArgumentParser(description="a fastserve worker rank (started by the driver)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True, help="the driver's TCP store on 127.0.0.1")
    parser.add_argument("--device", required=True)
    parser.add_argument("--worker-timeout-s", type=float, required=True)
    args = parser.parse_args(argv)
    rank = args.rank
    logging.basicConfig(level=logging.INFO, datefmt=DATE_FORMAT,
                        format=f"%(asctime)s.%(msecs)03d %(levelname)s rank{rank} %(name)s: "
                               "%(message)s")
    # Only what joining needs; the rest of the configuration comes from the driver.
    config = EngineConfig(model=ModelConfig(device=args.device),
                          parallel=ParallelConfig(worker_timeout_s=args.worker_timeout_s))
    set_cpu_threads(config, args.world_size)
    store = dist.TCPStore("127.0.0.1", args.port, args.world_size, is_master=False,
                          timeout=timedelta(seconds=args.worker_timeout_s))
    store.set(f"fastserve/started/{rank}", "1")  # see launch.started_key
    init_default_group(config, store=store, rank=rank, world_size=args.world_size)
    run_worker(rank, local_rank=rank)


def _exit(code: int) -> None:
    """Leave at once: the heartbeat thread may still be inside a collective, and the process
    groups' destructors would wait for it."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    spawned_main()
