// The KV kernel's AVX2 variant (with FMA): the design of kv_avx512.h on 8 lanes. vpermps
// on ymm reads 3 index bits, so 4 and 8 levels are one permute (4 replicated twice), 16
// levels are two permutes blended on index bit 3, 32 levels four permutes and two blends;
// 1-bit codes are compare masks in natural order.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "kv_common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")

namespace tqkv::avx2 {

using V = __m256;
constexpr int kLanes = 8;
constexpr int kRegs = 8;  // of 16 ymm registers, for accumulators
constexpr int kAccRegs = kRegs;
constexpr bool kPairScore = false;

inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }

inline void store_n(float* p, V v, int n) {
  if (n == kLanes) {
    _mm256_storeu_ps(p, v);
    return;
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  std::memcpy(p, t, n * sizeof(float));
}

// |s| of n (at most 8) fp16 scales s[0], s[stride], ...; 0 in the other lanes.
inline V scales_abs(const uint16_t* s, int64_t stride, int n) {
  __m128i h;
  if (stride == 1 && n == kLanes) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  } else {
    alignas(16) uint16_t t[8] = {};
    for (int i = 0; i < n; ++i) t[i] = s[i * stride];
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  }
  return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(0x7fff)));
}

// Lane i of the result: the sum of a[i]'s 8 lanes.
inline V tsum(const V* a) {
  V b[4], c[2];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(b[2 * i]), y = _mm256_castps_pd(b[2 * i + 1]);
    c[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20),
                       _mm256_permute2f128_ps(c[0], c[1], 0x31));
}
inline V tsum_pairs(const V* a) { return tsum(a); }  // unused: no pair score here

inline __m256 replicated(const float* levels, int n) {
  alignas(32) float t[8];
  for (int i = 0; i < 8; ++i) t[i] = levels[i % n];
  return _mm256_load_ps(t);
}

inline __m256i load8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// levels lo[i & 7] or hi[i & 7] by bit 3 of i.
inline __m256 lookup16(__m256i i, __m256 lo, __m256 hi) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, i), _mm256_permutevar8x32_ps(hi, i),
                          _mm256_castsi256_ps(_mm256_slli_epi32(i, 28)));
}

template <int BITS>
struct Dec;

// Interleaved layouts (2-, 4-bit planes): lane i of vector k holds chunk code i * NV + k.
template <int NV>
struct Interleaved {
  static int coord(int s) { return (s % kLanes) * NV + s / kLanes; }
};

template <>
struct Dec<4> : Interleaved<2> {
  static constexpr int NV = 2, CW = 16, W0 = 4, W1 = 0, B0 = 8, B1 = 0;
  struct Tab {
    __m256 lo, hi;
  };
  static Tab table(const float* l) { return {_mm256_loadu_ps(l), _mm256_loadu_ps(l + 8)}; }
  static void decode(const uint8_t* p0, const uint8_t*, const Tab& t, V* w) {
    const __m256i d = load8(p0);
    w[0] = lookup16(d, t.lo, t.hi);
    w[1] = lookup16(_mm256_srli_epi32(d, 4), t.lo, t.hi);
  }
};

template <>
struct Dec<2> : Interleaved<4> {
  static constexpr int NV = 4, CW = 32, W0 = 2, W1 = 0, B0 = 8, B1 = 0;
  using Tab = __m256;
  static Tab table(const float* l) { return replicated(l, 4); }
  static void decode(const uint8_t* p0, const uint8_t*, const Tab& t, V* w) {
    const __m256i d = load8(p0);
    w[0] = _mm256_permutevar8x32_ps(t, d);
    w[1] = _mm256_permutevar8x32_ps(t, _mm256_srli_epi32(d, 2));
    w[2] = _mm256_permutevar8x32_ps(t, _mm256_srli_epi32(d, 4));
    w[3] = _mm256_permutevar8x32_ps(t, _mm256_srli_epi32(d, 6));
  }
};

// 3 bits: code 4i + k has its bit 2 in plane-1 byte i / 2 at bit 4 * (i % 2) + k.
template <>
struct Dec<3> : Interleaved<4> {
  static constexpr int NV = 4, CW = 32, W0 = 2, W1 = 1, B0 = 8, B1 = 4;
  using Tab = __m256;
  static Tab table(const float* l) { return _mm256_loadu_ps(l); }
  static void decode(const uint8_t* p0, const uint8_t* p1, const Tab& t, V* w) {
    const __m256i d = load8(p0);
    int32_t bits;
    std::memcpy(&bits, p1, 4);
    const __m128i b = _mm_cvtsi32_si128(bits);
    const __m256i h = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)),
                                        _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0));
    const __m256i m3 = _mm256_set1_epi32(3), m4 = _mm256_set1_epi32(4);
    const auto idx = [&](__m256i lo, __m256i hi) {
      return _mm256_or_si256(_mm256_and_si256(lo, m3), _mm256_and_si256(hi, m4));
    };
    w[0] = _mm256_permutevar8x32_ps(t, idx(d, _mm256_slli_epi32(h, 2)));
    w[1] = _mm256_permutevar8x32_ps(t, idx(_mm256_srli_epi32(d, 2), _mm256_slli_epi32(h, 1)));
    w[2] = _mm256_permutevar8x32_ps(t, idx(_mm256_srli_epi32(d, 4), h));
    w[3] = _mm256_permutevar8x32_ps(t, idx(_mm256_srli_epi32(d, 6), _mm256_srli_epi32(h, 1)));
  }
};

// 5 bits: code 2i + k has its bit 4 in plane-1 byte i / 4 at bit 2 * (i % 4) + k.
template <>
struct Dec<5> : Interleaved<2> {
  static constexpr int NV = 2, CW = 16, W0 = 4, W1 = 1, B0 = 8, B1 = 2;
  struct Tab {
    __m256 l[4];
  };
  static Tab table(const float* l) {
    return {{_mm256_loadu_ps(l), _mm256_loadu_ps(l + 8), _mm256_loadu_ps(l + 16),
             _mm256_loadu_ps(l + 24)}};
  }
  static void decode(const uint8_t* p0, const uint8_t* p1, const Tab& t, V* w) {
    const __m256i d = load8(p0);
    uint16_t bits;
    std::memcpy(&bits, p1, 2);
    const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128(bits),
                                       _mm_set_epi8(-1, -1, -1, -1, -1, -1, -1, -1,
                                                    1, 1, 1, 1, 0, 0, 0, 0));
    const __m256i h = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(b),
                                        _mm256_set_epi32(6, 4, 2, 0, 6, 4, 2, 0));
    const __m256i i0 = d, i1 = _mm256_srli_epi32(d, 4);
    w[0] = _mm256_blendv_ps(lookup16(i0, t.l[0], t.l[1]), lookup16(i0, t.l[2], t.l[3]),
                            _mm256_castsi256_ps(_mm256_slli_epi32(h, 31)));
    w[1] = _mm256_blendv_ps(lookup16(i1, t.l[0], t.l[1]), lookup16(i1, t.l[2], t.l[3]),
                            _mm256_castsi256_ps(_mm256_slli_epi32(h, 30)));
  }
};

// 1 bit: 32 codes in 4 bytes, natural order; lane i of vector k tests bit 8k + i.
template <>
struct Dec<1> {
  static constexpr int NV = 4, CW = 32, W0 = 1, W1 = 0, B0 = 4, B1 = 0;
  static int coord(int s) { return s; }
  struct Tab {
    __m256 l0, l1;
  };
  static Tab table(const float* l) { return {_mm256_set1_ps(l[0]), _mm256_set1_ps(l[1])}; }
  static void decode(const uint8_t* p0, const uint8_t*, const Tab& t, V* w) {
    int32_t bits;
    std::memcpy(&bits, p0, 4);
    const __m256i v = _mm256_set1_epi32(bits);
    const __m256i one = _mm256_set_epi32(128, 64, 32, 16, 8, 4, 2, 1);
    for (int k = 0; k < 4; ++k) {
      const __m256i bit = _mm256_slli_epi32(one, 8 * k);
      const __m256i m = _mm256_cmpeq_epi32(_mm256_and_si256(v, bit), bit);
      w[k] = _mm256_blendv_ps(t.l0, t.l1, _mm256_castsi256_ps(m));
    }
  }
};

#include "kv_loops.inc"

}  // namespace tqkv::avx2

#pragma GCC pop_options

#endif  // x86-64
