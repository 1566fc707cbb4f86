// The KV kernel's AVX-512 variant (F, BW, VL, DQ with FMA): 16 lanes, levels in zmm
// registers. A chunk is 16 bytes of plane 0 (plus the matching bytes of plane 1) widened
// to 32-bit lanes; vpermps reads the low 4 index bits, so 16 levels are one permute and 4
// or 8 levels are replicated across the 16 entries (index bits above the code's are
// don't-cares); 32 levels are vpermt2ps on 5 index bits; 1-bit codes are mask-register
// blends. score decodes half a chunk of each of two tokens into one vector (decode_pair),
// which halves its horizontal reductions. Compiled under a target pragma, never -march;
// kv_cpu.cpp calls it only after a runtime CPU check.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "kv_common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2")

namespace tqkv::avx512 {

using V = __m512;
constexpr int kLanes = 16;
constexpr int kRegs = 16;  // of 32 zmm registers, for accumulators
constexpr int kAccRegs = kRegs;
constexpr bool kPairScore = true;

inline V vzero() { return _mm512_setzero_ps(); }
inline V vset1(float f) { return _mm512_set1_ps(f); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }

inline void store_n(float* p, V v, int n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}

// |s| of n (at most 16) fp16 scales s[0], s[stride], ...; 0 in the other lanes.
inline V scales_abs(const uint16_t* s, int64_t stride, int n) {
  __m256i h;
  if (stride == 1) {
    h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), s);
  } else {
    alignas(32) uint16_t t[16] = {};
    for (int i = 0; i < n; ++i) t[i] = s[i * stride];
    h = _mm256_load_si256(reinterpret_cast<const __m256i*>(t));
  }
  return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(0x7fff)));
}

// Per 128-bit lane, [x0 + x2, y0 + y2, x1 + x3, y1 + y3]: two vectors' partial sums.
inline V fold_ps(V x, V y) {
  return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
}
// Per 128-bit lane, [x0 + x2, x1 + x3, y0 + y2, y1 + y3] in 64-bit pairs.
inline V fold_pd(V x, V y) {
  const __m512d a = _mm512_castps_pd(x), b = _mm512_castps_pd(y);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}
// [x.L0 + x.L1, x.L2 + x.L3, y.L0 + y.L1, y.L2 + y.L3] over 128-bit lanes L.
inline V fold_lanes(V x, V y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

// Lane i of the result: the sum of a[i]'s 16 lanes (a 16 x 16 transpose-and-add).
inline V tsum(const V* a) {
  V b[8], c[4];
  for (int i = 0; i < 8; ++i) b[i] = fold_ps(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 4; ++i) c[i] = fold_pd(b[2 * i], b[2 * i + 1]);
  return fold_lanes(fold_lanes(c[0], c[1]), fold_lanes(c[2], c[3]));
}

// The same for 8 vectors holding two tokens each, token a in lanes 0-7 and z in 8-15:
// lane i of the result sums token i when vector m holds tokens (m, m + 4) for m < 4 and
// (m + 4, m + 8) for m >= 4 (fold_ps, fold_pd keep 128-bit lanes apart).
inline V tsum_pairs(const V* a) {
  V b[4];
  for (int i = 0; i < 4; ++i) b[i] = fold_ps(a[2 * i], a[2 * i + 1]);
  return fold_lanes(fold_pd(b[0], b[1]), fold_pd(b[2], b[3]));
}

inline __m512 replicated(const float* levels, int n) {
  alignas(64) float t[16];
  for (int i = 0; i < 16; ++i) t[i] = levels[i % n];
  return _mm512_load_ps(t);
}

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
// 8 bytes of a and 8 of z, in one register.
inline __m128i load8x2(const uint8_t* a, const uint8_t* z) {
  return _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(z)));
}
inline int32_t load32(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int BITS>
struct Dec;

// Interleaved layouts (2-, 4-bit planes): lane i of vector k holds chunk code i * NV + k;
// in a pair, lanes 8-15 hold the second token's half chunk in the same order.
template <int NV>
struct Interleaved {
  static int coord(int s) { return (s % kLanes) * NV + s / kLanes; }
  static int pair_coord(int s) { return (s % kLanes % 8) * NV + s / kLanes; }
};

template <>
struct Dec<4> : Interleaved<2> {
  static constexpr int NV = 2, CW = 32, W0 = 4, W1 = 0, B0 = 16, B1 = 0;
  using Tab = __m512;
  static Tab table(const float* l) { return _mm512_loadu_ps(l); }
  static void decode_bytes(__m128i b, const Tab& t, V* w) {
    const __m512i d = _mm512_cvtepu8_epi32(b);
    w[0] = _mm512_permutexvar_ps(d, t);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), t);
  }
  static void decode(const uint8_t* p0, const uint8_t*, const Tab& t, V* w) {
    decode_bytes(load16(p0), t, w);
  }
  static void decode_pair(const uint8_t* a0, const uint8_t* z0, const uint8_t*, const uint8_t*,
                          const Tab& t, V* w) {
    decode_bytes(load8x2(a0, z0), t, w);
  }
};

template <>
struct Dec<2> : Interleaved<4> {
  static constexpr int NV = 4, CW = 64, W0 = 2, W1 = 0, B0 = 16, B1 = 0;
  using Tab = __m512;
  static Tab table(const float* l) { return replicated(l, 4); }
  static void decode_bytes(__m128i b, const Tab& t, V* w) {
    const __m512i d = _mm512_cvtepu8_epi32(b);
    w[0] = _mm512_permutexvar_ps(d, t);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 2), t);
    w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), t);
    w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 6), t);
  }
  static void decode(const uint8_t* p0, const uint8_t*, const Tab& t, V* w) {
    decode_bytes(load16(p0), t, w);
  }
  static void decode_pair(const uint8_t* a0, const uint8_t* z0, const uint8_t*, const uint8_t*,
                          const Tab& t, V* w) {
    decode_bytes(load8x2(a0, z0), t, w);
  }
};

// 3 bits: a 2-bit plane (64 codes in 16 bytes) and a 1-bit plane (8 bytes). Code 4i + k
// has its bit 2 in plane-1 byte i / 2 at bit 4 * (i % 2) + k (in a pair: the first token's
// 4 bytes, then the second's).
template <>
struct Dec<3> : Interleaved<4> {
  static constexpr int NV = 4, CW = 64, W0 = 2, W1 = 1, B0 = 16, B1 = 8;
  using Tab = __m512;
  static Tab table(const float* l) { return replicated(l, 8); }
  static void decode_bytes(__m128i b0, __m128i b1, const Tab& t, V* w) {
    const __m512i d = _mm512_cvtepu8_epi32(b0);
    const __m512i h =
        _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b1, b1)),
                          _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0));
    const __m512i m = _mm512_set1_epi32(3);
    // 0xE4: the bits of the third operand (m) from the first, the others from the second.
    const auto idx = [&](__m512i lo, __m512i hi) {
      return _mm512_ternarylogic_epi32(lo, hi, m, 0xE4);
    };
    w[0] = _mm512_permutexvar_ps(idx(d, _mm512_slli_epi32(h, 2)), t);
    w[1] = _mm512_permutexvar_ps(idx(_mm512_srli_epi32(d, 2), _mm512_slli_epi32(h, 1)), t);
    w[2] = _mm512_permutexvar_ps(idx(_mm512_srli_epi32(d, 4), h), t);
    w[3] = _mm512_permutexvar_ps(idx(_mm512_srli_epi32(d, 6), _mm512_srli_epi32(h, 1)), t);
  }
  static void decode(const uint8_t* p0, const uint8_t* p1, const Tab& t, V* w) {
    decode_bytes(load16(p0), _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1)), t, w);
  }
  static void decode_pair(const uint8_t* a0, const uint8_t* z0, const uint8_t* a1,
                          const uint8_t* z1, const Tab& t, V* w) {
    decode_bytes(load8x2(a0, z0), _mm_unpacklo_epi32(_mm_cvtsi32_si128(load32(a1)),
                                                     _mm_cvtsi32_si128(load32(z1))), t, w);
  }
};

// 5 bits: a 4-bit plane (32 codes in 16 bytes) and a 1-bit plane (4 bytes). Code 2i + k
// has its bit 4 in plane-1 byte i / 4 at bit 2 * (i % 4) + k; vpermt2ps picks the upper
// 16 levels on index bit 4.
template <>
struct Dec<5> : Interleaved<2> {
  static constexpr int NV = 2, CW = 32, W0 = 4, W1 = 1, B0 = 16, B1 = 4;
  struct Tab {
    __m512 lo, hi;
  };
  static Tab table(const float* l) { return {_mm512_loadu_ps(l), _mm512_loadu_ps(l + 16)}; }
  static void decode_bytes(__m128i b0, int32_t b1, const Tab& t, V* w) {
    const __m512i d = _mm512_cvtepu8_epi32(b0);
    const __m128i b = _mm_shuffle_epi8(
        _mm_cvtsi32_si128(b1), _mm_set_epi8(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0));
    const __m512i h = _mm512_srlv_epi32(
        _mm512_cvtepu8_epi32(b), _mm512_set_epi32(6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0));
    const __m512i m = _mm512_set1_epi32(15);
    const __m512i i0 = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(h, 4), m, 0xE4);
    const __m512i i1 =
        _mm512_ternarylogic_epi32(_mm512_srli_epi32(d, 4), _mm512_slli_epi32(h, 3), m, 0xE4);
    w[0] = _mm512_permutex2var_ps(t.lo, i0, t.hi);
    w[1] = _mm512_permutex2var_ps(t.lo, i1, t.hi);
  }
  static void decode(const uint8_t* p0, const uint8_t* p1, const Tab& t, V* w) {
    decode_bytes(load16(p0), load32(p1), t, w);
  }
  static void decode_pair(const uint8_t* a0, const uint8_t* z0, const uint8_t* a1,
                          const uint8_t* z1, const Tab& t, V* w) {
    uint16_t lo, hi;
    std::memcpy(&lo, a1, 2);
    std::memcpy(&hi, z1, 2);
    decode_bytes(load8x2(a0, z0), static_cast<int32_t>(lo | (uint32_t{hi} << 16)), t, w);
  }
};

// 1 bit: 64 codes in 8 bytes, each 16-bit slice a blend mask (natural order: lane i of
// vector k holds code 16k + i; in a pair, lanes 0-7 / 8-15 of vector k hold byte k of
// each token's 4-byte half chunk).
template <>
struct Dec<1> {
  static constexpr int NV = 4, CW = 64, W0 = 1, W1 = 0, B0 = 8, B1 = 0;
  static int coord(int s) { return s; }
  static int pair_coord(int s) { return s / kLanes * 8 + s % 8; }
  struct Tab {
    __m512 l0, l1;
  };
  static Tab table(const float* l) { return {_mm512_set1_ps(l[0]), _mm512_set1_ps(l[1])}; }
  static void decode(const uint8_t* p0, const uint8_t*, const Tab& t, V* w) {
    uint64_t m;
    std::memcpy(&m, p0, 8);
    for (int k = 0; k < 4; ++k)
      w[k] = _mm512_mask_blend_ps(static_cast<__mmask16>(m >> (16 * k)), t.l0, t.l1);
  }
  static void decode_pair(const uint8_t* a0, const uint8_t* z0, const uint8_t*, const uint8_t*,
                          const Tab& t, V* w) {
    const uint32_t a = static_cast<uint32_t>(load32(a0)), z = static_cast<uint32_t>(load32(z0));
    for (int k = 0; k < 4; ++k)
      w[k] = _mm512_mask_blend_ps(
          static_cast<__mmask16>(((a >> (8 * k)) & 0xff) | (((z >> (8 * k)) & 0xff) << 8)),
          t.l0, t.l1);
  }
};

#include "kv_loops.inc"

}  // namespace tqkv::avx512

#pragma GCC pop_options

#endif  // x86-64
