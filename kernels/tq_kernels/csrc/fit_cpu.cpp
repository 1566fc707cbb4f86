// tq's native data-free fit: the passes of tq_cli/quant/grouped.py's fit over a float32 weight
// [out, n] in the rotated space, as torch operators (torch.ops.tq_fit.*):
//
//   init(w, group, outliers, uniform) -> scales [out, groups]         RMS or absmax
//   pass_(w, scales!, codebook, group, outliers, refine) -> [2, L]    assign, LS scales
//                                                                     (in place), and
//                                                                     codebook num/den
//   outliers(w, scales, codebook, group, k) -> int64 [k] ascending    top-k |residual|
//   finish(w, scales, codebook, group, bits, outliers)
//       -> (packed codes uint8, outlier residuals fp16, [err, norm] float64)
//   rotate_(w!, signs, block)          the randomized Hadamard rotation, in place
//   scan(w) -> [non-finite, beyond fp16]   the pipeline's input checks in one read
//   gptq_block_(w1!, u1, st, gcol, codebook, mask, codes!, q!, e!)
//                                      one block of GPTQ's column loop (fit_gptq.inc)
//   set_threads(n)                     threads for this OS thread's calls (0: torch's)
//
// Each reads the weight once, with no temporaries beyond one row, where the torch version
// makes several full-size ones per pass. Work is split over row blocks whose size depends
// only on the shape, and per-block sums are added in block order, so the result does not
// depend on the number of threads. `outliers` is a sorted int64 list of flat indices that
// the fit ignores (NaN in a group's scratch copy). The hot loops are in fit_rows.inc,
// compiled for AVX-512, AVX2 and generic x86-64 (or the host's default elsewhere) and
// chosen at run time. Built as its own library by tq_kernels/cpu_build.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "shared_hadamard.h"

namespace tqfit {

constexpr float kFp16Max = 65504.f;
enum Isa : int { kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };

struct Fit {
  const float* w;  // [out, n]
  int64_t out, n, g, groups, npad;
  const float* cb;    // [L], ascending
  float mids[256];    // L - 1 midpoints, padded with +inf
  int L, bits;
  bool uniform;
  const int64_t* oi;  // ascending flat indices the fit ignores
  int64_t k;
};

// Walks the sorted outlier list alongside rows processed in increasing order.
struct OutlierWalk {
  const Fit& F;
  int64_t j;
  OutlierWalk(const Fit& f, int64_t r0)
      : F(f), j(std::lower_bound(f.oi, f.oi + f.k, r0 * f.n) - f.oi) {}
  // NaN where an outlier sits in columns c0..c0+len of row r (z holds those columns).
  void mask(int64_t r, int64_t c0, int64_t len, float* z) {
    const int64_t lo = r * F.n + c0, hi = lo + len;
    while (j < F.k && F.oi[j] < lo) ++j;
    for (; j < F.k && F.oi[j] < hi; ++j) z[F.oi[j] - lo] = std::numeric_limits<float>::quiet_NaN();
  }
};

// The k largest values (ties: lower index first), fed in increasing index order.
struct TopK {
  struct Item {
    float a;
    int64_t i;
  };
  int64_t k;
  size_t cap;
  float threshold = 0.f;
  std::vector<Item> items;
  explicit TopK(int64_t k_) : k(k_), cap(static_cast<size_t>(std::max<int64_t>(2 * k_, 4096))) {}
  static bool before(const Item& x, const Item& y) { return x.a > y.a || (x.a == y.a && x.i < y.i); }
  void push(float a, int64_t i) {
    items.push_back({a, i});
    if (items.size() >= cap) prune();
  }
  void prune() {
    if (static_cast<int64_t>(items.size()) <= k) return;
    std::nth_element(items.begin(), items.begin() + (k - 1), items.end(), before);
    threshold = items[k - 1].a;
    items.resize(k);
  }
};

// One packed row (tq_kernels/packing.py): bit planes of widths 4, 2 or 1, lowest first.
inline void pack_row(const uint8_t* codes, int64_t npad, int bits, uint8_t* dst) {
  static const int kPlanes[9][4] = {{0}, {1, 1}, {1, 2}, {2, 2, 1}, {1, 4},
                                    {2, 4, 1}, {2, 4, 2}, {3, 4, 2, 1}, {1, 8}};
  int shift = 0;
  for (int p = 0; p < kPlanes[bits][0]; ++p) {
    const int w = kPlanes[bits][p + 1], per = 8 / w, mask = (1 << w) - 1;
    const int64_t nbytes = npad / per;
    for (int64_t b = 0; b < nbytes; ++b) {
      int v = 0;
      for (int t = 0; t < per; ++t) v |= ((codes[b * per + t] >> shift) & mask) << (t * w);
      dst[b] = static_cast<uint8_t>(v);
    }
    dst += nbytes;
    shift += w;
  }
}

// The arguments of one block of GPTQ's column loop (fit_gptq.inc).
struct Gptq {
  float* w;             // [b, out] this block's columns of wt, error-fed in place
  const float* u;       // [b, b] the block's part of the upper factor
  const float* st;      // [groups, out] scales, transposed
  const int64_t* gcol;  // [b] each column's group
  const float* cb;      // [L] ascending
  const float* mids;    // [L - 1]
  const uint8_t* mask;  // [b, out] 1 at an outlier, or null
  uint8_t* codes;       // [b, out]
  float* q;             // [b, out]
  float* e;             // [b, out]
  int64_t b, out;
  int L;
};

}  // namespace tqfit

// The loops, once per instruction set.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,prefer-vector-width=512")
namespace tqfit::avx512 {
constexpr int kLanes = 16;  // floats per vector in fit_rows.inc: one register
#define TQFIT_AVX512 1
#define TQFIT_FMA 1
#include "fit_rows.inc"
#include "fit_gptq.inc"
#undef TQFIT_FMA
#undef TQFIT_AVX512
}  // namespace tqfit::avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace tqfit::avx2 {
constexpr int kLanes = 8;
#define TQFIT_FMA 1
#include "fit_rows.inc"
#include "fit_gptq.inc"
#undef TQFIT_FMA
}  // namespace tqfit::avx2
#pragma GCC pop_options
#endif
namespace tqfit::generic {
constexpr int kLanes = 4;  // SSE2 on x86-64, NEON on aarch64
#include "fit_rows.inc"
#include "fit_gptq.inc"
}  // namespace tqfit::generic

namespace tqfit {
namespace {

int best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kGeneric;
}

int pick(int64_t isa) { return static_cast<int>(std::min<int64_t>(isa, best_isa())); }

// Blocks of rows, about 16k values each and at most ~1024 of them, fixed by the shape
// alone: per-block results are combined in block order, whatever the thread count.
struct Blocks {
  int64_t rows, count, out;
  Blocks(int64_t out_, int64_t n) : out(out_) {
    const int64_t width = std::max<int64_t>(n, 1);
    const int64_t values = std::max<int64_t>(int64_t{1} << 14, (out_ * width + 1023) / 1024);
    rows = std::max<int64_t>(1, values / width);
    count = (out_ + rows - 1) / rows;
  }
  int64_t r0(int64_t b) const { return b * rows; }
  int64_t r1(int64_t b) const { return std::min(out, (b + 1) * rows); }
};

// Threads this OS thread's calls may use (set_threads; 0: torch's intra-op count). The
// conversion pipeline quantizes two tensors at once on one thread each where a parallel
// region per pass would cost more in fork/join and scheduling than it gains.
thread_local int64_t tl_threads = 0;

int64_t tasks_for(int64_t count) {
  const int64_t threads = tl_threads > 0 ? tl_threads : at::get_num_threads();
  return std::max<int64_t>(1, std::min<int64_t>(count, threads));
}

// fn(task, block) for every block on torch's thread pool, blocks handed out one at a time:
// a thread the OS preempts (the pipeline's other stages share the cores) simply takes
// fewer, instead of the others waiting for its fixed share at the end.
template <typename Fn>
void for_blocks(int64_t count, Fn&& fn) {
  const int64_t tasks = tasks_for(count);
  if (tasks == 1) {  // no parallel region at all
    for (int64_t b = 0; b < count; ++b) fn(0, b);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = next++; b < count; b = next++) fn(t, b);
  });
}

Fit make_fit(const at::Tensor& w, int64_t group, const at::Tensor* codebook,
             const at::Tensor& outliers, int64_t bits) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 &&
                  w.is_contiguous(),
              "tq_fit: w must be a contiguous float32 CPU matrix");
  TORCH_CHECK(group > 0, "tq_fit: group must be positive");
  TORCH_CHECK(outliers.scalar_type() == at::kLong && outliers.is_contiguous() &&
                  outliers.dim() == 1,
              "tq_fit: outliers must be a contiguous int64 vector");
  Fit F{};
  F.w = w.data_ptr<float>();
  F.out = w.size(0);
  F.n = w.size(1);
  F.g = group;
  F.groups = (F.n + group - 1) / group;
  F.npad = (F.n + 7) / 8 * 8;
  F.oi = outliers.data_ptr<int64_t>();
  F.k = outliers.numel();
  F.bits = static_cast<int>(bits);
  if (codebook != nullptr) {
    TORCH_CHECK(codebook->scalar_type() == at::kFloat && codebook->is_contiguous(),
                "tq_fit: codebook must be contiguous float32");
    const int64_t L = codebook->numel();
    TORCH_CHECK(L >= 2 && L <= 256 && (L & (L - 1)) == 0,
                "tq_fit: codebook must have 2..256 levels, a power of two");
    F.L = static_cast<int>(L);
    F.cb = codebook->data_ptr<float>();
    for (int i = 0; i < 256; ++i)
      F.mids[i] = i < F.L - 1 ? (F.cb[i + 1] + F.cb[i]) / 2.f
                              : std::numeric_limits<float>::infinity();
  }
  return F;
}

void check_scales(const Fit& F, const at::Tensor& scales) {
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == F.out && scales.size(1) == F.groups,
              "tq_fit: scales must be contiguous float32 [", F.out, ", ", F.groups, "]");
}

at::Tensor init(const at::Tensor& w, int64_t group, const at::Tensor& outliers, bool uniform,
                int64_t isa) {
  Fit F = make_fit(w, group, nullptr, outliers, 0);
  F.uniform = uniform;
  at::Tensor scales = at::empty({F.out, F.groups}, w.options());
  float* s = scales.data_ptr<float>();
  const int use = pick(isa);
  const Blocks B(F.out, F.n);
  for_blocks(B.count, [&](int64_t, int64_t b) {
    const int64_t r0 = B.r0(b), r1 = B.r1(b);
#if defined(__x86_64__) || defined(_M_X64)
    if (use == kAvx512) return avx512::init_rows(F, s, r0, r1);
    if (use == kAvx2) return avx2::init_rows(F, s, r0, r1);
#endif
    generic::init_rows(F, s, r0, r1);
  });
  return scales;
}

at::Tensor pass_(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& codebook,
                 int64_t group, const at::Tensor& outliers, bool refine, int64_t isa) {
  Fit F = make_fit(w, group, &codebook, outliers, 0);
  check_scales(F, scales);
  float* s = scales.data_ptr<float>();
  const Blocks B(F.out, F.n);
  const int64_t L = F.L;
  std::vector<double> part(refine ? B.count * 2 * L : 0, 0.0);
  const int use = pick(isa);
  for_blocks(B.count, [&](int64_t, int64_t b) {
    double* num = refine ? part.data() + b * 2 * L : nullptr;
    double* den = refine ? num + L : nullptr;
    const int64_t r0 = B.r0(b), r1 = B.r1(b);
#if defined(__x86_64__) || defined(_M_X64)
    if (use == kAvx512) return avx512::pass_rows(F, s, num, den, r0, r1);
    if (use == kAvx2) return avx2::pass_rows(F, s, num, den, r0, r1);
#endif
    generic::pass_rows(F, s, num, den, r0, r1);
  });
  at::Tensor stats = at::zeros({2, L}, w.options().dtype(at::kDouble));
  double* st = stats.data_ptr<double>();
  for (int64_t b = 0; b < static_cast<int64_t>(part.size()) / (2 * L); ++b)
    for (int64_t i = 0; i < 2 * L; ++i) st[i] += part[b * 2 * L + i];
  return stats;
}

at::Tensor outliers(const at::Tensor& w, const at::Tensor& scales, const at::Tensor& codebook,
                    int64_t group, int64_t k, int64_t isa) {
  const at::Tensor none = at::empty({0}, w.options().dtype(at::kLong));
  Fit F = make_fit(w, group, &codebook, none, 8);
  check_scales(F, scales);
  TORCH_CHECK(k >= 0 && k <= F.out * F.n, "tq_fit.outliers: k out of range");
  at::Tensor result = at::empty({k}, w.options().dtype(at::kLong));
  if (k == 0) return result;
  const float* s = scales.data_ptr<float>();
  const int use = pick(isa);
  // One candidate list per task: each task sees its blocks in increasing order, which
  // TopK's tie rule needs; the union's top k (ties: lower index) is thread-independent.
  const Blocks B(F.out, F.n);
  std::vector<TopK> tops;
  for (int64_t t = 0; t < tasks_for(B.count); ++t) tops.emplace_back(k);
  for_blocks(B.count, [&](int64_t t, int64_t b) {
    const int64_t r0 = B.r0(b), r1 = B.r1(b);
#if defined(__x86_64__) || defined(_M_X64)
    if (use == kAvx512) return avx512::outlier_rows(F, s, tops[t], r0, r1);
    if (use == kAvx2) return avx2::outlier_rows(F, s, tops[t], r0, r1);
#endif
    generic::outlier_rows(F, s, tops[t], r0, r1);
  });
  TopK all(k);
  for (auto& t : tops) all.items.insert(all.items.end(), t.items.begin(), t.items.end());
  all.prune();
  TORCH_CHECK(static_cast<int64_t>(all.items.size()) == k, "tq_fit.outliers: internal error");
  int64_t* out = result.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) out[i] = all.items[i].i;
  std::sort(out, out + k);
  return result;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> finish(const at::Tensor& w,
                                                      const at::Tensor& scales,
                                                      const at::Tensor& codebook, int64_t group,
                                                      int64_t bits, const at::Tensor& outliers,
                                                      int64_t isa) {
  TORCH_CHECK(bits >= 1 && bits <= 8 && codebook.numel() == (int64_t{1} << bits),
              "tq_fit.finish: codebook must have 2**bits levels");
  Fit F = make_fit(w, group, &codebook, outliers, bits);
  check_scales(F, scales);
  for (int64_t j = 1; j < F.k; ++j)
    TORCH_CHECK(F.oi[j] > F.oi[j - 1], "tq_fit.finish: outliers must be strictly ascending");
  TORCH_CHECK(F.k == 0 || (F.oi[0] >= 0 && F.oi[F.k - 1] < F.out * F.n),
              "tq_fit.finish: outlier index out of range");
  const int64_t row_bytes = F.npad * bits / 8;
  at::Tensor packed = at::empty({F.out, row_bytes}, w.options().dtype(at::kByte));
  at::Tensor vals = at::empty({F.k}, w.options().dtype(at::kHalf));
  std::vector<double> err(F.out), norm(F.out);
  const float* s = scales.data_ptr<float>();
  uint8_t* p = packed.data_ptr<uint8_t>();
  uint16_t* v = reinterpret_cast<uint16_t*>(vals.data_ptr<at::Half>());
  const int use = pick(isa);
  const Blocks B(F.out, F.n);
  for_blocks(B.count, [&](int64_t, int64_t b) {
    const int64_t r0 = B.r0(b), r1 = B.r1(b);
#if defined(__x86_64__) || defined(_M_X64)
    if (use == kAvx512)
      return avx512::finish_rows(F, s, p, row_bytes, v, err.data(), norm.data(), r0, r1);
    if (use == kAvx2)
      return avx2::finish_rows(F, s, p, row_bytes, v, err.data(), norm.data(), r0, r1);
#endif
    generic::finish_rows(F, s, p, row_bytes, v, err.data(), norm.data(), r0, r1);
  });
  at::Tensor en = at::zeros({2}, w.options().dtype(at::kDouble));
  double* e = en.data_ptr<double>();
  for (int64_t r = 0; r < F.out; ++r) {
    e[0] += err[r];
    e[1] += norm[r];
  }
  return {packed, vals, en};
}

using tqshared::hadamard_blocks;

void rotate_(const at::Tensor& w, const at::Tensor& signs, int64_t block, int64_t isa) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 &&
                  w.is_contiguous(),
              "tq_fit.rotate_: w must be a contiguous float32 CPU matrix");
  const int64_t out = w.size(0), n = w.size(1);
  TORCH_CHECK(signs.scalar_type() == at::kChar && signs.is_contiguous() && signs.numel() == n &&
                  block > 0 && (block & (block - 1)) == 0,
              "tq_fit.rotate_: signs must be int8 [", n, "] and block a power of two");
  const auto blocks = hadamard_blocks(n, block);
  float* p = w.data_ptr<float>();
  const int8_t* sg = signs.data_ptr<int8_t>();
  const int use = pick(isa);
  const Blocks B(out, n);
  for_blocks(B.count, [&](int64_t, int64_t b) {
    const int64_t r0 = B.r0(b), r1 = B.r1(b);
#if defined(__x86_64__) || defined(_M_X64)
    if (use == kAvx512) return avx512::rotate_rows(p, n, sg, blocks, r0, r1);
    if (use == kAvx2) return avx2::rotate_rows(p, n, sg, blocks, r0, r1);
#endif
    generic::rotate_rows(p, n, sg, blocks, r0, r1);
  });
}

// [values that are NaN or infinite, finite values beyond what fp16 holds] in float32 w.
at::Tensor scan(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "tq_fit.scan: w must be a contiguous float32 CPU tensor");
  const float* p = w.data_ptr<float>();
  const int64_t total = w.numel();
  const int64_t chunks = (total + (1 << 16) - 1) >> 16;
  std::vector<int64_t> bad(2 * chunks, 0);
  for_blocks(chunks, [&](int64_t, int64_t c) {
    int64_t nf = 0, big = 0;
    const int64_t i1 = std::min(total, (c + 1) << 16);
    for (int64_t i = c << 16; i < i1; ++i) {
      const float a = std::fabs(p[i]);
      nf += !(a <= std::numeric_limits<float>::max());  // NaN or inf
      big += (a > kFp16Max) & (a <= std::numeric_limits<float>::max());
    }
    bad[2 * c] = nf;
    bad[2 * c + 1] = big;
  });
  at::Tensor res = at::zeros({2}, w.options().dtype(at::kLong));
  int64_t* r = res.data_ptr<int64_t>();
  for (int64_t c = 0; c < chunks; ++c) {
    r[0] += bad[2 * c];
    r[1] += bad[2 * c + 1];
  }
  return res;
}

// One block of GPTQ's column loop (fit_gptq.inc) over all rows of W, split in chunks of rows
// fixed by the shape: each row's arithmetic is the same whatever the thread count.
void gptq_block_(const at::Tensor& w1, const at::Tensor& u1, const at::Tensor& st,
                 const at::Tensor& gcol, const at::Tensor& codebook, const at::Tensor& mask,
                 const at::Tensor& codes, const at::Tensor& q, const at::Tensor& e, int64_t isa) {
  const int64_t b = w1.size(0), out = w1.size(1);
  auto f32 = [&](const at::Tensor& t, int64_t r, int64_t c, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.dim() == 2 && t.size(0) == r && t.size(1) == c,
                "tq_fit.gptq_block_: ", what, " must be contiguous float32 [", r, ", ", c, "]");
  };
  f32(w1, b, out, "w1");
  f32(u1, b, b, "u1");
  f32(q, b, out, "q");
  f32(e, b, out, "e");
  TORCH_CHECK(st.scalar_type() == at::kFloat && st.is_contiguous() && st.dim() == 2 &&
                  st.size(1) == out,
              "tq_fit.gptq_block_: st must be contiguous float32 [groups, out]");
  TORCH_CHECK(gcol.scalar_type() == at::kLong && gcol.is_contiguous() && gcol.numel() == b,
              "tq_fit.gptq_block_: gcol must be int64 [b]");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(0) == b &&
                  codes.size(1) == out,
              "tq_fit.gptq_block_: codes must be contiguous uint8 [b, out]");
  TORCH_CHECK(mask.numel() == 0 || (mask.scalar_type() == at::kByte && mask.is_contiguous() &&
                                    mask.numel() == b * out),
              "tq_fit.gptq_block_: mask must be empty or uint8 [b, out]");
  const int64_t* g = gcol.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(g[i] >= 0 && g[i] < st.size(0), "tq_fit.gptq_block_: group out of range");
  const at::Tensor none = at::empty({0}, w1.options().dtype(at::kLong));
  const Fit F = make_fit(w1, 1, &codebook, none, 0);
  Gptq G{w1.data_ptr<float>(), u1.data_ptr<float>(), st.data_ptr<float>(), g, F.cb, F.mids,
         mask.numel() ? mask.data_ptr<uint8_t>() : nullptr, codes.data_ptr<uint8_t>(),
         q.data_ptr<float>(), e.data_ptr<float>(), b, out, F.L};
  const int64_t rows = 256, count = (out + rows - 1) / rows;
  const int use = pick(isa);
  for_blocks(count, [&](int64_t, int64_t c) {
    const int64_t r0 = c * rows, r1 = std::min(out, r0 + rows);
#if defined(__x86_64__) || defined(_M_X64)
    if (use == kAvx512) return avx512::gptq_rows(G, r0, r1);
    if (use == kAvx2) return avx2::gptq_rows(G, r0, r1);
#endif
    generic::gptq_rows(G, r0, r1);
  });
}

int64_t isa() { return best_isa(); }

void set_threads(int64_t threads) { tl_threads = std::max<int64_t>(0, threads); }

}  // namespace
}  // namespace tqfit

TORCH_LIBRARY(tq_fit, m) {
  m.def("init(Tensor w, int group, Tensor outliers, bool uniform, int isa) -> Tensor",
        &tqfit::init);
  m.def("pass_(Tensor w, Tensor(a!) scales, Tensor codebook, int group, Tensor outliers, "
        "bool refine, int isa) -> Tensor",
        &tqfit::pass_);
  m.def("outliers(Tensor w, Tensor scales, Tensor codebook, int group, int k, int isa) -> Tensor",
        &tqfit::outliers);
  m.def("finish(Tensor w, Tensor scales, Tensor codebook, int group, int bits, Tensor outliers, "
        "int isa) -> (Tensor, Tensor, Tensor)",
        &tqfit::finish);
  m.def("rotate_(Tensor(a!) w, Tensor signs, int block, int isa) -> ()", &tqfit::rotate_);
  m.def("scan(Tensor w) -> Tensor", &tqfit::scan);
  m.def("gptq_block_(Tensor(a!) w1, Tensor u1, Tensor st, Tensor gcol, Tensor codebook, "
        "Tensor mask, Tensor(b!) codes, Tensor(c!) q, Tensor(d!) e, int isa) -> ()",
        &tqfit::gptq_block_);
  m.def("isa() -> int", &tqfit::isa);
  m.def("set_threads(int threads) -> ()", &tqfit::set_threads);
}
