"""Time one decode step's attention products over a TurboQuant-coded KV cache on CPU.

For SmolLM2-like shapes (B=1, 3 KV heads, 3 query heads per KV head, head dim 64, keys
4-bit, values 3-bit), at several cache lengths T, each method computes the scores
q K^T and the weighted sum p V of one decode step:

  native    tq_kernels.kv (score_codes + accumulate_codes) straight from the codes
  reference tq_kernels.kv_reference, the torch reference of the same products
  decode    what the cache does today: codebook gather, `@ R^T` (64 x 64), scale, then
            q @ K^T and p @ V in float32 (tq_cli.kvcache.codec.MSECodec.decode)
  fp32      q @ K^T and p @ V on float32 keys/values (the full-precision cache)

It prints microseconds per call (score + accumulate; median and best), the bytes of the
cache each method reads (codes + fp16 scales, or float32 K and V), that read rate, and
the rate as a fraction of the machine's copy bandwidth (torch's copy_ of a 256 MB
buffer, counted as bytes read + written; the caches here are smaller and may sit in the
last-level cache, so a fraction above 1 is possible). The kernel threads on torch's
intra-op pool (torch.set_num_threads). Run the 1-thread numbers pinned, and the 2-thread
ones only on an otherwise idle machine (a busy core stalls every parallel region):

    taskset -c 1 env OMP_NUM_THREADS=1 python scripts/bench_kv_kernel.py --threads 1
    python scripts/bench_kv_kernel.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tq_cli.bench.metrics import cpu_copy_bandwidth_gb_s
from tq_kernels import isas, kv, kv_reference
from tq_kernels.packing import pack_codes, packed_row_bytes, unpack_codes

H, G, D, KEY_BITS, VALUE_BITS = 3, 3, 64, 4, 3


def timed(fn: Callable[[], object], budget: float, min_reps: int = 5) -> float:
    """Median seconds per call: warm up, then repeat until `budget` seconds have passed."""
    return statistics.median(samples(fn, budget, min_reps))


def samples(fn: Callable[[], object], budget: float, min_reps: int = 5) -> list[float]:
    """Seconds of each call: warm up, then repeat until `budget` seconds have passed."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10_000:
            break
    return times


class Codec:
    """A coded head stream: tq_cli's MSECodec when it imports, else the same decode
    (codebook gather, `@ R^T`, scale) written out here."""

    def __init__(self, bits: int, seed: int) -> None:
        self.bits = bits
        try:
            from tq_cli.kvcache.codec import MSECodec

            self.codec: Any = MSECodec(D, bits, "hadamard", seed)
            self.levels = self.codec.levels
            self.rot = self.codec.rot
        except Exception:  # no tq_cli: a random orthogonal R and a uniform codebook
            self.codec = None
            g = torch.Generator().manual_seed(seed)
            self.rot = torch.linalg.qr(torch.randn(D, D, generator=g))[0]
            self.levels = torch.linspace(-0.3, 0.3, 2 ** bits)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.codec is not None:
            packed, scale, _ = self.codec.encode(x)
            return packed, scale
        norm = x.norm(dim=-1)
        y = (x / norm[..., None]) @ self.rot
        codes = torch.bucketize(y, (self.levels[1:] + self.levels[:-1]) / 2)
        lead = codes.shape[:-1]
        packed = pack_codes(codes.reshape(-1, D).to(torch.uint8), self.bits)
        return packed.reshape(*lead, -1), norm.half()

    def decode(self, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.codec is not None:
            out: torch.Tensor = self.codec.decode(packed, scale)
            return out
        lead = packed.shape[:-1]
        idx = unpack_codes(packed.reshape(-1, packed.shape[-1]), self.bits, D).long()
        lv = self.levels[idx].reshape(*lead, D)
        return (lv @ self.rot.T) * scale.float()[..., None]


def bench(t: int, copy_bw: float, budget: float, methods: list[str]) -> list[dict[str, Any]]:
    torch.manual_seed(t)
    kc, vc = Codec(KEY_BITS, 1), Codec(VALUE_BITS, 2)
    keys, values = torch.randn(1, H, t, D), torch.randn(1, H, t, D)
    kcodes, kscale = kc.encode(keys)
    vcodes, vscale = vc.encode(values)
    q = torch.randn(1, H, G, D)
    qr = q @ kc.rot  # the query in the keys' rotated basis
    p = torch.softmax(torch.randn(1, H, G, t), dim=-1)
    kf, vf = kc.decode(kcodes, kscale), vc.decode(vcodes, vscale)
    assert kcodes.shape[-1] == packed_row_bytes(D, KEY_BITS)
    coded = (kcodes.numel() + vcodes.numel()) + 2 * (kscale.numel() + vscale.numel())
    full = 4 * (kf.numel() + vf.numel())

    def native() -> None:
        kv.score_codes(qr, kcodes, kscale, kc.levels, KEY_BITS)
        kv.accumulate_codes(p, vcodes, vscale, vc.levels, VALUE_BITS, D)

    def reference() -> None:
        kv_reference.score_codes(qr, kcodes, kscale, kc.levels, KEY_BITS)
        kv_reference.accumulate_codes(p, vcodes, vscale, vc.levels, VALUE_BITS, D)

    def decode() -> None:
        k, v = kc.decode(kcodes, kscale), vc.decode(vcodes, vscale)
        _ = q @ k.transpose(-1, -2)
        _ = p @ v

    def fp32() -> None:
        _ = q @ kf.transpose(-1, -2)
        _ = p @ vf

    fns: dict[str, tuple[Callable[[], None], int]] = {
        "native": (native, coded), "reference": (reference, coded), "decode": (decode, coded),
        "fp32": (fp32, full)}
    rows = []
    for name in methods:
        if name == "native" and not kv.available():
            continue
        fn, nbytes = fns[name]
        times = samples(fn, budget)
        seconds = statistics.median(times)
        rows.append({"T": t, "threads": torch.get_num_threads(), "method": name,
                     "backend": kv.backend_for("cpu") if name == "native" else "torch",
                     "us": seconds * 1e6, "min_us": min(times) * 1e6, "bytes": nbytes,
                     "bytes_per_s": nbytes / seconds,
                     "fraction_of_copy": nbytes / seconds / copy_bw})
    if "native" in methods and kv.available():  # the two products apart
        s = timed(lambda: kv.score_codes(qr, kcodes, kscale, kc.levels, KEY_BITS), budget)
        a = timed(lambda: kv.accumulate_codes(p, vcodes, vscale, vc.levels, VALUE_BITS, D),
                  budget)
        rows[0]["score_us"], rows[0]["accumulate_us"] = s * 1e6, a * 1e6
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,8192,32768", help="cache lengths T")
    ap.add_argument("--threads", default="1,2", help="torch intra-op thread counts")
    ap.add_argument("--methods", default="native,reference,decode,fp32")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per measurement")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    rows: list[dict[str, Any]] = []
    copy_bw = 0.0
    for threads in (int(n) for n in args.threads.split(",")):
        torch.set_num_threads(threads)
        copy_bw = cpu_copy_bandwidth_gb_s() * 1e9
        for t in (int(n) for n in args.lengths.split(",")):
            for row in bench(t, copy_bw, args.budget, methods):
                row["copy_bytes_per_s"] = copy_bw
                rows.append(row)
    if args.json:
        print(json.dumps({**isas.describe(), "rows": rows}, indent=1))
        return
    print(f"B=1 H={H} G={G} d={D}, keys {KEY_BITS}-bit, values {VALUE_BITS}-bit; "
          f"native backend: {kv.backend_for('cpu')} ({isas.cpu_model()})")
    print(f"{'T':>6} {'thr':>3} {'method':<10} {'us/call':>10} {'min us':>10} {'MB read':>8} "
          f"{'GB/s':>7} {'of copy':>8}  {'copy GB/s':>9}")
    for r in rows:
        extra = (f"  (score {r['score_us']:.1f} us + accumulate {r['accumulate_us']:.1f} us)"
                 if "score_us" in r else "")
        print(f"{r['T']:>6} {r['threads']:>3} {r['method']:<10} {r['us']:>10.1f} "
              f"{r['min_us']:>10.1f} "
              f"{r['bytes'] / 1e6:>8.2f} {r['bytes_per_s'] / 1e9:>7.2f} "
              f"{r['fraction_of_copy']:>8.1%}  {r['copy_bytes_per_s'] / 1e9:>9.2f}{extra}")


if __name__ == "__main__":
    main()
