"""What happens to KV cache when device blocks run short: one class per `--kv-policy`.

Preemptive scheduling keeps many started jobs alive, each holding KV cache. When an allocation
fails the scheduler asks its KV policy to `make_room` from the started jobs less urgent than
the requester (the victims); after the batch is chosen the policy may move KV ahead of need
(`plan_ahead`). Victims always go in the same order: the largest estimated next scheduled time
(ENST, see `Scheduler.estimate_next_run_s`) first.

- `defer`: no host memory. A new (or swapped) job waits for free blocks; a started job that
  cannot grow takes the blocks of a victim, whose KV is dropped and recomputed later (without
  that the engine could deadlock).
- `recompute`: vLLM's default. Any allocation, a new job's included, drops a victim's KV for
  recompute: a new urgent job is never blocked by less urgent started ones.
- `reactive`: offload a victim to host memory only when an allocation fails; it is uploaded
  again when it is next in the batch (the iteration waits for that copy).
- `proactive` (FastServe): after each batch is chosen keep at least max(K, burst prediction)
  device blocks free by offloading the largest-ENST jobs, and upload the smallest-ENST swapped
  jobs ahead of their turn whenever space allows (offloading jobs that will run later than
  them if need be), so that the copies overlap compute; a job whose KV is not on the device
  when its turn comes runs from the next iteration instead of stalling this one. Only the jobs
  the device should hold (`ProactivePolicy._wanted`) are uploaded or make room: without that
  rule the jobs queued behind a full device were uploaded into every free block and pushed out
  again the next iteration (a CPU-profile run moved 13x the blocks reactive did, and lost).
  Where copies cannot overlap compute (`CostModel.copies_overlap` false: a CPU with no idle
  core, where the engine copies before the iteration on the compute's cores), a copy costs the
  iteration its time whenever it is made, so moving ahead of need buys nothing: proactive
  then does what `defer` does, except where a move costs less (see `ProactivePolicy`).

Host memory full: offloading fails and the scheduler back-pressures: new and swapped jobs wait,
and only a started job that cannot grow falls back to recomputing a victim. No job is lost.

Pure Python over ints and floats, like the rest of `fastserve.core`; `now` is passed in.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import Collection, Iterable, Sequence
from typing import ClassVar, Protocol

from fastserve.config import SchedulerConfig
from fastserve.core.cost_model import CostModel
from fastserve.core.kv.manager import KVLocation
from fastserve.core.kv.moves import KVMoves
from fastserve.request import Request


class Tiers(Protocol):
    """What a KV policy may read of the device and host pools (it moves KV only through
    `KVMoves`)."""

    @property
    def block_size(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_free_soon(self) -> int: ...  # once this iteration's offloads are copied out

    @property
    def num_total_host_blocks(self) -> int: ...

    @property
    def num_swapped(self) -> int: ...  # jobs whose KV is on the host

    @property
    def num_cached_host_blocks(self) -> int: ...  # the prefix cache's host tier

    def where(self, request_id: str) -> KVLocation | None: ...

    def has_blocks(self, request_id: str) -> bool: ...  # its KV is on the device

    def is_swapped(self, request_id: str) -> bool: ...

    def swapped_ids(self) -> Iterable[str]: ...

    def block_table(self, request_id: str) -> list[int]: ...

    def host_table(self, request_id: str) -> list[int]: ...

    def num_new_blocks(self, request_id: str, num_tokens: int) -> int: ...


class SchedulerView(Protocol):
    """What a KV policy sees: the scheduler's order and estimates, read-only; the pools,
    read-only (`kv`); and the moves it may make (`moves`)."""

    @property
    def config(self) -> SchedulerConfig: ...

    @property
    def cost(self) -> CostModel: ...  # what an iteration and a copy cost

    @property
    def kv(self) -> Tiers: ...  # where each job's KV is

    @property
    def moves(self) -> KVMoves: ...  # every move a policy makes

    @property
    def order(self) -> Sequence[Request]: ...  # this iteration's, most urgent first

    # (place in `order`, job) of the jobs whose KV was on the device when the walk began.
    def resident(self) -> list[tuple[int, Request]]: ...

    def next_run_s(self, req: Request) -> float: ...  # ENST: seconds from now to its next turn

    def admit_tokens(self, req: Request) -> int: ...  # tokens of KV the job needs to start

    def level_of(self, request_id: str) -> int | None: ...  # its queue, 0 = the most urgent

    def num_in_top_queues(self, num_queues: int) -> int: ...  # jobs in the top queues


class KVPolicy(ABC):
    """Decides whose KV gives way when device blocks run short."""

    name: ClassVar[str]
    # Whether it offloads to host memory (the host pool is sized only for those that do).
    uses_host: ClassVar[bool] = False

    def make_room(
        self, sched: SchedulerView, requester: Request, victims: Sequence[Request], now: float
    ) -> bool:
        """An allocation for `requester` failed: free device blocks from `victims` (started,
        resident, less urgent than it, outside the batch). False when nothing was freed: the
        requester waits (or, a started job that cannot grow, gives up its own KV)."""
        raise NotImplementedError

    def begin(self, sched: SchedulerView, now: float) -> None:
        """A new iteration's planning starts."""

    def defer_turn(self, sched: SchedulerView, req: Request, batch_size: int,
                   start: int) -> bool:
        """A job's turn has come but its KV is not on the device (swapped, or a new job whose
        blocks are not free): True defers it to the next iteration, having made its room (and
        queued its upload) from the jobs at place `start` on, so that the copies overlap this
        iteration's compute rather than stall it. Default: False, the scheduler makes room
        now."""
        return False

    def passable(self, sched: SchedulerView) -> Collection[str]:
        """Started jobs that cannot run this iteration once the batch holds a job, and whose
        turn in the walk would do nothing: the scheduler passes them without a look.
        Default: none."""
        return ()

    def is_landing(self, sched: SchedulerView, req: Request, batch_size: int,
                   start: int) -> bool:
        """Whether a resident job should sit this iteration out because its upload is still
        in flight (the iteration would wait for it), and a job from place `start` on could run
        instead. Default: no."""
        return False

    def give_up(self, sched: SchedulerView, req: Request) -> None:
        """A started job cannot grow and nothing less urgent gives way: it gives up its own
        device blocks. Default: drop its KV for recompute."""
        sched.moves.recompute(req)

    def plan_ahead(self, sched: SchedulerView, order: Sequence[Request], batch: Sequence[Request],
                   now: float) -> None:
        """After the batch is chosen: move KV ahead of need. Default: nothing."""



def latest(sched: SchedulerView, victims: Sequence[Request]) -> Request | None:
    """The victim expected to run last: largest ENST, the later in the order on a tie."""
    if not victims:
        return None
    best = len(victims) - 1
    best_s = sched.next_run_s(victims[best])
    for i in range(len(victims) - 2, -1, -1):
        t = sched.next_run_s(victims[i])
        if t > best_s:
            best, best_s = i, t
    return victims[best]


class RecomputePolicy(KVPolicy):
    """Drop the victim's KV; it prefills again when it next runs (vLLM today)."""

    name = "recompute"

    def make_room(
        self, sched: SchedulerView, requester: Request, victims: Sequence[Request], now: float
    ) -> bool:
        victim = latest(sched, victims)
        if victim is None:
            return False
        sched.moves.recompute(victim)
        return True


class DeferPolicy(RecomputePolicy):
    """No host memory: new jobs wait for free blocks; only a started job that cannot grow
    takes blocks from others, by recomputing the latest victim."""

    name = "defer"

    def make_room(
        self, sched: SchedulerView, requester: Request, victims: Sequence[Request], now: float
    ) -> bool:
        if not sched.kv.has_blocks(requester.request_id):
            return False
        return super().make_room(sched, requester, victims, now)


class ReactivePolicy(KVPolicy):
    """Offload the victim to host memory, only when an allocation fails."""

    name = "reactive"
    uses_host = True

    def make_room(
        self, sched: SchedulerView, requester: Request, victims: Sequence[Request], now: float
    ) -> bool:
        victim = latest(sched, victims)
        if victim is None:
            return False
        if sched.moves.offload(victim):
            return True
        # Host memory is full too: back-pressure. A started job must still be able to grow
        # (or nothing would ever finish), so it takes the victim's blocks by recompute.
        if sched.kv.has_blocks(requester.request_id):
            sched.moves.recompute(victim)
            return True
        return False

    def give_up(self, sched: SchedulerView, req: Request) -> None:
        """Keep its work: offload it, unless it just came back or host memory is full."""
        if not (sched.moves.can_offload(req) and sched.moves.offload(req)):
            sched.moves.recompute(req)
