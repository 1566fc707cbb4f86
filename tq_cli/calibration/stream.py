"""Calibration consumed as it is made: `tq convert`'s self-calibration without a file.

`StreamedCalibration` answers what the conversion asks of a calibration file
(`tq_cli.io.calibration.Calibration`: `hessian`, `tokens`, `group`, `unusable`) from a
`CalibRun` that it advances one block at a time, on demand: the first tensor of block i
to ask for its H runs block i (and nothing after it). The conversion takes its tensors
block by block (`order_key`), so a block's Hessians are quantized from and released
before the next block runs: memory is one block's weights, Hessians and activations at
any model size, and no temporary file holds the whole model's Hessians (about 33 GB for an
8B model, 330 GB for a 70B).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from tq_cli.calibration.hessian import InputGroup
from tq_cli.calibration.run import BlockStates, CalibRun
from tq_cli.device import release_free_memory
from tq_cli.errors import TqError


class StreamedCalibration:
    """The calibration file's interface over a run advanced block by block."""

    asks_again = False  # each tensor asks once: the fit keeps no prepared H' for it

    def __init__(self, run: CalibRun, needed: set[str] | None = None,
                 mine: set[str] | None = None, states: BlockStates | None = None,
                 check: Any = None) -> None:
        """`needed`: the group keys any rank converts (every rank runs their stages;
        default: every group); `mine`: those this process converts (kept; default all of
        `needed`); `states`: where the inputs of the last blocks are kept (`plan` sets all
        three once the conversion knows what is left to do)."""
        self.run = run
        self.meta: dict[str, Any] = run.meta
        self._group = dict(run.meta["tensors"])
        self._members: dict[str, list[str]] = {k: list(v) for k, v in
                                               run.meta["groups"].items()}
        self._widths = {g.key: g.n for g in run.groups}
        self._routed = frozenset(run.meta.get("routed", ()))
        self._needed: set[str] = set()
        self._mine: set[str] = set()
        self._dropped: set[str] = set()
        self._stages: Iterator[tuple[int, list[InputGroup]]] | None = None
        self._states: BlockStates | None = None
        self.plan(set(self._widths) if needed is None else needed, mine, states)
        self._check = check  # called with each group as it arrives (the recipe's check)
        self._ready: dict[str, torch.Tensor] = {}
        self._served: dict[str, set[str]] = {}
        self._tokens: dict[str, int] = {}
        self._done = False
        self._lock = threading.RLock()
        self.stages_run = 0

    def plan(self, needed: set[str], mine: set[str] | None = None,
             states: BlockStates | None = None) -> None:
        """What the run makes (`needed`), what this process keeps (`mine`), and where the
        block inputs go; before the first stage runs."""
        if self._stages is not None:
            raise RuntimeError("the calibration run has started; plan it before")
        self._needed = set(needed)
        self._mine = self._needed if mine is None else set(mine)
        self._states = states

    def keep(self, readers: dict[str, set[str]]) -> None:
        """The groups this process keeps and, per group, the tensors that will read it
        (its last reader takes the matrix itself; under torchrun or on resume that is
        not every member of the group)."""
        self._mine = set(readers)
        self._members = {k: sorted(v) for k, v in readers.items()}

    @property
    def tensors(self) -> dict[str, str]:
        return dict(self._group)

    def group(self, tensor_name: str) -> str | None:
        key = self._group.get(tensor_name)
        return str(key) if key is not None else None

    def order_key(self, tensor_name: str) -> int:
        """The stage that makes the tensor's H (-1: none): converting tensors in this
        order keeps one block's Hessians alive at a time."""
        key = self._group.get(tensor_name)
        return -1 if key is None or key not in self._needed else self._stage_of[key]

    @property
    def _stage_of(self) -> dict[str, int]:
        cached = self.__dict__.get("_stage_of_cache")
        if cached is None:
            cached = self.__dict__["_stage_of_cache"] = self.run.block_of()
        return cached

    def tokens(self, tensor_name: str) -> int:
        key = self._group.get(tensor_name)
        if key is None:
            return 0
        with self._lock:
            self._until(key)
            return self._tokens.get(key, 0)

    def hessian(self, tensor_name: str) -> torch.Tensor | None:
        """E[x x^T] (float32, the mean, as the file stores it), the caller's own copy; the
        group's last reader takes the matrix itself. None: no calibration for it."""
        key = self._group.get(tensor_name)
        if key is None:
            return None
        with self._lock:
            self._until(key)
            if key in self._dropped:
                raise TqError(f"'{tensor_name}': its calibration (group '{key}') was released "
                              "before the tensor asked for it")
            if self._tokens.get(key, 0) == 0 or key not in self._ready:
                return None
            served = self._served.setdefault(key, set())
            served.add(tensor_name)
            if served.issuperset(self._members.get(key, [tensor_name])):
                self._dropped.add(key)  # handed over: a second ask is an error, not None
                return self._ready.pop(key)
            return self._ready[key].clone()

    def unusable(self, tensor_name: str) -> str | None:
        """As `Calibration.unusable`: an expert routed fewer tokens than half its inputs."""
        if tensor_name not in self._routed:
            return None
        key = self._group[tensor_name]
        n, seen = self._widths[key], self.tokens(tensor_name)
        if 0 < seen < n / 2:
            return (f"an expert routed {seen} calibration tokens, fewer than half its {n} "
                    "inputs")
        return None

    def finish(self) -> None:
        """Run the stages no tensor of this process asked for (another rank's tensors need
        this rank's tokens and collectives), dropping what they make."""
        with self._lock:
            while not self._done:
                self._advance()
            self._ready.clear()

    def _until(self, key: str) -> None:
        while key not in self._tokens and not self._done:
            self._advance()
        if key not in self._tokens and key in self._needed:
            raise TqError(f"calibration ended without the statistics of group '{key}'")

    def _advance(self) -> None:
        if self._stages is None:
            self._stages = self.run.stages(self._needed, self._states)
        # A new block: the previous block's Hessians, prepared or not, are dead (the fit
        # keeps its prepared H' on this object, tq_cli.quant.choose), so they go before
        # the next block's weights and sums are made.
        for slot in ("_tq_prepared", "_tq_prepared_scaled"):
            cache = self.__dict__.get(slot)
            if cache is not None:
                cache.clear()
        self._dropped.update(self._ready)
        self._ready.clear()
        release_free_memory()
        try:
            _, groups = next(self._stages)
        except StopIteration:
            self._done = True
            return
        self.stages_run += 1
        for g in groups:
            if self._check is not None:
                self._check(g)
            self._tokens[g.key] = g.tokens
            if g.key in self._mine and g.tokens > 0 and g.h is not None:
                # the mean in float32, as CalibrationWriter stores it, in place
                self._ready[g.key] = g.h.float().div_(max(g.tokens, 1)).cpu()
            g.h = g.last = None
