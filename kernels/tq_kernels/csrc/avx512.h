// The AVX-512 variant (F, BW, VL, DQ with FMA and F16C) for 2, 3, 4 and 8-bit codes.
//
// The codebook lives in one zmm register and a code is a vpermps index: vpermps reads
// only the low 4 bits of each index, so 16 levels need no masking, and the 2- and 3-bit
// codebooks are replicated across the 16 lanes so that garbage in index bits 2-3 picks
// the same level. 8-bit codes gather from the 1 KiB codebook in L1, unless its levels
// are an exact affine grid (kAffine8, common.h): then a convert and an fma decode them.
// Compiled under a target pragma, never -march, so one cached build loads on any x86-64;
// this code is only called after a runtime CPU check. The row loops are rows.inc.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")

namespace tqcpu::avx512 {

using V = __m512;
using Codebook = __m512;
constexpr int kLanes = 16;
constexpr int kRowTile = 2;  // weight rows per pass over x (32 registers allow 2)
constexpr int kDecodeRowTile = 4;  // ... and 4 when x is one row (rows.inc, kAcc)

inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(V v) { return _mm512_reduce_add_ps(v); }
inline float half(uint16_t h) { return _cvtsh_ss(h); }

// k <= 16 fp16 values from p as floats (lanes past k zero; nothing past p + k is read).
inline V vhalves(const uint16_t* p, int64_t k) {
  const __mmask16 m = static_cast<__mmask16>((1u << k) - 1);
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// y[r] = hsum(t[r]) for RT rows, with _mm512_reduce_add_ps's additions in its order
// (upper + lower half, then quarters, then pairs), several rows per shuffle.
template <int RT>
inline void hsums(const V (&t)[RT], float* y) {
  if constexpr (RT == 4) {
    // [a_hi256 + a_lo256 | b_hi256 + b_lo256] and the same for c, d
    const V ab = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0xEE),
                               _mm512_shuffle_f32x4(t[0], t[1], 0x44));
    const V cd = _mm512_add_ps(_mm512_shuffle_f32x4(t[2], t[3], 0xEE),
                               _mm512_shuffle_f32x4(t[2], t[3], 0x44));
    // 128-bit lanes: [a_q1 + a_q0 | b .. | c .. | d ..]
    const V q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0xDD),
                              _mm512_shuffle_f32x4(ab, cd, 0x88));
    const V p = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));  // lanes {2,3,0,1}
    const V s = _mm512_add_ps(p, _mm512_permute_ps(p, 0xB1));  // element 0 + element 1
    const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
    _mm_storeu_ps(y, _mm512_castps512_ps128(_mm512_permutexvar_ps(first, s)));
  } else {
    for (int r = 0; r < RT; ++r) y[r] = hsum(t[r]);
  }
}

inline Codebook codebook_registers(const float* cb, int bits) {
  alignas(64) float t[16];
  const int levels = 1 << std::min(bits, 4);
  for (int i = 0; i < 16; ++i) t[i] = cb[i % levels];
  return _mm512_load_ps(t);
}

// Walsh-Hadamard stages h = 1, 2, 4, 8 inside one vector: lane j takes v[j] + v[j^h]
// where bit h of j is clear and v[j^h] - v[j] where it is set (a + c and a - c).
inline V butterflies_in_vector(V v) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __mmask16 upper[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
  for (int s = 0; s < 4; ++s) {
    const V p = _mm512_permutexvar_ps(_mm512_xor_si512(iota, _mm512_set1_epi32(1 << s)), v);
    v = _mm512_mask_sub_ps(_mm512_add_ps(v, p), upper[s], p, v);
  }
  return v;
}

// Decode one chunk into nv vectors of levels, lane j of vector k being code j * per + k.
template <int BITS>
inline void decode(const uint8_t* p0, const uint8_t* p1, __m512 cb, const float* cbp,
                   __m512* w) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0)));
  if constexpr (BITS == 4) {
    w[0] = _mm512_permutexvar_ps(d, cb);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), cb);
  } else if constexpr (BITS == 2) {
    w[0] = _mm512_permutexvar_ps(d, cb);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 2), cb);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), cb);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 6), cb);
  } else if constexpr (BITS == 3) {
    // Plane 1 holds bit 2 of codes 4j..4j+3 in nibble j: byte j/2, shifted by 4 if j odd.
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1));
    b = _mm_unpacklo_epi8(b, b);
    const __m512i h = _mm512_srlv_epi32(
        _mm512_cvtepu8_epi32(b), _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0));
    const __m512i low2 = _mm512_set1_epi32(3);
    // 0xCA: bitwise (low2 ? plane-0 bits : plane-1 bits); bit k of h lands on bit 2.
    w[0] = _mm512_permutexvar_ps(_mm512_ternarylogic_epi32(low2, d, _mm512_slli_epi32(h, 2), 0xCA), cb);
    w[1] = _mm512_permutexvar_ps(
        _mm512_ternarylogic_epi32(low2, _mm512_srli_epi32(d, 2), _mm512_slli_epi32(h, 1), 0xCA), cb);
    w[2] = _mm512_permutexvar_ps(_mm512_ternarylogic_epi32(low2, _mm512_srli_epi32(d, 4), h, 0xCA), cb);
    w[3] = _mm512_permutexvar_ps(
        _mm512_ternarylogic_epi32(low2, _mm512_srli_epi32(d, 6), _mm512_srli_epi32(h, 1), 0xCA), cb);
  } else if constexpr (BITS == kAffine8) {  // cbp = {a, b}: fma(k, b, a), the exact levels
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(cbp[1]),
                           _mm512_set1_ps(cbp[0]));
  } else {
    w[0] = _mm512_i32gather_ps(d, cbp, 4);
  }
}

// x into the chunk layout (common.h, Layout) for one chunk of 16 * NV values: lane j of
// output vector k takes r[j * NV + k]. Two-source permutes instead of a scalar loop.
template <int NV>
inline void permute_chunk(const float* r, float* q) {
  if constexpr (NV == 1) {
    _mm512_storeu_ps(q, _mm512_loadu_ps(r));
  } else if constexpr (NV == 2) {
    alignas(64) static constexpr int32_t even[16] = {0, 2, 4, 6, 8, 10, 12, 14,
                                                     16, 18, 20, 22, 24, 26, 28, 30};
    const __m512i e = _mm512_load_si512(even), o = _mm512_add_epi32(e, _mm512_set1_epi32(1));
    const V a = _mm512_loadu_ps(r), b = _mm512_loadu_ps(r + 16);
    _mm512_storeu_ps(q, _mm512_permutex2var_ps(a, e, b));
    _mm512_storeu_ps(q + 16, _mm512_permutex2var_ps(a, o, b));
  } else {
    // Lanes 0-7 of output k come from r[0..31] (indices 4j + k), lanes 8-15 from r[32..63].
    alignas(64) static constexpr int32_t stride4[16] = {0, 4, 8, 12, 16, 20, 24, 28,
                                                        0, 4, 8, 12, 16, 20, 24, 28};
    const __m512i base = _mm512_load_si512(stride4);
    const V a = _mm512_loadu_ps(r), b = _mm512_loadu_ps(r + 16);
    const V c = _mm512_loadu_ps(r + 32), d = _mm512_loadu_ps(r + 48);
    for (int k = 0; k < 4; ++k) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(k));
      const V lo = _mm512_permutex2var_ps(a, idx, b), hi = _mm512_permutex2var_ps(c, idx, d);
      _mm512_storeu_ps(q + 16 * k, _mm512_shuffle_f32x4(lo, hi, 0x44));
    }
  }
}

// kLanes int8 signs (+-1) as floats.
inline V vsigns(const int8_t* s) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
}

#include "rows.inc"

}  // namespace tqcpu::avx512

#pragma GCC pop_options

#endif  // x86-64
