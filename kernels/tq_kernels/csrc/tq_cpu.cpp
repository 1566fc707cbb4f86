// tq's CPU kernel: TQLinear's forward on packed format-v1 weights, as torch operators.
//
//   torch.ops.tq_cpu.linear(x, signs?, block, codes, scales, codebook, outlier_idx,
//                           outlier_val, bias?, bits, group_size, out_features, isa,
//                           gemm_min_batch, bf16_gemm) -> y
//
// One call rotates x (blockwise Hadamard, O(n log b)), multiplies it with the packed
// weight, adds the sparse outliers and the bias: the same result as tq_kernels.reference
// (rotate -> grouped_matmul -> add_outliers -> + bias), accumulated in float32.
// Below gemm_min_batch activation rows it is a lookup-table GEMV that reads the packed
// weight once, parallel over output rows on torch's own OpenMP pool (so it never fights
// torch's spinning threads); from gemm_min_batch rows on it dequantizes row blocks into a
// reused buffer and calls torch's GEMM, in float32 or (bf16_gemm, on CPUs with native
// bf16 dot products) in bfloat16 with float32 accumulation; with bf16_gemm a one-row GEMV
// of a 2-4-bit layer (and of an 8-bit one on an affine grid, the head's) takes
// int8 products where the CPU has them (int8_gemv.h; off with set_gemv_int8), else bf16
// ones on a CPU with them (bf16_gemv.h). The SIMD variant is picked at run time with
// __builtin_cpu_supports, so a cached build never executes an instruction the CPU lacks.
// Compiled once per torch version and source by tq_kernels/cpu_build.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/scaled_dot_product_attention.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "avx2.h"
#include "attention_avx512.h"
#include "avx512.h"
#include "bf16_gemv.h"
#include "int8_gemv.h"
#include "common.h"
#include "scalar.h"
#include "shared_hadamard.h"

namespace tqcpu {
namespace {

int best_isa() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    return kAvx2;
#endif
  return kScalar;
}

// The widest variant this process may run: best_isa() capped by TQ_CPU_ISA, which
// tq_kernels.cpu sets once when it loads the library (set_isa_cap). The paths that pick a
// variant without an isa argument (rotate, outlier values, decode attention) read it, so
// a capped process runs exactly what a CPU of that width runs.
std::atomic<int> isa_cap{kAvx512};
int run_isa() { return std::min(best_isa(), isa_cap.load(std::memory_order_relaxed)); }

// A bf16 GEMM that beats the fp32 one needs AVX512-BF16 or AMX; elsewhere torch's bf16
// GEMM widens its operands itself and bf16 inputs keep the fp32 path.
bool has_bf16_gemm() {
  static const bool yes = [] {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && !defined(__clang__) && \
    __GNUC__ >= 12
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") || __builtin_cpu_supports("amx-bf16");
#elif (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && __GNUC__ >= 10
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
#else
    return false;
#endif
  }();
  return yes;
}

// A CPU without AVX-512 has no bf16 dot products either, so a process capped below it
// (TQ_CPU_ISA) multiplies in float32 too.
bool bf16_products() { return has_bf16_gemm() && run_isa() >= kAvx512; }

using RowsFn = void (*)(const Problem&, int64_t, int64_t);
using DequantFn = void (*)(const Problem&, float*, int64_t, int64_t, int64_t);
using PermuteFn = void (*)(const float*, float*, int64_t, int64_t);
using FwhtFn = void (*)(float*, int64_t);
using SignFn = void (*)(const float*, const int8_t*, float*, int64_t);

struct Kernels {
  RowsFn gemv;
  DequantFn dequant;
  PermuteFn permute;  // x into the variant's layout (common.h)
  FwhtFn fwht;
  SignFn sign;
};

constexpr Kernels kScalarKernels{&scalar::gemv_rows, &scalar::dequant_rows, &permute_identity,
                                 &fwht_scalar, &sign_row_scalar};

template <int BITS>
Kernels simd_kernels(int isa) {
#if defined(__x86_64__) || defined(_M_X64)
  if (isa == kAvx512)
    return {&avx512::gemv_rows<BITS>, &avx512::dequant_rows<BITS>,
            &avx512::permute_row<BITS>, &avx512::fwht, &avx512::sign_row};
  if (isa == kAvx2)
    return {&avx2::gemv_rows<BITS>, &avx2::dequant_rows<BITS>, &avx2::permute_row<BITS>,
            &avx2::fwht, &avx2::sign_row};
#endif
  (void)isa;
  return kScalarKernels;
}

Kernels kernels_for(int isa, int bits) {
  switch (isa == kScalar ? 0 : bits) {
    case 2: return simd_kernels<2>(isa);
    case 3: return simd_kernels<3>(isa);
    case 4: return simd_kernels<4>(isa);
    case 8: return simd_kernels<8>(isa);
    default: return kScalarKernels;
  }
}

using tqshared::hadamard_blocks;

struct Prep {
  const int8_t* signs;  // null: x is already rotated
  std::vector<std::pair<int64_t, int64_t>> blocks;
  Kernels kernels;
  int64_t n, K;
};

// Activation rows m0..m1: to float, rotated (xr, natural order: the outliers read it),
// then permuted into the variant's layout and zero-padded to K columns (xp).
template <typename T>
void prep_rows(const Prep& p, const T* x, float* xr, float* xp, int64_t m0, int64_t m1) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* src = x + m * p.n;
    float* r = xr + m * p.n;
    const float* xf = r;
    if constexpr (std::is_same_v<T, float>) xf = src;
    else for (int64_t c = 0; c < p.n; ++c) r[c] = static_cast<float>(src[c]);
    if (p.signs != nullptr) {
      p.kernels.sign(xf, p.signs, r, p.n);
      for (const auto& [start, size] : p.blocks) p.kernels.fwht(r + start, size);
    } else if (xf != r) {
      std::memcpy(r, xf, p.n * sizeof(float));
    }
    p.kernels.permute(r, xp + m * p.K, p.n, p.K);
  }
}

struct Outliers {
  const int32_t* idx;  // ascending row-major flat indices (docs/format.md)
  const float* val;    // the fp16 values, converted
  int64_t k;
  int64_t first(int64_t flat) const {
    return std::lower_bound(idx, idx + k, flat) - idx;
  }
};

// y[:, r0:r1] += x_rot @ S[r0:r1].T, then + bias. One pass over the rows' outliers (a
// decode step's layer has a few hundred among a thousand-odd rows), each finding its row
// by a 32-bit division rather than a walk over the rows, whose branches a CPU mispredicts
// at every outlier; each output takes its row's terms in index order, as before.
// Compiled without FMA (no target pragma here): each term is rounded as a product, then
// as a sum.
void epilogue(const Problem& P, const float* xr, const Outliers& o, const float* bias,
              int64_t r0, int64_t r1) {
  const int64_t n = P.n, j0 = o.first(r0 * n), j1 = o.first(r1 * n);
  const uint32_t un = static_cast<uint32_t>(n);  // flat indices are int32 (docs/format.md)
  for (int64_t m = 0; m < P.M; ++m) {
    const float* x = xr + m * n;
    float* y = P.y + m * P.ldy;
    for (int64_t i = j0; i < j1; ++i) {
      const uint32_t at = static_cast<uint32_t>(o.idx[i]), r = at / un;
      y[r] += x[at - r * un] * o.val[i];
    }
  }
  if (bias != nullptr)
    for (int64_t q = r0; q < r1; ++q)
      for (int64_t m = 0; m < P.M; ++m) P.y[m * P.ldy + q] += bias[q];
}

// The outliers' fp16 values as floats (F16C where the CPU has it: a decode step walks a
// few thousand per layer).
void outlier_floats(const uint16_t* h, float* f, int64_t k) {
#if defined(__x86_64__) || defined(_M_X64)
  if (run_isa() >= kAvx2) return avx2::halves_to_floats(h, f, k);
#endif
  for (int64_t i = 0; i < k; ++i) f[i] = half_to_float(h[i]);
}

// At least ~64k multiply-adds (a few microseconds) per task, so that a small layer at
// batch 1 (SmolLM2's 192x576 k/v projections) does not pay a fork/join for nothing.
int64_t row_grain(int64_t n, int64_t M) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, n * std::min<int64_t>(M, 8)));
}

constexpr int64_t kBufferBytes = int64_t{8} << 20;  // per GEMM block: stays in L3

#include "gemm_path.inc"

// Operands in the dtype and layout the kernels read. For a loaded checkpoint, whose
// buffers already are, these cost nothing (no dispatcher call), so the Python side passes
// tensors untouched: a decode step makes ~200 of these calls per token.
at::Tensor as(const at::Tensor& t, at::ScalarType dt) {
  if (t.scalar_type() == dt) return t.contiguous();
  return t.to(dt).contiguous();
}

// x [..., n], contiguous, in float32, bfloat16 or float16 (other dtypes go via float32).
at::Tensor activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.device().is_cpu(), "tq_cpu: x must be a CPU tensor");
  const auto dt = x.scalar_type();
  if (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf) return x.contiguous();
  return as(x, at::kFloat);
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t out) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return shape;
}

// Per-thread scratch for the small-batch path: at::empty costs about a microsecond.
float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

void prep_all(const Prep& prep, const at::Tensor& x2, int64_t M, float* xr, float* xp) {
  const auto dt = x2.scalar_type();
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / prep.n), [&](int64_t m0, int64_t m1) {
    if (dt == at::kFloat) prep_rows(prep, x2.data_ptr<float>(), xr, xp, m0, m1);
    else if (dt == at::kBFloat16) prep_rows(prep, x2.data_ptr<c10::BFloat16>(), xr, xp, m0, m1);
    else prep_rows(prep, x2.data_ptr<c10::Half>(), xr, xp, m0, m1);
  });
}

// float32 results y [M, out] into `dst` (x's shape and dtype; dst may alias y when float).
void store(const float* y, at::Tensor& dst) {
  const auto dt = dst.scalar_type();
  const int64_t total = dst.numel();
  if (dt == at::kFloat) {
    if (dst.data_ptr<float>() != y) std::memcpy(dst.data_ptr<float>(), y, total * sizeof(float));
  } else if (dt == at::kBFloat16) {
    c10::BFloat16* d = dst.data_ptr<c10::BFloat16>();
    at::parallel_for(0, total, 1 << 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) d[i] = c10::BFloat16(y[i]);
    });
  } else {
    c10::Half* d = dst.data_ptr<c10::Half>();
    at::parallel_for(0, total, 1 << 16, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) d[i] = c10::Half(y[i]);
    });
  }
}

#include "prep_cache.inc"
#include "layer.inc"

// Whether a GEMV runs with bf16 products (bf16_gemv.h): one activation row, a layer it
// fits, the AVX-512 variant, bf16 products asked for and native on this CPU.
bool bf16_gemv(const Problem& P, const Layer& l, int64_t M, bool bf16) {
#ifdef TQ_BF16_GEMV
  // vdpbf16ps is AVX512-BF16's: a CPU with AMX-BF16 alone has bf16 GEMMs but not this
  static const bool dot = [] {
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_supports("avx512bf16"));
  }();
  return M == 1 && bf16 && dot && l.eisa == kAvx512 && bf16_products() && bf16gemv::fits(P);
#else
  (void)P, (void)l, (void)M, (void)bf16;
  return false;
#endif
}

// Whether one-row GEMVs may take int8 products (int8_gemv.h) in place of bf16 ones:
// tq_kernels.cpu sets it (set_gemv_int8) from TQ_CPU_GEMV or its setter.
std::atomic<bool> gemv_int8{false};

bool has_vbmi() {
#ifdef TQ_INT8_GEMV
  static const bool yes = [] {
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_supports("avx512vbmi"));
  }();
  return yes;
#else
  return false;
#endif
}

bool has_vnni() {
#ifdef TQ_INT8_GEMV
  static const bool yes = [] {
    __builtin_cpu_init();
    return static_cast<bool>(__builtin_cpu_supports("avx512vnni"));
  }();
  return yes && run_isa() >= kAvx512;
#else
  return false;
#endif
}

// Whether a GEMV runs with int8 products: one activation row of a layer it fits, the
// AVX-512 variant on a CPU with VNNI (with or without bf16 dot products; 2 and 3 bits
// also need VBMI) or the AVX2 one (vpmaddubsw), both also for 8-bit layers on an affine
// grid (the head's), asked for, and
// the fast products class asked for (bf16_gemm: TQ_CPU_GEMM=fp32 keeps float32 products
// everywhere).
bool int8_gemv(const Problem& P, const Layer& l, int64_t M, bool bf16) {
#ifdef TQ_INT8_GEMV
  if (!(M == 1 && bf16 && gemv_int8.load(std::memory_order_relaxed))) return false;
  if (l.eisa == kAvx512) return has_vnni() && i8gemv::fits(P, has_vbmi(), true);
  return l.eisa == kAvx2 && i8gemv::fits(P, true, true);
#else
  (void)P, (void)l, (void)M, (void)bf16;
  return false;
#endif
}

// y for x (x2: its activations) through a checked layer (`checked_layer`).
at::Tensor run_layer(const at::Tensor& x, const at::Tensor& x2, const Layer& l,
                     int64_t gemm_min_batch, bool bf16_gemm, bool reuse_input) {
  const int64_t n = l.n, M = n > 0 ? x2.numel() / n : 0, out = l.out;
  const int64_t bits = l.bits, block = l.block;
  const bool gemm = gemm_min_batch > 0 && M >= gemm_min_batch;
  at::Tensor dst = result_for(x, out);
  PrepCache& pc = prep_cache();
  // reuse_input false: a compiled graph's buffers are rewritten without a version bump,
  // so an input is never recognised as the last one (which q/k/v share in eager mode).
  if (!reuse_input || !pc.holds(x, l.signs, block, l.eisa, bits, l.K)) {
    pc.x = at::Tensor();  // invalid until the buffers hold this input
    prep_layer(l, x2, M, scratch(pc.xr, M * n), scratch(pc.xp, M * l.K));
    if (reuse_input) pc.store(x, l.signs, block, l.eisa, bits, l.K);
  }
  const float* xr = pc.xr.data();
  float* xp = pc.xp.data();
  float* y = dst.scalar_type() == at::kFloat ? dst.data_ptr<float>() : scratch(pc.y, M * out);
  float ab[2];
  const Problem P = problem_for(l, M, xp, y, ab);
  const Outliers o = outliers_for(l, pc.outliers);
  const float* bp = l.bias.defined() ? l.bias.data_ptr<float>() : nullptr;
  if (gemm) {
    const auto fopt = x2.options().dtype(at::kFloat);
    const bool bf16 = bf16_gemm && bf16_products();
    // A bf16 result takes the bias inside the GEMM (one rounding, as F.linear); a float32
    // or fp16 one adds it in float32 after.
    const at::Tensor bias_l = bf16 && x.scalar_type() == at::kBFloat16 && l.bias.defined()
                                  ? l.bias.to(at::kBFloat16)
                                  : at::Tensor();
    const bool biased = gemm_path(P, l.kern.dequant, l.L, o, at::from_blob(xp, {M, l.K}, fopt),
                                  at::from_blob(y, {M, out}, fopt), bf16, bias_l);
    if (bp != nullptr && !biased)
      at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
        for (int64_t m = m0; m < m1; ++m)
          for (int64_t r = 0; r < out; ++r) y[m * out + r] += bp[r];
      });
  } else if (int8_gemv(P, l, M, bf16_gemm)) {
#ifdef TQ_INT8_GEMV
    // this thread's buffers, read by every thread of the loop below (as bf16's xb)
    static thread_local std::vector<int8_t> xq;
    static thread_local std::vector<float> xs;
    static thread_local std::vector<int32_t> xsum;
    if (xq.size() < static_cast<size_t>(n)) xq.resize(n);
    if (xs.size() < static_cast<size_t>(P.groups)) xs.resize(P.groups), xsum.resize(P.groups);
    const i8gemv::Row row{xq.data(), xs.data(), xsum.data()};
    const bool wide = l.eisa == kAvx512, vbmi = has_vbmi();
    if (wide) i8gemv::quantize(P, xr, row);
    else i8gemv::avx2::quantize(P, xr, row);
    at::parallel_for(0, out, row_grain(n, M), [&](int64_t r0, int64_t r1) {
      if (wide) i8gemv::rows(P, row, r0, r1, vbmi);
      else i8gemv::avx2::rows(P, row, r0, r1);
      epilogue(P, xr, o, bp, r0, r1);
    });
#endif
  } else if (bf16_gemv(P, l, M, bf16_gemm)) {
#ifdef TQ_BF16_GEMV
    // this thread's buffer, read by every thread of the loop below through xbp (a
    // thread_local named inside the lambda would be each worker's own, empty one)
    static thread_local std::vector<uint16_t> xb;
    if (xb.size() < static_cast<size_t>(n)) xb.resize(n);
    uint16_t* const xbp = xb.data();
    bf16gemv::layout(P, xr, xbp);
    at::parallel_for(0, out, row_grain(n, M), [&](int64_t r0, int64_t r1) {
      bf16gemv::rows(P, xbp, r0, r1);
      epilogue(P, xr, o, bp, r0, r1);
    });
#endif
  } else {
    at::parallel_for(0, out, row_grain(n, M), [&](int64_t r0, int64_t r1) {
      l.kern.gemv(P, r0, r1);
      epilogue(P, xr, o, bp, r0, r1);
    });
  }
  store(y, dst);
  pc.trim();
  return x.scalar_type() == dst.scalar_type() ? dst : dst.to(x.scalar_type());
}

at::Tensor linear(const at::Tensor& x, const std::optional<at::Tensor>& signs, int64_t block,
                  const at::Tensor& codes_in, const at::Tensor& scales_in,
                  const at::Tensor& codebook_in, const at::Tensor& outlier_idx_in,
                  const at::Tensor& outlier_val_in, const std::optional<at::Tensor>& bias,
                  int64_t bits, int64_t group_size, int64_t out_features, int64_t isa,
                  int64_t gemm_min_batch, bool bf16_gemm, bool reuse_input) {
  const at::Tensor x2 = activations(x);
  const Layer l = checked_layer(x2.size(-1), signs, block, codes_in, scales_in, codebook_in,
                                outlier_idx_in, outlier_val_in, bias, bits, group_size,
                                out_features, isa);
  return run_layer(x, x2, l, gemm_min_batch, bf16_gemm, reuse_input);
}

#include "registry.inc"

// x @ R for the blockwise randomized Hadamard R, in x's dtype (reference.rotate).
at::Tensor rotate(const at::Tensor& x, const at::Tensor& signs, int64_t block) {
  const at::Tensor x2 = activations(x);
  const int64_t n = x2.size(-1), M = n > 0 ? x2.numel() / n : 0;
  TORCH_CHECK(signs.numel() == n && block > 0 && (block & (block - 1)) == 0,
              "tq_cpu.rotate: signs must have ", n, " entries and block be a power of two");
  const at::Tensor sc = as(signs, at::kChar);
  // Any width gives the variant's FWHT; the layout is the identity (8-bit), so K = n.
  const Prep prep{sc.data_ptr<int8_t>(), hadamard_blocks(n, block),
                  kernels_for(effective_isa(run_isa(), 8, 16), 8), n, n};
  at::Tensor xr = at::empty(x.sizes(), x2.options().dtype(at::kFloat));
  std::vector<float> unused(M * n);
  prep_all(prep, x2, M, xr.data_ptr<float>(), unused.data());
  return x.scalar_type() == at::kFloat ? xr : xr.to(x.scalar_type());
}

#include "decode_attention.inc"

int64_t cpu_isa() { return best_isa(); }

void set_isa_cap(int64_t isa) { isa_cap.store(static_cast<int>(isa), std::memory_order_relaxed); }

bool bf16_gemm() { return bf16_products(); }

// Whether the int8 GEMV runs for a width (2-4 bits; 8 on an affine grid) in a
// variant: AVX2 on any CPU that has it, AVX-512 with VNNI (and VBMI, at 2 and 3 bits)
// where the process runs AVX-512.
bool int8_gemv_native(int64_t bits, int64_t isa) {
#ifdef TQ_INT8_GEMV
  if (bits == 8) return isa == kAvx2 ? best_isa() >= kAvx2 : isa == kAvx512 && has_vnni();
  if (bits < 2 || bits > 4) return false;
  if (isa == kAvx2) return best_isa() >= kAvx2;
  return isa == kAvx512 && has_vnni() && (bits == 4 || has_vbmi());
#else
  (void)bits, (void)isa;
  return false;
#endif
}

void set_gemv_int8(bool on) { gemv_int8.store(on, std::memory_order_relaxed); }

int64_t kernel_isa(int64_t isa, int64_t bits, int64_t group_size) {
  return effective_isa(std::min<int64_t>(isa, best_isa()), static_cast<int>(bits), group_size);
}

}  // namespace
}  // namespace tqcpu

// linear, rotate and decode_attention are CPU kernels (not catch-all), so torch.compile
// can trace them with the shape-only implementations tq_kernels.cpu registers
// (torch.library.register_fake).
TORCH_LIBRARY(tq_cpu, m) {
  m.def("linear(Tensor x, Tensor? signs, int block, Tensor codes, Tensor scales, "
        "Tensor codebook, Tensor outlier_idx, Tensor outlier_val, Tensor? bias, int bits, "
        "int group_size, int out_features, int isa, int gemm_min_batch, bool bf16_gemm, "
        "bool reuse_input=True) -> Tensor");
  m.def("rotate(Tensor x, Tensor signs, int block) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def("cpu_isa() -> int", &tqcpu::cpu_isa);
  m.def("set_isa_cap(int isa) -> ()", &tqcpu::set_isa_cap);
  m.def("bf16_gemm() -> bool", &tqcpu::bf16_gemm);
  m.def("int8_gemv(int bits, int isa) -> bool", &tqcpu::int8_gemv_native);
  m.def("set_gemv_int8(bool on) -> ()", &tqcpu::set_gemv_int8);
  m.def("kernel_isa(int isa, int bits, int group_size) -> int", &tqcpu::kernel_isa);
  m.def("register_layer(Tensor? signs, int block, Tensor codes, Tensor scales, "
        "Tensor codebook, Tensor outlier_idx, Tensor outlier_val, Tensor? bias, int bits, "
        "int group_size, int in_features, int out_features, int isa, int gemm_min_batch, "
        "bool bf16_gemm, int handle=-1) -> int", &tqcpu::register_layer);
  m.def("unregister_layer(int handle) -> ()", &tqcpu::unregister_layer);
  m.def("registered_layers() -> int", &tqcpu::registered_layers);
  m.def("linear_registered(Tensor x, int handle, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(tq_cpu, CPU, m) {
  m.impl("linear", &tqcpu::linear);
  m.impl("linear_registered", &tqcpu::linear_registered);
  m.impl("rotate", &tqcpu::rotate);
  m.impl("decode_attention", &tqcpu::decode_attention);
}
