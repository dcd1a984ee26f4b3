"""Process groups, and the transport over them: pickled objects and tensors, torch.distributed
point-to-point only.

Groups (every rank creates all of them, in the same order):
- the default group (gloo on CPU, NCCL on CUDA), timeout `worker_timeout_s`: activations
  between stages and sampled tokens back to the driver;
- one tensor-parallel group per stage (same backend and timeout): the layers' all-reduces;
- `ctrl` (gloo, no practical timeout, since workers wait there while the engine is idle): plans
  from the driver, answers back, and (tag `TAG_EXTRAS`) what a pipeline's sampler rank
  computed beyond the tokens (log-probabilities, verified drafts) to the driver;
- `heartbeat` (gloo, `worker_timeout_s`): the monitored barrier of `heartbeat.Heartbeat`.

NOTE: a gloo send completes only once the receiver has posted the matching receive, so every
send here is an `isend` whose `Pending` handle the caller keeps (with its buffer) and waits on
once the receiver is known to have moved on. Messages between two ranks on one group and tag
arrive in the order they were sent.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from fastserve.executor.distributed.layout import RankLayout
from fastserve.executor.platform import platform_for

CTRL_TIMEOUT = timedelta(days=365)
TAG_ACTIVATIONS = 1
TAG_TOKENS = 2
TAG_EXTRAS = 3


@dataclass(frozen=True)
class Groups:
    """This rank's process groups (see the module docstring)."""

    tp: dist.ProcessGroup | None  # None when tp_size == 1: no collective is ever called
    ctrl: dist.ProcessGroup
    heartbeat: dist.ProcessGroup


def data_backend(device: torch.device) -> str:
    return platform_for(device).collective_backend


def new_ctrl_group() -> dist.ProcessGroup:
    """The control group; created first, right after the default group, by every rank."""
    group = dist.new_group(backend="gloo", timeout=CTRL_TIMEOUT)
    assert group is not None
    return group


def new_groups(layout: RankLayout, backend: str, timeout_s: float, ctrl: dist.ProcessGroup) -> Groups:
    """The tensor-parallel groups and the heartbeat group (collective: every rank calls it)."""
    timeout = timedelta(seconds=timeout_s)
    tp = None
    if layout.tp_size > 1:
        for stage in range(layout.pp_size):  # NOTE: every rank creates every stage's group
            group = dist.new_group(layout.stage_ranks(stage), timeout=timeout, backend=backend)
            if stage == layout.stage:
                tp = group
    heartbeat = dist.new_group(backend="gloo", timeout=timeout)
    assert heartbeat is not None
    return Groups(tp=tp, ctrl=ctrl, heartbeat=heartbeat)


@dataclass
class Pending:
    """Sends in progress and the buffers they read (kept alive until the sends complete)."""

    works: list[dist.Work] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)

    def add(self, other: Pending) -> None:
        self.works += other.works
        self.buffers += other.buffers

    def wait(self, timeout_s: float | None = None) -> None:
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        for work in self.works:
            if timeout is None:
                work.wait()
            else:
                work.wait(timeout)
        self.works, self.buffers = [], []


def isend_tensor(t: torch.Tensor, dst: int, tag: int, group: dist.ProcessGroup | None = None) -> Pending:
    work = dist.isend(t, dst, group=group, tag=tag)
    assert work is not None
    return Pending([work], [t])


def recv_tensor(t: torch.Tensor, src: int, tag: int, timeout_s: float | None = None,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Receive into `t` (whose shape the receiver knows from the plan)."""
    work = dist.irecv(t, src, group=group, tag=tag)
    assert work is not None
    if timeout_s is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=timeout_s))
    return t


def isend_object(obj: object, dst: int, group: dist.ProcessGroup, tag: int = 0) -> Pending:
    """Send a picklable object: its length, then its bytes."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.long)
    pending = isend_tensor(size, dst, tag, group)
    pending.add(isend_tensor(payload, dst, tag, group))
    return pending


def recv_object(src: int, group: dist.ProcessGroup, timeout_s: float | None = None,
                tag: int = 0) -> object:
    """The next object `src` sent on `group` with `tag`; without a timeout, the group's own
    applies."""
    size = recv_tensor(torch.empty(1, dtype=torch.long), src, tag, timeout_s, group)
    payload = recv_tensor(torch.empty(int(size.item()), dtype=torch.uint8), src, tag, timeout_s, group)
    return pickle.loads(payload.numpy().tobytes())
