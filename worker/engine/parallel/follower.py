"""A follower rank of a tensor-parallel worker (`python -m worker.engine.parallel.follower`, started by
launch.py): load this rank's shard through the same start-up as rank 0 (model_setup.py), then run every step
rank 0 sends until it says stop.

A follower serves no jobs and holds no scheduler: SIGTERM and SIGINT are ignored (rank 0 drains the jobs and
then stops its followers), and it exits at once when rank 0 is gone (its parent pid changes; its collectives
fail too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import structlog
import torch

from protocol.logs import configure_logging
from worker.engine import model_setup
from worker.engine.config import EngineConfig
from worker.engine.parallel.group import TpGroup, take_down
from worker.engine.parallel.launch import rank_device, threads_per_rank
from worker.engine.parallel.shard import TpShard
from worker.engine.parallel.step_channel import STEP, STOP, StepChannel

log = structlog.get_logger("tokenbus.tensor_parallel")
PARENT_POLL_S = 0.5


def _watch_parent(parent: int, rank: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            take_down(f"rank 0 (pid {parent}) is gone", rank, [])


def serve(cfg: EngineConfig, rank: int, store: str, parent: int) -> int:
    size = cfg.tensor_parallel_size
    torch.set_num_threads(threads_per_rank(size))
    device = rank_device(model_setup.resolve_device(cfg.device), rank)
    spec = model_setup.resolve(cfg, device)
    tp = TpGroup(rank, size, device, store, cfg.tensor_parallel_timeout_s)
    tp.shard = TpShard.of(spec.arch, rank, size)
    tp.peers = [parent]  # a follower that finds a collective broken takes rank 0 down with it
    setup = model_setup.set_up(cfg, device, spec, tp)
    runner = model_setup.make_runner(setup, cfg, device, spec.max_model_len)
    tp.gather_ints(setup.weight_bytes)
    tp.serving()
    log.info("tensor_parallel_rank_ready", rank=rank, device=str(device), weight_bytes=setup.weight_bytes,
             kv_blocks=setup.num_blocks, threads=torch.get_num_threads())
    channel = StepChannel(tp)
    while True:
        op, step, num_samples = channel.receive()
        if op == STOP:
            break
        if op == STEP:
            runner.follow(step, num_samples)
    log.info("tensor_parallel_rank_stopped", rank=rank)
    tp.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.engine.parallel.follower")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True, help="the FileStore path rank 0 made")
    parser.add_argument("--parent", type=int, required=True, help="rank 0's pid")
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    args = parser.parse_args(argv)
    configure_logging(os.environ.get("TOKENBUS_LOG_LEVEL", "info"),
                      {"true": True, "false": False}.get(os.environ.get("TOKENBUS_LOG_JSON", "").lower()))
    structlog.contextvars.bind_contextvars(tp_rank=args.rank)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(args.parent, args.rank), name="tp-parent", daemon=True).start()
    return serve(EngineConfig(**json.loads(args.config)), args.rank, args.store, args.parent)


if __name__ == "__main__":
    sys.exit(main())
