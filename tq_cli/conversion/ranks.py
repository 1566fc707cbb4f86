"""How a conversion's tensors are shared among torchrun ranks.

Every rank plans the same conversion, so each computes the same assignment on its own:
no scheduler, no messages. Within each calibration stage (a block: the tensors whose
Hessians that block makes) the tensors go to the least loaded rank, largest first
(longest-processing-time greedy, by an estimate of their fit's arithmetic), so a block's
ranks finish together and none waits long at the next block's all-reduce. Tensors
without calibration (embeddings, the head, kept tensors) are shared the same way.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import groupby

from tq_cli.parallel import Comm
from tq_cli.planning.plan import TensorPlan

STATES_DIR = ".tq-calib-state"  # the inputs of the last calibrated blocks, for --resume


def cost(tp: TensorPlan) -> float:
    """A tensor's fit, roughly in multiply-adds: a calibrated fit is O(out * in^2) (the
    GPTQ column updates and the scale refit against H); a kept tensor is a copy."""
    if tp.quant is None:
        return float(tp.info.nbytes) / 64
    shape = tp.info.shape
    n_in = shape[-1] if shape else 1
    return float(tp.info.numel) * (n_in if not tp.head else 64)


def assign(todo: list[TensorPlan], comm: Comm,
           stage: Callable[[str], int] | None = None) -> list[TensorPlan]:
    """This rank's share of `todo`, in `todo`'s order (which `stage` must already
    follow: the tensors of one stage are contiguous)."""
    if comm.world == 1:
        return todo
    owner: dict[str, int] = {}
    key = (lambda t: stage(t.info.name)) if stage is not None else (lambda t: 0)
    for _, group in groupby(todo, key=key):
        loads = [(0.0, r) for r in range(comm.world)]
        for tp in sorted(group, key=lambda t: (-cost(t), t.info.name)):
            load, r = heapq.heappop(loads)
            owner[tp.info.name] = r
            heapq.heappush(loads, (load + cost(tp), r))
    return [t for t in todo if owner[t.info.name] == comm.rank]
