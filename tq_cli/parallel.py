"""The ranks of one job under torchrun (torch.distributed), shared by the workflows that
split work over processes: `convert` and `calibrate` (calibration tokens and per-tensor
fits) and `search-seed` (tensors).

Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment) the process group
is initialised from the environment: gloo (the collectives move CPU tensors and objects),
with nccl beside it for CUDA tensors when TQ_DIST_BACKEND=nccl; each local rank uses
the GPU of its LOCAL_RANK.
Multi-node is torchrun's own rendezvous (`--nnodes`, `--rdzv-endpoint`); nothing here
knows about nodes.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch

TIMEOUT = datetime.timedelta(hours=12)  # a rank may be busy with a large tensor a long time


@dataclass(frozen=True)
class Comm:
    """The ranks sharing one job. The single-process default is trivial: every collective
    returns its input."""

    rank: int = 0
    world: int = 1

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (a CPU tensor on gloo)."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def share(self, n: int) -> slice:
        """This rank's contiguous share of n items (the first n % world ranks get one more)."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (1 if self.rank < extra else 0))


def init_process_group(backend: str, **kwargs: Any) -> None:
    """`torch.distributed.init_process_group`, after importing `torch.distributed.nn`.

    That module binds `group.WORLD` as the default argument of its functions when it is
    first imported, and transformers imports it (through FSDP) when it builds a model. Imported
    after the group exists, it holds ten references to the default group that
    `destroy_process_group` cannot drop: gloo's threads then outlive it and are torn down
    during interpreter finalization, where a rank can abort ("terminate called without an
    active exception") after its work is done. Imported first, the defaults are None."""
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401

    dist.init_process_group(backend, timeout=TIMEOUT, **kwargs)


def torchrun_comm() -> Comm | None:
    """The Comm of this torchrun rank, or None when not launched by torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    import torch.distributed as dist

    world = int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available() and "LOCAL_RANK" in os.environ:
        # one GPU per local rank: `cuda` (--device auto) is then this rank's own
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    if world == 1:
        return Comm()
    if not dist.is_initialized():
        # The collectives here move CPU tensors and objects: gloo for those, nccl beside it
        # for CUDA tensors when asked for.
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and os.environ.get(
            "TQ_DIST_BACKEND", "gloo") == "nccl" else "gloo"
        init_process_group(backend)
    return Comm(dist.get_rank(), dist.get_world_size())


def finish_comm(comm: Comm | None) -> None:
    """Tear the process group down (after the last collective)."""
    if comm is not None and comm.world > 1:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
