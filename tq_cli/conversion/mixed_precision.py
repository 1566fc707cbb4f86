"""`--target-bits`: per-tensor bit widths that minimise the total error at an average.

A pre-pass quantizes every converted tensor at each allowed width exactly as the
conversion will (calibrated when there is calibration data) and measures its error;
`allocate` then picks one width per tensor: minimise the summed error subject to the
summed storage bits <= target * weights. The error is the Fisher-weighted
1/2 sum_i F_i (dW H dW^T)_ii, the second-order KL the width adds (F the Fisher
information at the layer's output: tq_cli.calibration.fisher), where it can be measured;
else the Hessian-weighted tr(dW H dW^T) (H the mean of x x^T) where calibration data
exists, the layer's output error in the same units for every layer (the HAWQ-style
proxy: Dong et al. 2019, "HAWQ", arXiv:1905.03696); without calibration the plain
squared error ||dW||^2. Storage
counts codes, scales, codebook, outliers and the tensor's share of the rotation
material, so the achieved average is the one the manifest reports.

The solver (`allocate`, pure): the caller measures, for every tensor and every candidate
width, the error it would add (for example its Hessian-weighted error) and the bits it
would occupy at that width, scales, codebook and outliers included. Picking one width
per tensor so that the summed error is least while the summed storage stays within
target_bpw * (weights in total) is a multiple-choice knapsack. It is solved the usual
way (Sinha & Zoltners 1979, "The multiple-choice knapsack problem"): a Lagrangian sweep
over the price of a bit, which walks the lower convex hull of every tensor's (bits,
error) options in order of error saved per bit, then a greedy fill and a local search of
one- and two-tensor exchanges that spends what the sweep left and repairs its rounding.
When the Pareto front of partial choices stays small (few tensors), a dynamic programme
over it gives the exact optimum instead. Pure and deterministic: ties go to the name
that sorts first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tq_cli.calibration.fisher import OutputFisher, fisher_cost
from tq_cli.errors import TqError
from tq_cli.io.format import storage_layout
from tq_cli.io.safetensors_reader import read_weight
from tq_cli.io.writer import nbytes
from tq_cli.planning.plan import Plan
from tq_cli.quant.choose import CalibOptions, quantize_tensor
from tq_cli.quant.prepare import prepare_weight
from tq_cli.quant.rotation import Rotation, make_rotation
from tq_cli.quant.spec import QuantSpec

Options = dict[str, dict[int, tuple[float, int]]]  # name -> bits -> (error, storage bits)

MAX_EXCHANGES = 10_000  # a safety net; each exchange strictly lowers the total error
PAIR_CHUNK = 1024  # rows of the pairwise exchange table built at a time
MAX_STATES = 20_000  # Pareto states the exact dynamic programme may keep per tensor


class AllocationError(TqError):
    """The bit allocation is impossible or its inputs do not fit together."""


@dataclass(frozen=True)
class Allocation:
    """The chosen width per tensor and what it costs."""

    bits: dict[str, int]
    storage_bits: int
    numel: int
    error: float

    @property
    def bpw(self) -> float:
        """Achieved average bits per weight, scales, codebooks and outliers included."""
        return self.storage_bits / self.numel


def _validate(options: Options, target_bpw: float, numel: dict[str, int]) -> None:
    if set(options) != set(numel):
        missing = sorted(set(options) ^ set(numel))
        raise AllocationError(f"bit allocation: tensors {missing[:3]} are in only one of the "
                              "options and the weight counts")
    if not options:
        raise AllocationError("bit allocation: no tensors to allocate")
    if not (math.isfinite(target_bpw) and target_bpw > 0):
        raise AllocationError(f"bit allocation: target {target_bpw} bpw must be a positive number")
    for name in sorted(options):
        if not isinstance(numel[name], (int, np.integer)) or numel[name] <= 0:
            raise AllocationError(f"bit allocation: tensor '{name}' has {numel[name]!r} weights; "
                                  "expected a positive integer")
        if not options[name]:
            raise AllocationError(f"bit allocation: tensor '{name}' has no width to choose from")
        for bits, (err, cost) in sorted(options[name].items()):
            if not isinstance(bits, int) or bits <= 0:
                raise AllocationError(f"bit allocation: tensor '{name}' has width {bits!r}")
            if not math.isfinite(err):
                raise AllocationError(f"bit allocation: tensor '{name}' at {bits} bits has "
                                      f"error {err}; expected a finite number")
            if not isinstance(cost, (int, np.integer)) or cost <= 0:
                raise AllocationError(f"bit allocation: tensor '{name}' at {bits} bits takes "
                                      f"{cost!r} storage bits; expected a positive integer")


def _hull(opts: dict[int, tuple[float, int]]) -> list[int]:
    """Widths on the lower convex hull of (storage, error), cheapest first, each one
    strictly more costly and strictly more accurate than the one before."""
    pts = sorted(opts, key=lambda b: (opts[b][1], opts[b][0], b))
    front: list[int] = []
    for b in pts:  # Pareto front: only options that beat every cheaper one
        if not front or (opts[b][0] < opts[front[-1]][0] and opts[b][1] > opts[front[-1]][1]):
            front.append(b)
    hull: list[int] = []
    for b in front:
        while len(hull) >= 2:
            (e0, c0), (e1, c1), (e2, c2) = opts[hull[-2]], opts[hull[-1]], opts[b]
            # Drop the middle point unless the slope gets strictly shallower after it.
            if (e1 - e0) * (c2 - c1) >= (e2 - e1) * (c1 - c0):
                hull.pop()
            else:
                break
        hull.append(b)
    return hull


def _sweep(options: Options, names: list[str], budget: int) -> dict[str, int]:
    """Lagrangian sweep: take hull steps in order of error saved per bit while they fit."""
    hulls = {n: _hull(options[n]) for n in names}
    choice = {n: hulls[n][0] for n in names}
    used = sum(options[n][choice[n]][1] for n in names)
    steps = []
    for n in names:
        h = hulls[n]
        for i in range(1, len(h)):
            (e0, c0), (e1, c1) = options[n][h[i - 1]], options[n][h[i]]
            steps.append(((e1 - e0) / (c1 - c0), n, i))
    blocked: set[str] = set()
    for _slope, n, i in sorted(steps):
        if n in blocked:
            continue
        b0, b1 = hulls[n][i - 1], hulls[n][i]
        extra = options[n][b1][1] - options[n][b0][1]
        if used + extra <= budget:
            choice[n] = b1
            used += extra
        else:  # this tensor's later steps build on this one
            blocked.add(n)
    return choice


def _frontier(options: Options, names: list[str], budget: int) -> dict[str, int] | None:
    """The optimum, by dynamic programming over the Pareto front of (storage, error) of
    partial choices (Nemhauser & Ullmann 1969), or None once the front outgrows
    MAX_STATES (many tensors, where the sweep is close to optimal anyway)."""
    rest = np.cumsum([0] + [min(c for _, c in options[n].values()) for n in reversed(names)])
    cost = np.zeros(1, dtype=np.int64)
    err = np.zeros(1, dtype=np.float64)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for t, n in enumerate(names):
        widths = sorted(options[n])
        cs = np.concatenate([cost + options[n][b][1] for b in widths])
        es = np.concatenate([err + options[n][b][0] for b in widths])
        parent = np.tile(np.arange(cost.size), len(widths))
        pick = np.repeat(np.arange(len(widths)), cost.size)
        # Dominated states and states that cannot finish within budget never win.
        ok = cs + rest[len(names) - t - 1] <= budget
        order = np.flatnonzero(ok)[np.lexsort((es[ok], cs[ok]))]  # by storage, then error
        cs, es, parent, pick = cs[order], es[order], parent[order], pick[order]
        keep = es < np.minimum.accumulate(np.r_[np.inf, es[:-1]])
        if int(keep.sum()) > MAX_STATES:
            return None
        cost, err = cs[keep], es[keep]
        back.append((parent[keep], pick[keep]))
    state = int(np.argmin(err))
    choice = {}
    for t in range(len(names) - 1, -1, -1):
        parent, pick = back[t]
        choice[names[t]] = sorted(options[names[t]])[int(pick[state])]
        state = int(parent[state])
    return choice


def _improve(options: Options, names: list[str], budget: int,
             choice: dict[str, int]) -> dict[str, int]:
    """Greedy fill and repair: apply the best change of one tensor's width, or of two
    (one gaining accuracy, one giving up storage), that fits the budget and lowers the
    total error, until there is none."""
    choice = dict(choice)
    flat = [(n, b) for n in names for b in sorted(options[n])]
    index = {n: i for i, n in enumerate(names)}
    tid = np.array([index[n] for n, _ in flat])
    err = np.array([options[n][b][0] for n, b in flat], dtype=np.float64)
    cost = np.array([options[n][b][1] for n, b in flat], dtype=np.float64)
    for _ in range(MAX_EXCHANGES):
        cur = {n: options[n][choice[n]] for n in names}
        de = err - np.array([cur[n][0] for n, _ in flat])
        dc = cost - np.array([cur[n][1] for n, _ in flat])
        room = budget - sum(c for _, c in cur.values())
        tol = 1e-12 * (1.0 + sum(abs(e) for e, _ in cur.values()))
        best = -tol
        move: tuple[int, ...] | None = None
        single = np.where(dc <= room, de, np.inf)
        i = int(np.argmin(single))
        if single[i] < best:
            best, move = float(single[i]), (i,)
        ups, downs = np.flatnonzero(de < 0), np.flatnonzero(dc < 0)
        for r0 in range(0, ups.size, PAIR_CHUNK):
            u = ups[r0:r0 + PAIR_CHUNK]
            ok = (dc[u, None] + dc[None, downs] <= room) & (tid[u, None] != tid[None, downs])
            gain = np.where(ok, de[u, None] + de[None, downs], np.inf)
            k = int(np.argmin(gain)) if gain.size else 0
            if gain.size and gain.flat[k] < best:
                pair = (int(u[k // downs.size]), int(downs[k % downs.size]))
                best, move = float(gain.flat[k]), pair
        if move is None:
            break
        for j in move:
            choice[flat[j][0]] = flat[j][1]
    return choice


def allocate(options: Options, target_bpw: float, numel: dict[str, int]) -> Allocation:
    """Choose a width per tensor minimising the summed error with storage within
    target_bpw * sum(numel) bits. `options[name][bits] = (error, storage bits)`."""
    _validate(options, target_bpw, numel)
    names = sorted(options)
    total = sum(numel.values())
    budget = math.floor(target_bpw * total)
    least = sum(min(c for _, c in options[n].values()) for n in names)
    if least > budget:
        raise AllocationError(
            f"bit allocation: target {target_bpw:g} bpw is below the smallest achievable "
            f"{least / total:.4f} bpw (every tensor at its narrowest width); raise the target "
            f"to at least "
            f"{math.ceil(least / total * 1e4) / 1e4:g}")
    # The front is exact while it stays small: few or lopsided tensors, where one large
    # tensor can be worth several small ones and a sweep goes wrong. With many tensors
    # the sweep, filled and repaired, is close to optimal.
    exact = _frontier(options, names, budget)
    choice = exact if exact is not None else _improve(
        options, names, budget, _sweep(options, names, budget))
    used = sum(options[n][choice[n]][1] for n in names)
    assert used <= budget
    return Allocation(bits=choice, storage_bits=used, numel=total,
                      error=sum(options[n][choice[n]][0] for n in names))


NARROW_TARGET = 3.5  # from here up --target-bits leaves 2 bits out where 3 and 4 reach it


def default_bit_choices(plan: Plan, target: float) -> tuple[int, ...]:
    """The widths `--target-bits` chooses from when none are given: 3 and 4 bits for a
    target of NARROW_TARGET or more that every tensor at 3 bits fits in, else 2, 3 and 4.
    At 3.5 bits without data, leaving 2 bits out lowered the KL by 3% (SmolLM2) and 8%
    (Gemma-3-270M, where the rule had given 2 bits to 23 of 126 tensors) at the same
    size (docs/results.md): the Fisher-weighted rule's second-order estimate is kind to
    2-bit errors, which are not small."""
    specs = [(t.info.shape, t.info.numel, t.quant) for t in plan.converted
             if not t.head and t.quant is not None]
    if target < NARROW_TARGET or not specs:
        return (2, 3, 4)
    weights = sum(numel for _, numel, _ in specs)
    at3 = sum(storage_bits(shape[0], shape[1], q.model_copy(update={"bits": 3}))
              for shape, _, q in specs)
    return (3, 4) if at3 <= target * weights else (2, 3, 4)


@dataclass(frozen=True)
class MixedChoice:
    bits: dict[str, int]
    record: dict[str, Any]  # what the manifest and summary report


def storage_bits(out: int, n: int, spec: QuantSpec) -> int:
    return 8 * sum(nbytes(dtype, tuple(shape))
                   for dtype, shape in storage_layout(out, n, spec).values())


def choose_bits(plan: Plan, target: float, choices: tuple[int, ...], device: torch.device,
                calib: CalibOptions | None,
                progress: Callable[[str, int, int], None] | None = None,
                fisher: OutputFisher | None = None) -> MixedChoice:
    """Widths per converted tensor for an average of `target` bits. The cost of a width is
    the Fisher-weighted error 1/2 sum_i F_i (dW H dW^T)_ii (`fisher`, the second-order KL
    it adds: tq_cli.calibration.fisher) where every tensor has F and a calibrated fit,
    else tr(dW H dW^T) with calibration, else ||dW||^2."""
    options: dict[str, dict[int, tuple[float, int]]] = {}
    weighted: dict[str, dict[int, tuple[float, int]]] = {}
    why_not = None if fisher is not None else "no Fisher information"
    numel: dict[str, int] = {}
    rotations: dict[str, Rotation] = {}
    todo = [t for t in plan.converted if not t.head]  # a head keeps its own bits
    for i, tp in enumerate(todo):
        assert tp.quant is not None and tp.rotation is not None
        name = tp.info.name
        out, n = tp.info.shape
        w = read_weight(tp.info)
        if tp.rotation_id:
            if tp.rotation_id not in rotations:
                rotations[tp.rotation_id] = make_rotation(tp.rotation, n, tp.block)
            rot = rotations[tp.rotation_id]
            rp = plan.rotations[tp.rotation_id]
            share = sum(plan.layout.slots[k].nbytes for k, _, _ in rp.keys) * 8 / rp.users
        else:
            rot, share = Rotation("none", n, tp.block, 0), 0.0
        prepared = prepare_weight(w, tp.quant, rot, owned=True)
        options[name] = {}
        for bits in choices:
            spec = tp.quant.model_copy(update={"bits": bits})
            res = quantize_tensor(name, prepared, spec, rot, device, calib)
            err = res.weighted_error if res.weighted_error is not None \
                else res.q.rel_error * prepared.norm
            options[name][bits] = (err, storage_bits(out, n, spec) + round(share))
            if why_not is None and fisher is not None:
                f = fisher.fisher.get(name)
                if f is None:
                    why_not = f"'{name}': {fisher.missing.get(name, 'not reached')}"
                elif res.row_errors is None:
                    why_not = f"'{name}': fitted without calibration"
                else:
                    weighted.setdefault(name, {})[bits] = (fisher_cost(f, res.row_errors),
                                                           options[name][bits][1])
        numel[name] = tp.info.numel
        if progress:
            progress(name, i + 1, len(todo))
    rule = "hessian-weighted" if calib is not None else "squared"
    if why_not is None:
        options, rule = weighted, "fisher-weighted"
    alloc = allocate(options, target, numel)
    counts = {str(b): sum(1 for v in alloc.bits.values() if v == b) for b in choices}
    weights = {str(b): sum(numel[k] for k, v in alloc.bits.items() if v == b) for b in choices}
    record = {"target_bits": target, "choices": list(choices),
              "achieved_bits": alloc.bpw, "tensors_per_bits": counts,
              "weights_per_bits": weights, "error": rule}
    if fisher is not None:
        record["fisher_tokens"] = fisher.tokens
        if why_not is not None:
            record["fisher_unused"] = why_not
    return MixedChoice(alloc.bits, record)
