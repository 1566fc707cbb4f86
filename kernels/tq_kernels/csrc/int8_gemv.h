// The decode GEMV (one activation row) of 2-, 3- and 4-bit layers with 8-bit integer dot
// products: llama.cpp's way of multiplying a non-uniform 4-bit grid (its IQ4_NL), applied
// to tq's codebooks. AVX512-VNNI's vpdpbusd here (2 and 3 bits also need VBMI), the AVX2
// variant's vpmaddubsw in int8_gemv_avx2.h. Both also take 8-bit layers whose levels are
// an affine grid (the head: the codes themselves, no level rounding; `dot_rows8`, each
// with its own exactness bound).
//
// - The levels become int8 on a grid of max|level| / 127 (`level_table`): one vpshufb or
//   vpermb decodes 32 codes. For vpdpbusd they are stored as level + 128 (unsigned),
//   because it multiplies unsigned by signed bytes; each group's sum then carries
//   128 * sum(x), which its accumulator starts without (each of the 8 lanes starts at
//   -16 * sum(x): exact, in integers).
// - The rotated activation row becomes int8 per weight group (`quantize`): scale
//   max|x| / 127, round to nearest even. Per 64 codes, in the order the codes are read
//   (`chunk_pos`): 4-bit, even positions first, then odd ones (a byte holds codes 2b and
//   2b + 1); 2- and 3-bit, four runs of 16 (a plane-0 byte holds codes 4j..4j+3); 8-bit,
//   in order.
// - Per group and row: the integer sum, to float, times the group's fp16 scale and the
//   activations' scale, accumulated in float32; the level grid's step at the end.
//
// The rounding is larger than bf16's (about 0.4% of a group's largest |x| against bf16's
// 0.4% of each value), and far below the weights' own error; tests bound it against an
// emulation (tests/test_cpu_kernel.py). Groups must hold whole 64-code chunks and at most
// 2048 codes: each lane's integer sum (at most 2048 / 8 * 4 * 255 * 127 from the products,
// 16 * 127 * 2048 from the start) stays below 2^24, exact in float32.
#pragma once
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && \
    (__GNUC__ >= 10 || defined(__clang__))
#define TQ_INT8_GEMV 1

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "common.h"

namespace tqcpu::i8gemv {

constexpr int64_t kChunk = 64;
constexpr int kRows = 4;             // weight rows per pass over x
constexpr int64_t kPrefetch = 8192;  // as rows.inc: bytes ahead of each row's group

// small: 2- and 3-bit layers too (the AVX-512 variant with VBMI); affine8: 8-bit layers
// whose levels are an exact affine grid (dot_rows8)
inline bool fits(const Problem& P, bool small, bool affine8 = false) {
  const bool width = P.affine != nullptr
                         ? affine8 && P.bits == 8
                         : P.bits == 4 || (small && (P.bits == 2 || P.bits == 3));
  return width && P.n % kChunk == 0 && P.group % kChunk == 0 && P.group <= 2048;
}

// The activation row, quantized: q [n] in the chunk layout above, per group its scale and
// the sum of its q.
struct Row {
  int8_t* q;
  float* scale;
  int32_t* sum;
};

// The 2**bits levels as int8 on the step max|level| / 127, plus offset (128: unsigned, for
// vpdpbusd; 0: signed), repeated over 32 entries: both 128-bit lanes of a vpshufb table,
// or a vpermb table whose index bits above the code's own are don't-cares. Returns the
// step. (Compiled for any x86-64: the AVX2 variant calls it too.)
inline float level_table(const float* cb, int bits, uint8_t* table, int offset) {
  const int levels = 1 << bits;
  float m = 0.f;
  for (int k = 0; k < levels; ++k) m = std::max(m, std::fabs(cb[k]));
  const float step = m > 0.f ? m / 127.f : 1.f;
  for (int k = 0; k < 32; ++k) {
    const float q = std::nearbyint(cb[k % levels] / step);
    table[k] = static_cast<uint8_t>(static_cast<int>(std::clamp(q, -127.f, 127.f)) + offset);
  }
  return step;
}

// Where value k of a 64-value chunk goes in the quantized row: 4-bit, even positions then
// odd ones (a byte's low and high nibble); 2- and 3-bit, four runs of 16, run i holding
// positions 4j + i (a plane-0 byte's four codes), as bf16_gemv.h's layouts; 8-bit, in
// order.
inline int64_t chunk_pos(int bits, int64_t k) {
  if (bits == 8) return k;  // a byte per code
  return bits == 4 ? (k % 2) * 32 + k / 2 : (k % 4) * 16 + k / 4;
}

}  // namespace tqcpu::i8gemv

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")

namespace tqcpu::i8gemv {

// xr (rotated, natural order, n floats) -> row: per group, scale = max|x| / 127 and
// q = round(x / scale) (to nearest even), each 64-value chunk in `chunk_pos` order.
inline void quantize(const Problem& P, const float* xr, const Row& row) {
  alignas(64) static constexpr int32_t even[16] = {0, 2, 4, 6, 8, 10, 12, 14,
                                                   16, 18, 20, 22, 24, 26, 28, 30};
  alignas(64) static constexpr int32_t stride4[16] = {0, 4, 8, 12, 16, 20, 24, 28,
                                                      0, 4, 8, 12, 16, 20, 24, 28};
  const __m512i e = _mm512_load_si512(even), o = _mm512_add_epi32(e, _mm512_set1_epi32(1));
  const __m512i s4 = _mm512_load_si512(stride4);
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t g = 0; g < P.groups; ++g) {
    const int64_t c0 = g * P.group, c1 = std::min(P.n, c0 + P.group);
    __m512 mx = _mm512_setzero_ps(), nonfinite = _mm512_setzero_ps();
    for (int64_t c = c0; c < c1; c += 16) {
      const __m512 v = _mm512_loadu_ps(xr + c);
      mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, v));
      nonfinite = _mm512_add_ps(nonfinite, _mm512_mul_ps(v, _mm512_setzero_ps()));  // NaN if any
    }
    const float m = _mm512_reduce_max_ps(mx);
    const bool bad = std::isnan(_mm512_reduce_add_ps(nonfinite));
    // a group of nothing but (near-)zeros: all q 0 (127 / m would overflow)
    const float inv = m > 0.f && std::isfinite(127.f / m) && !bad ? 127.f / m : 0.f;
    const __m512 vi = _mm512_set1_ps(inv);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t c = c0; c < c1; c += kChunk) {
      const __m512 a = _mm512_loadu_ps(xr + c), b = _mm512_loadu_ps(xr + c + 16);
      const __m512 d = _mm512_loadu_ps(xr + c + 32), f = _mm512_loadu_ps(xr + c + 48);
      __m512 parts[4] = {a, b, d, f};  // 8-bit: in order
      if (P.bits == 4) {
        parts[0] = _mm512_permutex2var_ps(a, e, b), parts[1] = _mm512_permutex2var_ps(d, e, f);
        parts[2] = _mm512_permutex2var_ps(a, o, b), parts[3] = _mm512_permutex2var_ps(d, o, f);
      } else if (P.bits != 8) {
        for (int k = 0; k < 4; ++k) {
          const __m512i idx = _mm512_add_epi32(s4, _mm512_set1_epi32(k));
          parts[k] = _mm512_shuffle_f32x4(_mm512_permutex2var_ps(a, idx, b),
                                          _mm512_permutex2var_ps(d, idx, f), 0x44);
        }
      }
      for (int k = 0; k < 4; ++k) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(parts[k], vi));
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(row.q + c + 16 * k), _mm512_cvtsepi32_epi8(q));
      }
    }
    // a NaN or infinite x gives the group's outputs NaN, as float32 products would (its q
    // are 0: inv is)
    row.scale[g] = bad ? NAN : inv > 0.f ? m / 127.f : 0.f;
    row.sum[g] = bad ? 0 : _mm512_reduce_add_epi32(sum);
    if (bad) std::memset(row.q + c0, 0, c1 - c0);  // NaN * 0 rounds to INT_MIN, not 0
  }
}

#define TQ_I8_DOT4 dot_rows
#define TQ_I8_DECODE4(d, wl, wh)                                                 \
  wl = _mm256_shuffle_epi8(table, _mm256_and_si256(d, low4));                    \
  wh = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(d, 4), low4))
#include "int8_dot4.inc"
#undef TQ_I8_DOT4
#undef TQ_I8_DECODE4

// RT rows of an 8-bit layer whose levels are the affine grid a + b * k (the head's):
// vpdpbusd multiplies the codes k themselves (unsigned) by the int8 activations, and each
// group adds a * sum(x) beside b * sum(k x). Per group of at most 2048 codes each of the
// 16 lanes sums at most 128 products of at most 255 * 127: below 2^24, exact in float32.
template <int RT>
inline void dot_rows8(const Problem& P, const Row& x, int64_t row) {
  const int64_t groups = P.groups, group = P.group, chunks = group / kChunk;
  const uint8_t* rp[RT];
  const uint16_t* sp[RT];
  __m512 tot[RT];
  float sums[RT];
  for (int r = 0; r < RT; ++r) {
    rp[r] = P.codes + (row + r) * P.row_bytes;
    sp[r] = P.scales + (row + r) * groups;
    tot[r] = _mm512_setzero_ps();
    sums[r] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group;
    const int64_t nch = std::min(chunks, (P.n - c0) / kChunk);
    for (int r = 0; r < RT; ++r)
      for (int64_t off = 0; off < group; off += 64)
        __builtin_prefetch(rp[r] + c0 + kPrefetch + off, 0, 2);
    __m512i acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t at = c0 + c * kChunk;
      const __m512i xv = _mm512_loadu_si512(x.q + at);
      for (int r = 0; r < RT; ++r)
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(rp[r] + at), xv);
    }
    for (int r = 0; r < RT; ++r) {
      const float s = _cvtsh_ss(sp[r][g]) * x.scale[g];
      tot[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(s), tot[r]);
      // std::fma, not `+= s * sum`: GCC contracts that or not depending on RT, and a row
      // must not depend on which pass (threads' row ranges) computed it
      sums[r] = std::fma(s, static_cast<float>(x.sum[g]), sums[r]);
    }
  }
  const float a = P.affine[0], b = P.affine[1];
  for (int r = 0; r < RT; ++r) {
    const float shift = a * sums[r];
    P.y[row + r] = std::fma(b, _mm512_reduce_add_ps(tot[r]), shift);
  }
}

inline void rows8(const Problem& P, const Row& x, int64_t r0, int64_t r1) {
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) dot_rows8<kRows>(P, x, r);
  for (; r < r1; ++r) dot_rows8<1>(P, x, r);
}

inline void rows_plain(const Problem& P, const Row& x, int64_t r0, int64_t r1) {
  alignas(32) uint8_t bytes[32];
  const float step = level_table(P.codebook, P.bits, bytes, 128);
  const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) dot_rows<kRows>(P, x, r, table, step);
  for (; r < r1; ++r) dot_rows<1>(P, x, r, table, step);
}

}  // namespace tqcpu::i8gemv

#pragma GCC pop_options

// The same with VBMI: vpermb reads 5 index bits, and the table repeats the levels, so no
// mask; and the 2- and 3-bit codes.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,fma,f16c")

namespace tqcpu::i8gemv {

#define TQ_I8_DOT4 dot_rows_vbmi
#define TQ_I8_DECODE4(d, wl, wh)            \
  wl = _mm256_permutexvar_epi8(d, table); \
  wh = _mm256_permutexvar_epi8(_mm256_srli_epi16(d, 4), table)
#include "int8_dot4.inc"
#undef TQ_I8_DOT4
#undef TQ_I8_DECODE4

// Byte b of run first + b / 16 takes plane 1's bit 4 (b % 16) + first + b / 16 to bit 2.
constexpr std::array<int8_t, 32> plane1_offsets(int first) {
  std::array<int8_t, 32> o{};
  for (int b = 0; b < 32; ++b) o[b] = static_cast<int8_t>((4 * (b % 16) + first + b / 16 - 2) & 63);
  return o;
}

template <int BITS, int RT>
inline void dot_rows_small(const Problem& P, const Row& x, int64_t row, __m256i table,
                           float step) {
  const int64_t groups = P.groups, group = P.group, chunks = group / kChunk;
  const __m256i s01 = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
  const __m256i s23 = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
  // plane 1's 64 bits (bit 4j + i: code 4j + i's bit 2) in every qword; vpmultishiftqb
  // takes byte j of run i from bit offset 4j + i - 2 (mod 64), which puts it on bit 2
  alignas(32) static constexpr auto o01 = plane1_offsets(0), o23 = plane1_offsets(2);
  const __m256i h01 = _mm256_load_si256(reinterpret_cast<const __m256i*>(o01.data()));
  const __m256i h23 = _mm256_load_si256(reinterpret_cast<const __m256i*>(o23.data()));
  const __m256i low2 = _mm256_set1_epi8(3);
  const uint8_t *p0[RT], *p1[RT];
  const uint16_t* sp[RT];
  __m256 tot[RT];
  for (int r = 0; r < RT; ++r) {
    p0[r] = P.codes + (row + r) * P.row_bytes;
    p1[r] = p0[r] + P.plane0_bytes;
    sp[r] = P.scales + (row + r) * groups;
    tot[r] = _mm256_setzero_ps();
  }
  alignas(64) float comb[RT][16];
  for (int64_t g = 0; g < groups; ++g) {
    if (g % 16 == 0) {
      const __mmask16 m = groups - g >= 16 ? 0xFFFF : (1u << (groups - g)) - 1;
      const __m512 xsc = _mm512_maskz_loadu_ps(m, x.scale + g);
      for (int r = 0; r < RT; ++r)
        _mm512_store_ps(comb[r], _mm512_mul_ps(xsc, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, sp[r] + g))));
    }
    const int64_t c0 = g * group;
    const int64_t nch = std::min(chunks, (P.n - c0) / kChunk);
    // The row's bytes in step with its groups (both planes: rows are contiguous, so each
    // row's share, kPrefetch on, tiles the rows ahead without gaps)
    for (int r = 0; r < RT; ++r)
      for (int64_t off = 0; off < group * BITS / 8; off += 64)
        __builtin_prefetch(p0[r] + g * (group * BITS / 8) + kPrefetch + off, 0, 2);
    const __m256i start = _mm256_set1_epi32(-16 * x.sum[g]);
    __m256i acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = start;
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t at = c0 + c * kChunk;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at + 32));
      for (int r = 0; r < RT; ++r) {
        const __m256i d = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0[r] + at / 4)));
        __m256i i01 = _mm256_srlv_epi32(d, s01), i23 = _mm256_srlv_epi32(d, s23);
        if constexpr (BITS == 3) {
          int64_t bits64;
          std::memcpy(&bits64, p1[r] + at / 8, 8);
          const __m256i h = _mm256_set1_epi64x(bits64);
          i01 = _mm256_ternarylogic_epi32(low2, i01, _mm256_multishift_epi64_epi8(h01, h), 0xCA);
          i23 = _mm256_ternarylogic_epi32(low2, i23, _mm256_multishift_epi64_epi8(h23, h), 0xCA);
        }
        acc[r] = _mm256_dpbusd_epi32(acc[r], _mm256_permutexvar_epi8(i01, table), x0);
        acc[r] = _mm256_dpbusd_epi32(acc[r], _mm256_permutexvar_epi8(i23, table), x1);
      }
    }
    for (int r = 0; r < RT; ++r)
      tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                               _mm256_broadcast_ss(&comb[r][g % 16]), tot[r]);
  }
  for (int r = 0; r < RT; ++r) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(tot[r]), _mm256_extractf128_ps(tot[r], 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    P.y[row + r] = step * _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
  }
}

inline void rows_vbmi(const Problem& P, const Row& x, int64_t r0, int64_t r1) {
  alignas(32) uint8_t bytes[32];
  const float step = level_table(P.codebook, P.bits, bytes, 128);
  const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
  int64_t r = r0;
  if (P.bits == 2) {
    for (; r + kRows <= r1; r += kRows) dot_rows_small<2, kRows>(P, x, r, table, step);
    for (; r < r1; ++r) dot_rows_small<2, 1>(P, x, r, table, step);
  } else if (P.bits == 3) {
    for (; r + kRows <= r1; r += kRows) dot_rows_small<3, kRows>(P, x, r, table, step);
    for (; r < r1; ++r) dot_rows_small<3, 1>(P, x, r, table, step);
  } else {
    for (; r + kRows <= r1; r += kRows) dot_rows_vbmi<kRows>(P, x, r, table, step);
    for (; r < r1; ++r) dot_rows_vbmi<1>(P, x, r, table, step);
  }
}

}  // namespace tqcpu::i8gemv

#pragma GCC pop_options

namespace tqcpu::i8gemv {

// y[r0:r1] for one activation row (P.M == 1) from its quantized form (`quantize`). vbmi:
// the CPU has AVX512-VBMI (vpermb decodes a code without masking it first; 2- and 3-bit
// layers need it). Compiled for any x86-64: it only calls the variant the CPU has.
inline void rows(const Problem& P, const Row& x, int64_t r0, int64_t r1, bool vbmi) {
  if (P.bits == 8) rows8(P, x, r0, r1);
  else if (vbmi) rows_vbmi(P, x, r0, r1);
  else rows_plain(P, x, r0, r1);
}

}  // namespace tqcpu::i8gemv

#include "int8_gemv_avx2.h"  // the AVX2 variant (needs the declarations above)

#endif
