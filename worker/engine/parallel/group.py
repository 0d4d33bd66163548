"""TpGroup: one rank's view of a tensor-parallel worker — its rank, the process groups and the collectives
the model runs (NCCL on CUDA, gloo on the CPU), each bounded by a timeout.

Two groups, made on every rank in the same order: start-up (loading, CUDA warm-up and graph capture, where
one rank may compile kernels for minutes while another waits) under a long timeout, serving under
tensor_parallel_timeout_s. A collective that fails or passes its timeout means a rank is gone or wedged: the
worker cannot compute any more, so `fatal` logs why, kills the other ranks and ends this process (exit 3);
jobs' leases then lapse and another worker reclaims them. No rank ever waits on a collective forever.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import structlog
import torch
import torch.distributed as dist

from worker.engine.parallel.shard import TpShard

log = structlog.get_logger("tokenbus.tensor_parallel")

STARTUP_TIMEOUT_S = 1800.0  # loading and CUDA warm-up: a slow rank compiling its kernels is not a fault
FAULT_EXIT_CODE = 3
PEER_EXIT_SEEN_S = 0.3  # how long a failed collective on rank 0 looks for a follower that ended
PEER_EXIT_REPORT_S = 2.0  # then how long it leaves the watcher to report that exit


class TpGroup:
    def __init__(self, rank: int, size: int, device: torch.device, store_path: str, timeout_s: float) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout_s = timeout_s
        self.shard: TpShard | None = None  # what this rank holds, set once the model's shape is known
        self.seconds: dict[str, float] = {}  # wall time in each kind of collective (the TP benchmark reads it)
        self.peers: list[int] = []  # pids of the other ranks, killed on a fault (rank 0: its followers)
        self.closing = False  # set when the worker stops them on purpose: their exits are no fault then
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds each rank to its current device
        store = dist.FileStore(store_path, size)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self.group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s),
                                    backend=self.backend)
        self.startup_group = self.group_in_use = dist.group.WORLD

    def serving(self) -> None:
        """From now on every collective runs under the serving timeout."""
        self.group_in_use = self.group

    # ---- the model's collectives ------------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """x summed (or op) over the ranks, in place: the partial outputs of a row-parallel linear."""
        self._guard(lambda: dist.all_reduce(x, op=op, group=self.group_in_use), "all_reduce")
        return x

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """The ranks' [rows, cols] slices side by side, cut to `width` columns (vocab-parallel logits; every
        rank's slice padded to the same cols). Every rank gets them; rank 0 is the one that samples."""
        rows, cols = x.shape
        if self.backend == "nccl":
            out = torch.empty(self.size, rows, cols, dtype=x.dtype, device=x.device)
            self._guard(lambda: dist.all_gather_into_tensor(out, x.contiguous(), group=self.group_in_use),
                        "all_gather")
            parts = list(out.unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self._guard(lambda: dist.all_gather(parts, x.contiguous(), group=self.group_in_use), "all_gather")
        return torch.cat(parts, dim=1)[:, :width]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        self._guard(lambda: dist.broadcast(x, 0, group=self.group_in_use), "broadcast")
        return x

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (the KV block count every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's value, in rank order (each rank's weight bytes, for the log)."""
        t = torch.zeros(self.size, dtype=torch.int64, device=self.device)
        t[self.rank] = value
        return [int(v) for v in self.all_reduce(t).tolist()]

    # ---- faults ---------------------------------------------------------------------------------------------

    def _guard(self, op: Callable[[], Any], what: str) -> None:
        started = time.perf_counter()
        try:
            op()
            self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - started
        except Exception as err:  # gloo and NCCL raise RuntimeError kinds for a lost or timed-out peer
            self.fatal(f"{what} failed: {str(err).splitlines()[0][:300] if str(err) else type(err).__name__}")

    def fatal(self, why: str) -> NoReturn:
        if self.rank == 0 and self.peers:
            # a follower killed outright breaks the collective as its process ends, a moment before rank 0's
            # watcher (launch.py) reaps it: let the watcher name the exit and its code, the plainer reason (a
            # follower that is stopped, not gone, costs this a fraction of a second)
            deadline = time.monotonic() + PEER_EXIT_SEEN_S
            while time.monotonic() < deadline and not any(map(_exited, self.peers)):
                time.sleep(0.02)
            if any(map(_exited, self.peers)):
                time.sleep(PEER_EXIT_REPORT_S)  # the watcher's take_down ends the process meanwhile
        take_down(why, self.rank, self.peers, size=self.size, timeout_s=self.timeout_s)

    def close(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # a group already broken: the process is ending anyway
            pass


def _exited(pid: int) -> bool:
    """Whether the process has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] == "Z"
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return True
    except OSError:
        return False
    try:  # no /proc here: whether the pid still exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False


def take_down(why: str, rank: int, peers: list[int], **context: Any) -> NoReturn:
    """A rank is gone or wedged: say so, kill the other ranks (a stopped one dies of SIGKILL too), exit 3."""
    log.error("tensor_parallel_fault", rank=rank, why=why, **context,
              action="stopping every rank of this worker; its jobs' leases lapse and another worker takes them")
    for pid in peers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FAULT_EXIT_CODE)
