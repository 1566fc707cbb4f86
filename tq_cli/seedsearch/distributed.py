"""Ranks for work split over processes: `torchrun` (gloo or nccl; `tq_cli.parallel`), or
local `--jobs N`.

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment) the process group
is initialised from the environment. `--jobs N` starts N-1 local children with the
spawn method; the calling process is rank 0, so progress and errors stay in the
terminal the user launched from. Both use gloo on CPU, which needs no GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from typing import Any

import torch

from tq_cli.parallel import Comm, init_process_group, torchrun_comm

__all__ = ["Comm", "run_local", "torchrun_comm"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _init(rank: int, world: int, port: int) -> Comm:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                       world_size=world)
    return Comm(rank, world)


def _child(rank: int, world: int, port: int, fn: Callable[..., Any],
           args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    comm = _init(rank, world, port)
    try:
        fn(*args, comm=comm)
    finally:
        dist.destroy_process_group()


def run_local(fn: Callable[..., Any], args: tuple[Any, ...], jobs: int,
              progress: Callable[..., None] | None = None) -> Any:
    """Run fn(*args, comm=...) on `jobs` local ranks; returns rank 0's result."""
    import torch.distributed as dist

    if jobs <= 1:
        return fn(*args, comm=Comm(), progress=progress)
    port = _free_port()
    ctx = multiprocessing.get_context("spawn")
    children = [ctx.Process(target=_child, args=(r, jobs, port, fn, args), daemon=True)
                for r in range(1, jobs)]
    for c in children:
        c.start()
    try:
        comm = _init(0, jobs, port)
        result = fn(*args, comm=comm, progress=progress)
        dist.destroy_process_group()
    finally:
        for c in children:
            c.join(timeout=60)
            if c.is_alive():
                c.terminate()
    failed = [c.exitcode for c in children if c.exitcode]
    if failed:
        from tq_cli.errors import TqError

        raise TqError(f"{len(failed)} of {jobs - 1} worker processes failed (exit {failed[0]});"
                      " rerun: finished scores are kept in the log")
    return result
