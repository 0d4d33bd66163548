"""TensorParallel: rank 0's handle on the worker's other ranks — it starts them (`python -m
worker.engine.parallel.follower`, one process each), joins their process group, watches them, and stops them.

    start-up   rank 0 checks the model can shard (before any process starts), starts ranks 1..N-1 with the
               same EngineConfig, and every rank loads its own shard at once (rendezvous: a FileStore in a
               private temporary directory, so no port is picked or raced for)
    serving    rank 0 sends each step through the StepChannel; a keep-alive covers idle spells
    a fault    a rank that exits on its own (killed, crashed) is seen at once by its watcher thread here, and
               one that hangs by the next collective's timeout: TpGroup.fatal takes the worker down (exit 3).
               The other ranks watch rank 0 the same way (their parent's pid, and their collectives)
    stop       close(): the STOP header, then each rank exits 0; one that does not within STOP_WAIT_S is killed
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict

import structlog
import torch

from worker.engine.config import EngineConfig
from worker.engine.parallel.group import TpGroup, take_down
from worker.engine.parallel.shard import TpShard
from worker.engine.parallel.step_channel import StepChannel

log = structlog.get_logger("tokenbus.tensor_parallel")
STOP_WAIT_S = 10.0


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the one asked for (cuda:2 with 2 ranks: cuda:2 and cuda:3)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(device: torch.device, size: int) -> None:
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {size} from {device} needs {(device.index or 0) + size} GPUs; "
                         f"this machine shows {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES, the compose "
                         "file's device reservation)")


def threads_per_rank(size: int) -> int:
    """The CPU's cores shared out between the ranks (OMP_NUM_THREADS, when set, wins)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    return max(1, (os.cpu_count() or 1) // size)


class TensorParallel:
    def __init__(self, cfg: EngineConfig, shard: TpShard, device: torch.device) -> None:
        size = cfg.tensor_parallel_size
        check_devices(device, size)
        self.threads_before = torch.get_num_threads()  # given back at close: the process may serve on alone
        torch.set_num_threads(threads_per_rank(size))
        self.directory = tempfile.mkdtemp(prefix="tokenbus-tp-")
        store = os.path.join(self.directory, "store")
        config = json.dumps(asdict(cfg))
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "worker.engine.parallel.follower", "--rank", str(rank),
                              "--store", store, "--parent", str(os.getpid()), "--config", config])
            for rank in range(1, size)
        ]
        self.closed = False
        atexit.register(self.close)
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-watch-{rank}", daemon=True).start()
        self.group = TpGroup(0, size, device, store, cfg.tensor_parallel_timeout_s)
        self.group.shard = shard
        self.group.peers = [p.pid for p in self.procs]
        self.channel = StepChannel(self.group)
        log.info("tensor_parallel_started", size=size, backend=self.group.backend,
                 threads_per_rank=torch.get_num_threads(), pids=[os.getpid(), *self.group.peers])

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.closed:  # before the group exists too: rank 0 would wait for it at the rendezvous
            take_down(f"rank {rank} (pid {proc.pid}) exited with code {code}", 0, [p.pid for p in self.procs])

    def start_serving(self) -> None:
        self.group.serving()
        self.channel.start_keepalive()

    def close(self) -> None:
        """Stop every other rank (they exit 0), then this rank's groups."""
        if self.closed:
            return
        self.closed = True
        if all(p.poll() is None for p in self.procs) and self.group.group_in_use is self.group.group:
            self.channel.stop()
        self._reap()

    def abort(self) -> None:
        """Start-up failed on this rank: the others are killed (they may be waiting in a collective)."""
        self.closed = True
        for proc in self.procs:
            proc.kill()
        self._reap()

    def _reap(self) -> None:
        for proc in self.procs:
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("tensor_parallel_rank_killed", pid=proc.pid, why=f"not stopped after {STOP_WAIT_S}s")
                proc.kill()
                proc.wait()
        self.group.close()
        torch.set_num_threads(self.threads_before)
        shutil.rmtree(self.directory, ignore_errors=True)
        atexit.unregister(self.close)
