"""Starting the ranks: spawned on this machine, or started by `torchrun` on one or more.

- Spawned (`fastserve serve --tensor-parallel-size 2`, `LLM(tensor_parallel_size=2)`): the
  driver opens a TCP store on 127.0.0.1 and starts ranks 1..W-1 as child processes.
- torchrun: every process runs the same command; rank 0 runs it (the server, `generate`),
  the others enter the worker loop (`run_torchrun_worker`, called by the CLI), and all join
  through torchrun's env:// rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fastserve.args import engine_config_from_args
from fastserve.config import EngineConfig
from fastserve.executor.device_choice import choose_device
from fastserve.executor.distributed.env import (
    env_local_rank,
    env_local_world_size,
    env_rank,
    env_world_size,
    launched_by_torchrun,
)
from fastserve.executor.distributed.executor import DistributedExecutor
from fastserve.executor.distributed.stage import check_parallel
from fastserve.executor.distributed.worker import (
    Init,
    init_default_group,
    join,
    run_worker,
    set_cpu_threads,
)
from fastserve.logs import DATE_FORMAT
from fastserve.model.loader import read_arch_config
from fastserve.openmp_env import openmp_defaults

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 120.0  # for spawned workers to start Python and import torch


def start_executor(config: EngineConfig, model_path: Path, eos_token_ids: list[int]) -> DistributedExecutor:
    """Start (or, under torchrun, join) the other ranks and return rank 0's executor."""
    p = config.parallel
    world_size = p.tensor_parallel_size * p.pipeline_parallel_size
    arch = read_arch_config(model_path)
    check_parallel(arch, p.tensor_parallel_size, p.pipeline_parallel_size)
    if dist.is_initialized():
        raise ValueError("a distributed engine is already running in this process; shut it down first")
    processes: list[subprocess.Popen[bytes]] = []
    threads = torch.get_num_threads()  # given back at shutdown: this is the caller's process
    if launched_by_torchrun():
        local_rank = env_local_rank()
        _check_torchrun(world_size)
        set_cpu_threads(config, env_local_world_size())
        init_default_group(config, init_method="env://")
    else:
        local_rank = 0
        set_cpu_threads(config, world_size)
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=p.worker_timeout_s))
        processes = spawn_workers(config, world_size, store.port)
        try:
            _wait_started(store, processes, max(STARTUP_TIMEOUT_S, p.worker_timeout_s))
            init_default_group(config, store=store, rank=0, world_size=world_size)
        except BaseException:
            _kill(processes)
            torch.set_num_threads(threads)
            raise
    try:
        init, layout, groups, stage = join(0, local_rank, Init(config, arch.num_hidden_layers, eos_token_ids))
    except BaseException:
        _kill(processes)
        dist.destroy_process_group()
        torch.set_num_threads(threads)
        raise
    return DistributedExecutor(init, layout, groups, stage, processes, threads)


def spawn_workers(config: EngineConfig, world_size: int, port: int) -> list[subprocess.Popen[bytes]]:
    """Ranks 1..world_size-1 on this machine, as `python -m` processes.

    NOTE: fresh interpreters rather than multiprocessing's spawn, which re-runs the parent's
    main script: a user's script would need an `if __name__ == "__main__":` guard.
    """
    env = dict(os.environ)
    # The parent's import path, so the child finds fastserve however the parent did.
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    # OpenMP's short spin, read by a worker's libgomp as it starts (fastserve/openmp_env.py).
    env.update(openmp_defaults(env))
    return [
        subprocess.Popen(
            [sys.executable, "-m", "fastserve.executor.distributed.worker",
             "--rank", str(rank), "--world-size", str(world_size), "--port", str(port),
             "--device", config.model.device,
             "--worker-timeout-s", str(config.parallel.worker_timeout_s)],
            env=env,
            start_new_session=True,  # the driver decides when they end, not the terminal
        )
        for rank in range(1, world_size)
    ]


def started_key(rank: int) -> str:
    """What a spawned worker sets in the driver's store once it runs (before joining)."""
    return f"fastserve/started/{rank}"


def _wait_started(store: dist.Store, processes: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """Wait for every spawned worker to be up, failing at once if one exits (a bad install,
    a broken import) rather than after the rendezvous timeout."""
    keys = [started_key(rank) for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys):
        for rank, proc in enumerate(processes, start=1):
            if proc.poll() is not None:
                raise RuntimeError(
                    f"worker rank {rank} exited with code {proc.returncode} while starting "
                    "(its output is above)"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"the worker processes did not start within {timeout_s:g} s")
        time.sleep(0.05)


def _kill(processes: list[subprocess.Popen[bytes]]) -> None:
    for proc in processes:
        proc.kill()
        proc.wait()


def run_torchrun_worker(args: argparse.Namespace) -> int:
    """Rank > 0 of a torchrun launch: serve rank 0's plans until it stops (never returns)."""
    config = engine_config_from_args(args)  # for the backend and timeout; the rest comes from rank 0
    device = choose_device(config.model.device, torch.cuda.is_available())  # as rank 0 resolves it
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, device=device))
    rank = env_rank()
    logging.basicConfig(level=logging.INFO, datefmt=DATE_FORMAT,
                        format=f"%(asctime)s.%(msecs)03d %(levelname)s rank{rank} %(name)s: "
                               "%(message)s")
    _check_torchrun(config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size)
    set_cpu_threads(config, env_local_world_size())
    init_default_group(config, init_method="env://")
    run_worker(rank, env_local_rank())
    return 0  # unreachable: run_worker exits the process


def _check_torchrun(world_size: int) -> None:
    launched = dist.get_world_size() if dist.is_initialized() else env_world_size()
    if launched != world_size:
        raise ValueError(
            f"torchrun started {launched} processes in all but tensor_parallel_size x "
            f"pipeline_parallel_size = {world_size}; give --nnodes x --nproc-per-node = {world_size}"
        )
