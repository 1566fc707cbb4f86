"""The streaming stages of `convert`: read -> rotate (CPU) -> quantize (device) -> write.

Each stage is a thread joined to the next by a queue of one item, so tensor i+1 rotates
while tensor i quantizes and tensor i-1 is written (docs/design.md, data flow), and at most a
handful of tensors are alive at once: peak memory follows the largest tensor, not the
shard or the model. On the CPU two quantize threads take tensors in turn, each fitting one
tensor on one core (`quantize_workers`); results are written in the order they finish.
Kept tensors are copied byte for byte by the reader thread in chunks and never decoded.
torch (and tq's native fit) release the GIL in their kernels, so threads overlap.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import torch

from tq_cli.device import release_free_memory
from tq_cli.errors import NonFiniteError, UnsupportedError
from tq_cli.io.format import CONVERTED, stored_tensors
from tq_cli.io.safetensors_reader import read_tensor, tensor_sha256
from tq_cli.io.writer import ShardWriter
from tq_cli.planning.plan import TensorPlan
from tq_cli.quant.choose import CalibOptions, quantize_tensor
from tq_cli.quant.grouped import (
    FP16_MAX,
    QuantizedTensor,
    dequantize,
    native_available,
    scan_values,
    set_fit_threads,
)
from tq_cli.quant.head import finish_head
from tq_cli.quant.prepare import PreparedWeight, prepare_weight
from tq_cli.quant.rotation import Rotation


@dataclass
class Finished:
    """A source tensor fully written: its keys' digests and what the manifest records."""

    plan: TensorPlan
    digests: dict[str, str]
    record: dict = field(default_factory=dict)


@dataclass
class _Read:
    plan: TensorPlan
    tensor: torch.Tensor
    source_sha256: str


@dataclass
class _Rotated:
    plan: TensorPlan
    # The weight as read (float32, this stage's own) until it is prepared: a spec that
    # scales columns is prepared by the quantize workers, which run in parallel.
    weight: torch.Tensor | None
    prepared: PreparedWeight | None
    rotation: Rotation
    nonfinite: int
    source_sha256: str
    # With --allow-nonfinite, the values as read where some were clamped (NaN/Inf as 0):
    # the reported error is against these, not against the clamped copy that was fitted.
    original: torch.Tensor | None = None


# A quantized copy that lost more than half of the weight's energy stands for nothing (a
# normal 2-bit fit loses about 12%): refused by name rather than written.
MAX_REL_ERROR = 0.5
TINY_RMS = 1e-5  # weights this small are at fp16 scales' resolution


@dataclass
class _Quantized:
    plan: TensorPlan
    q: QuantizedTensor
    nonfinite: int
    seconds: float
    extra: dict = field(default_factory=dict)  # calibration fields for the manifest


class _Stop(Exception):
    pass


_END = object()


def _put(q: queue.Queue, item: object, stop: threading.Event) -> None:
    while True:
        if stop.is_set():
            raise _Stop
        try:
            q.put(item, timeout=0.1)
            return
        except queue.Full:
            continue


def _get(q: queue.Queue, stop: threading.Event) -> object:
    while True:
        if stop.is_set():
            raise _Stop
        try:
            return q.get(timeout=0.1)
        except queue.Empty:
            continue


def _workers(fn: Callable[[object], object], src: queue.Queue, dst: queue.Queue,
             stop: threading.Event, count: int = 1, lock: threading.Lock | None = None,
             left: list[int] | None = None, setup: Callable[[], None] | None = None) -> None:
    """One of `count` threads running `fn` on items from `src` (count 1: a plain pipeline
    stage): each passes _END on to the next, and the last one out forwards it to `dst`."""
    lock = lock or threading.Lock()
    left = left if left is not None else [count]
    try:
        if setup is not None:
            setup()
        while True:
            item = _get(src, stop)
            if item is _END:
                with lock:
                    left[0] -= 1
                    last = left[0] == 0
                _put(dst if last else src, _END, stop)
                return
            if isinstance(item, BaseException):
                _put(dst, item, stop)
                return
            _put(dst, fn(item), stop)
    except _Stop:
        return
    except BaseException as e:
        with contextlib.suppress(_Stop):
            _put(dst, e, stop)


def quantize_workers(device: torch.device, calib: CalibOptions | None) -> tuple[int, int]:
    """(tensors quantized at once, fit threads each). On the CPU with the native fit, one
    thread per tensor and as many tensors as threads, at most two: a pass over a typical
    tensor lasts a few milliseconds, so a parallel region per pass pays more for waking
    and joining threads (and for waiting on a preempted one when the read, rotate and
    write stages share the cores) than it gains, and two tensors in flight cost one more
    tensor of memory, not more per model. Otherwise one tensor at a time on all threads."""
    threads = max(1, torch.get_num_threads())
    if device.type != "cpu" or calib is not None or threads < 2 or not native_available():
        return 1, 0
    workers = min(2, threads)
    return workers, threads // workers


def stream(todo: list[TensorPlan], writer: ShardWriter, rotations: dict[str, Rotation],
           device: torch.device, allow_nonfinite: bool = False,
           log: Callable[[str], None] | None = None,
           calib: CalibOptions | None = None) -> Iterator[Finished]:
    """Convert `todo` and yield each tensor once its bytes are written."""
    stop = threading.Event()
    # With calibration a fit takes seconds to minutes and a read a fraction of a second:
    # one tensor read ahead of the fit keeps the fit fed, and more would only hold memory
    # (three 8B MLP weights in float32 are 0.7 GB beside the fit's Hessians).
    ahead = threading.Semaphore(1) if calib is not None else None
    q_read: queue.Queue = queue.Queue(maxsize=1)
    q_rot: queue.Queue = queue.Queue(maxsize=1)
    q_quant: queue.Queue = queue.Queue(maxsize=1)

    def read_all() -> None:
        try:
            for tp in todo:
                # Each input's sha256 goes into the journal, so --resume can tell a source
                # that changed since from one that did not (kept bytes: input = output).
                if tp.action == "keep":
                    key = tp.keys[0][0]
                    digest = writer.copy(key, tp.info, stop.is_set)
                    _put(q_read, Finished(tp, {key: digest}, {"action": "keep",
                                                              "source_sha256": digest}), stop)
                else:
                    while ahead is not None and not ahead.acquire(timeout=0.1):
                        if stop.is_set():
                            raise _Stop
                    t = read_tensor(tp.info)
                    _put(q_read, _Read(tp, t, tensor_sha256(t)), stop)
            _put(q_read, _END, stop)
        except _Stop:
            return
        except BaseException as e:
            with contextlib.suppress(_Stop):
                _put(q_read, e, stop)

    def rotate(item: object) -> object:
        if not isinstance(item, _Read):
            return item
        tp = item.plan
        # The read buffer is this stage's own: a float32 source is rotated in place, and a
        # narrower one is released as soon as its float32 copy exists.
        w = item.tensor.to(torch.float32).contiguous()
        item.tensor = w
        nonfinite, huge = scan_values(w)
        if nonfinite:
            bad = ~torch.isfinite(w)
            if not allow_nonfinite:
                raise NonFiniteError(
                    f"{tp.info.file.name}: tensor '{tp.info.name}' contains {nonfinite} NaN/Inf "
                    "values; fix the source or pass --allow-nonfinite to quantize them as 0")
            w = torch.where(bad, torch.zeros_like(w), w)
            if log:
                log(f"tensor '{tp.info.name}': {nonfinite} NaN/Inf values quantized as 0")
        # fp16 scales and outliers hold at most FP16_MAX: a larger finite value cannot be
        # stored, so it is refused like a NaN, or clamped with --allow-nonfinite.
        if huge:
            peak = float(w.abs().max())
            if not allow_nonfinite:
                raise NonFiniteError(
                    f"{tp.info.file.name}: tensor '{tp.info.name}' has {huge} values beyond "
                    f"what fp16 scales can hold (up to {peak:.3g}, limit {FP16_MAX:g}); fix the "
                    "source, keep the tensor with a keep rule, or pass --allow-nonfinite to "
                    "clamp them")
            original = w.clone()
            w = w.clamp(-FP16_MAX, FP16_MAX)
            nonfinite += huge
            if log:
                log(f"tensor '{tp.info.name}': {huge} values beyond ±{FP16_MAX:g} clamped")
        rot = (rotations[tp.rotation_id] if tp.rotation_id
               else Rotation("none", w.shape[1], tp.block, 0))
        item_original = original if huge else None
        assert tp.quant is not None
        if tp.quant.col_scale != "none":
            return _Rotated(tp, w, None, rot, nonfinite, item.source_sha256, item_original)
        return _Rotated(tp, None, prepare_weight(w, tp.quant, rot, owned=True), rot,
                        nonfinite, item.source_sha256, item_original)

    thin: list[str] = []  # experts routed too few tokens to fit with their Hessian

    def quant(item: object) -> object:
        if not isinstance(item, _Rotated):
            return item
        if ahead is not None:
            ahead.release()  # the next tensor may be read while this one is fitted
        assert item.plan.quant is not None
        t0 = time.perf_counter()
        name = item.plan.info.name
        if item.prepared is None:
            assert item.weight is not None
            item.prepared = prepare_weight(item.weight, item.plan.quant, item.rotation,
                                           owned=True)
            item.weight = None
        p = item.prepared
        head = item.plan.head  # the weight-only fit on the head's grid (tq_cli.quant.head)
        res = quantize_tensor(name, p, item.plan.quant, item.rotation, device,
                              None if head else calib)
        if calib is not None:  # a calibrated fit frees about 2 n^2 floats: hand them back
            release_free_memory()
        if head:
            res = replace(res, q=finish_head(res.q, p.w_rot, rotated=True))
        if item.original is not None:  # the error of what is stored against what was read
            w0 = item.original
            err = float(torch.linalg.vector_norm(w0 - dequantize(res.q), dtype=torch.float64))
            norm0 = float(torch.linalg.vector_norm(w0, dtype=torch.float64))
            res = replace(res, q=replace(res.q, rel_error=(err / norm0) ** 2 if norm0 else 0.0))
        if res.q.rel_error > MAX_REL_ERROR and item.original is None:
            rms = math.sqrt(p.norm / max(1, p.w_rot.numel()))
            tiny = (f"; its values (RMS {rms:.2g}) are below what fp16 group scales resolve"
                    if rms < TINY_RMS else "")
            raise UnsupportedError(
                f"{item.plan.info.file.name}: tensor '{name}' cannot be stored: its quantized "
                f"copy has relative error {res.q.rel_error:.2f}{tiny}; keep it in full "
                "precision with a keep rule (--recipe), or rescale the source")
        if res.fallback and item.plan.expert is not None and res.fallback.startswith(
                "an expert routed"):
            thin.append(name)  # said once at the end: a MoE has hundreds of experts
        elif res.fallback and log:
            log(f"tensor '{name}': {res.fallback}; quantized data-free")
        return _Quantized(item.plan, res.q, item.nonfinite, time.perf_counter() - t0,
                          res.record | {"source_sha256": item.source_sha256})

    workers, fit_threads = quantize_workers(device, calib)
    left, lock = [workers], threading.Lock()

    def rotate_stage() -> None:
        with contextlib.suppress(Exception):
            set_fit_threads(1)  # the rotation is cheap next to the fit: no parallel region
        _workers(rotate, q_read, q_rot, stop)

    threads = [
        threading.Thread(target=read_all, name="tq-read", daemon=True),
        threading.Thread(target=rotate_stage, name="tq-rotate", daemon=True),
        *(threading.Thread(target=_workers, name=f"tq-quantize-{i}", daemon=True,
                           args=(quant, q_rot, q_quant, stop, workers, lock, left,
                                 lambda: set_fit_threads(fit_threads)))
          for i in range(workers)),
    ]
    for th in threads:
        th.start()
    try:
        while True:
            item = _get(q_quant, stop)
            if item is _END:
                if thin and log:
                    log(f"{len(thin)} expert projection(s) got the weight-only fit, such as "
                        f"'{thin[0]}': routed fewer calibration tokens than half their inputs "
                        "(the manifest's `fallback` names each)")
                break
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, Finished):
                yield item
            elif isinstance(item, _Quantized):
                yield _write(item.plan, item.q, item.nonfinite, item.seconds, writer,
                             item.extra)
    finally:
        # Every thread must be gone before the caller closes the shards they write to;
        # each notices `stop` within one chunk copy or one tensor's quantization.
        stop.set()
        for th in threads:
            th.join()


def _write(tp: TensorPlan, q: QuantizedTensor, nonfinite: int, secs: float,
           writer: ShardWriter, extra: dict) -> Finished:
    digests = {key: writer.write(key, t) for key, t in stored_tensors(tp.info.name, q).items()}
    record = {"action": CONVERTED, "rel_error": q.rel_error, "nbytes": q.nbytes(),
              "nonfinite": nonfinite, "seconds": round(secs, 4)} | extra
    return Finished(tp, digests, record)
