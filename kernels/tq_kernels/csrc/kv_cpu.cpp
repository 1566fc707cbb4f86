// tq's CPU kernel for attention over TurboQuant-coded KV-cache tokens, as torch operators:
//
//   torch.ops.tq_kv.score(q, codes, scale, levels, bits, isa) -> [B, H, G, T]
//       out[b,h,g,t] = |scale[b,h,t]| * sum_j q[b,h,g,j] * levels[code(b,h,t,j)]
//   torch.ops.tq_kv.accumulate(p, codes, scale, levels, bits, d, isa) -> [B, H, G, d]
//       out[b,h,g,j] = sum_t p[b,h,g,t] * |scale[b,h,t]| * levels[code(b,h,t,j)]
//
// the two products of a decode step (tq_kernels/kv_reference.py), straight from the
// packed codes: no token is ever decoded to memory. codes [B, H, T, bytes] and scale
// [B, H, T] may be views along T of a larger cache (any strides but a contiguous last
// dim of codes). A token's codes are decoded once per chunk and used by all G query heads
// that share its KV head. Work is split into (b, h, 1024-token) items on torch's intra-op
// pool; accumulate's per-item partial sums are added in item order, so no result depends
// on the thread count. The SIMD variant (kv_avx512.h, kv_avx2.h; kv_scalar.h otherwise)
// is picked at run time with __builtin_cpu_supports. Built by tq_kernels/cpu_build.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "kv_avx2.h"
#include "kv_avx512.h"
#include "kv_common.h"
#include "kv_scalar.h"

namespace tqkv {
namespace {

// The widest variant whose every instruction this CPU has (the target pragmas of
// kv_avx512.h and kv_avx2.h, F16C and BMI included).
int best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi") &&
                    __builtin_cpu_supports("bmi2");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return kAvx512;
  if (avx2) return kAvx2;
#endif
  return kScalar;
}

Api api_for(int64_t isa, int bits) {
  const int use = static_cast<int>(std::min<int64_t>(isa, best_isa()));
#if defined(__x86_64__) || defined(_M_X64)
  if (use == kAvx512) return avx512::api(bits);
  if (use == kAvx2) return avx2::api(bits);
#endif
  (void)use;
  return scalar::api(bits);
}

// Codes read per parallel task at least: below that a thread costs more than it saves.
constexpr int64_t kMinTaskBytes = 96 * 1024;

struct Call {
  Args a;
  Api api;
  int64_t B, H, BH, d;
};

Call prepare(const char* op, const at::Tensor& x, const at::Tensor& codes,
             const at::Tensor& scale, const at::Tensor& levels, int64_t bits, int64_t d,
             int64_t isa) {
  TORCH_CHECK_VALUE(bits >= 1 && bits <= 5, "tq_kv.", op, ": bits must be 1-5, got ", bits);
  TORCH_CHECK_VALUE(x.dim() == 4 && codes.dim() == 4 && scale.dim() == 3, "tq_kv.", op,
                    ": expected q/p [B, H, G, *], codes [B, H, T, bytes], scale [B, H, T]");
  TORCH_CHECK_VALUE(x.scalar_type() == at::kFloat && x.is_contiguous(), "tq_kv.", op,
                    ": q/p must be contiguous float32");
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte, "tq_kv.", op, ": codes must be uint8");
  TORCH_CHECK_VALUE(scale.scalar_type() == at::kHalf, "tq_kv.", op, ": scale must be float16");
  TORCH_CHECK_VALUE(levels.scalar_type() == at::kFloat && levels.is_contiguous() &&
                        levels.numel() == (int64_t{1} << bits),
                    "tq_kv.", op, ": levels must be contiguous float32 [", int64_t{1} << bits,
                    "]");
  const int64_t B = codes.size(0), H = codes.size(1), T = codes.size(2);
  TORCH_CHECK_VALUE(x.size(0) == B && x.size(1) == H && scale.size(0) == B &&
                        scale.size(1) == H && scale.size(2) == T,
                    "tq_kv.", op, ": shapes do not agree: ", x.sizes(), ", ", codes.sizes(),
                    ", ", scale.sizes());
  TORCH_CHECK_VALUE(d >= 1, "tq_kv.", op, ": d must be positive, got ", d);
  const int64_t npad = (d + 7) / 8 * 8;
  TORCH_CHECK_VALUE(codes.size(3) == npad * bits / 8, "tq_kv.", op, ": codes have ",
                    codes.size(3), " bytes per token, ", bits, "-bit codes of ", d,
                    " coordinates need ", npad * bits / 8);
  TORCH_CHECK_VALUE(codes.stride(3) == 1, "tq_kv.", op,
                    ": the bytes of a token's codes must be contiguous");
  Call c{};
  c.api = api_for(isa, static_cast<int>(bits));
  c.B = B;
  c.H = H;
  c.BH = B * H;
  c.d = d;
  Args& a = c.a;
  a.codes = codes.data_ptr<uint8_t>();
  a.cs_b = codes.stride(0);
  a.cs_h = codes.stride(1);
  a.cs_t = codes.stride(2);
  a.scale = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  a.ss_b = scale.stride(0);
  a.ss_h = scale.stride(1);
  a.ss_t = scale.stride(2);
  a.levels = levels.data_ptr<float>();
  a.H = H;
  a.T = T;
  a.G = x.size(2);
  a.npad = npad;
  a.plane0 = npad * (bits == 3 ? 2 : bits == 5 ? 4 : bits) / 8;
  a.items = (T + kItemTokens - 1) / kItemTokens;
  return c;
}

// Floats per head of a row laid out by L: whole chunks of L.slots floats.
int64_t row_floats(const Layout& L, int64_t npad) { return (npad + L.cw - 1) / L.cw * L.slots; }

// Items per parallel task, so that each task reads at least kMinTaskBytes of codes.
int64_t grain(const Args& a, int64_t row_bytes) {
  const int64_t item_bytes = std::max<int64_t>(1, std::min(a.T, kItemTokens) * row_bytes);
  return std::max<int64_t>(1, kMinTaskBytes / item_bytes);
}

at::Tensor score(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& scale,
                 const at::Tensor& levels, int64_t bits, int64_t isa) {
  TORCH_CHECK_VALUE(q.dim() == 4, "tq_kv.score: q must be [B, H, G, d]");
  Call c = prepare("score", q, codes, scale, levels, bits, q.size(3), isa);
  Args& a = c.a;
  at::Tensor out = at::empty({c.B, c.H, a.G, a.T}, q.options());
  if (out.numel() == 0) return out;
  // q in the variant's layout, chunk-major ([B*H][chunks][G][slots]), zero beyond d.
  const Layout& L = c.api.score_layout;
  a.K = row_floats(L, a.npad);
  const int64_t nch = a.K / L.slots;
  std::vector<float> qp(c.BH * a.G * a.K, 0.f);
  const float* qs = q.data_ptr<float>();
  for (int64_t bh = 0; bh < c.BH; ++bh)
    for (int64_t ch = 0; ch < nch; ++ch)
      for (int64_t g = 0; g < a.G; ++g)
        for (int s = 0; s < L.slots; ++s) {
          const int64_t j = ch * L.cw + L.coord(s);
          if (j < c.d)
            qp[((bh * nch + ch) * a.G + g) * L.slots + s] = qs[(bh * a.G + g) * c.d + j];
        }
  a.x = qp.data();
  a.out = out.data_ptr<float>();
  at::parallel_for(0, c.BH * a.items, grain(a, codes.size(3)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t bh = i / a.items, t0 = i % a.items * kItemTokens;
      c.api.score(a, bh, t0, std::min(a.T, t0 + kItemTokens));
    }
  });
  return out;
}

at::Tensor accumulate(const at::Tensor& p, const at::Tensor& codes, const at::Tensor& scale,
                      const at::Tensor& levels, int64_t bits, int64_t d, int64_t isa) {
  Call c = prepare("accumulate", p, codes, scale, levels, bits, d, isa);
  Args& a = c.a;
  TORCH_CHECK_VALUE(p.size(3) == a.T, "tq_kv.accumulate: p has ", p.size(3),
                    " tokens, codes ", a.T);
  at::Tensor out = at::zeros({c.B, c.H, a.G, d}, p.options());
  if (out.numel() == 0 || a.T == 0) return out;
  const Layout& L = c.api.accumulate_layout;
  a.K = row_floats(L, a.npad);
  std::vector<int64_t> where(d);  // coordinate j's float in a partial sum's row
  for (int64_t ch = 0; ch < a.K / L.slots; ++ch)
    for (int s = 0; s < L.slots; ++s) {
      const int64_t j = ch * L.cw + L.coord(s);
      if (j < d) where[j] = ch * L.slots + s;
    }
  std::vector<float> part(c.BH * a.items * a.G * a.K);
  a.x = p.data_ptr<float>();
  a.out = part.data();
  at::parallel_for(0, c.BH * a.items, grain(a, codes.size(3)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) c.api.accumulate(a, i / a.items, i % a.items);
  });
  // The items' partial sums, added in item order, back into coordinate order.
  float* o = out.data_ptr<float>();
  for (int64_t bh = 0; bh < c.BH; ++bh)
    for (int64_t g = 0; g < a.G; ++g) {
      float* og = o + (bh * a.G + g) * d;
      for (int64_t it = 0; it < a.items; ++it) {
        const float* src = part.data() + ((bh * a.items + it) * a.G + g) * a.K;
        for (int64_t j = 0; j < d; ++j) og[j] += src[where[j]];
      }
    }
  return out;
}

int64_t cpu_isa() { return best_isa(); }

}  // namespace
}  // namespace tqkv

TORCH_LIBRARY(tq_kv, m) {
  m.def("score(Tensor q, Tensor codes, Tensor scale, Tensor levels, int bits, int isa) "
        "-> Tensor",
        &tqkv::score);
  m.def("accumulate(Tensor p, Tensor codes, Tensor scale, Tensor levels, int bits, int d, "
        "int isa) -> Tensor",
        &tqkv::accumulate);
  m.def("isa() -> int", &tqkv::cpu_isa);
}
