// The AVX2 variant (with FMA and F16C) for 2, 3, 4 and 8-bit codes: the same design as
// avx512.h on 8 lanes. vpermps on ymm reads 3 index bits, so 8 levels are one permute,
// 4 levels are replicated twice, and 16 levels are two permutes blended on index bit 3.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2")

namespace tqcpu::avx2 {

using V = __m256;
constexpr int kLanes = 8;
constexpr int kRowTile = 1;  // 16 registers: no room for a second weight row
constexpr int kDecodeRowTile = 1;

inline V vzero() { return _mm256_setzero_ps(); }
inline V vset1(float f) { return _mm256_set1_ps(f); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vfmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float half(uint16_t h) { return _cvtsh_ss(h); }

// k <= 8 fp16 values from p as floats (lanes past k zero; nothing past p + k is read).
inline V vhalves(const uint16_t* p, int64_t k) {
  alignas(16) uint16_t t[8] = {};
  std::memcpy(t, p, k * sizeof(uint16_t));
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

struct Codebook {
  __m256 lo, hi;  // levels 0-7 and 8-15 (2- and 3-bit: replicated into lo)
};

inline Codebook codebook_registers(const float* cb, int bits) {
  alignas(32) float t[16];
  const int levels = 1 << std::min(bits, 4);
  for (int i = 0; i < 16; ++i) t[i] = cb[i % levels];
  return {_mm256_load_ps(t), _mm256_load_ps(t + 8)};
}

inline __m256 lookup16(__m256i i, const Codebook& cb) {
  const __m256 bit3 = _mm256_castsi256_ps(_mm256_slli_epi32(i, 28));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(cb.lo, i),
                          _mm256_permutevar8x32_ps(cb.hi, i), bit3);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// k fp16 values to floats, 8 at a time.
void halves_to_floats(const uint16_t* h, float* f, int64_t k) {
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    _mm256_storeu_ps(f + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < k; ++i) f[i] = _cvtsh_ss(h[i]);
}

template <int RT>
inline void hsums(const V (&t)[RT], float* y) {
  for (int r = 0; r < RT; ++r) y[r] = hsum(t[r]);
}

// Walsh-Hadamard stages h = 1, 2, 4 inside one vector (see avx512.h).
inline V butterflies_in_vector(V v) {
  const __m256i iota = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);
  V p = _mm256_permutevar8x32_ps(v, _mm256_xor_si256(iota, _mm256_set1_epi32(1)));
  v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xAA);
  p = _mm256_permutevar8x32_ps(v, _mm256_xor_si256(iota, _mm256_set1_epi32(2)));
  v = _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xCC);
  p = _mm256_permutevar8x32_ps(v, _mm256_xor_si256(iota, _mm256_set1_epi32(4)));
  return _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), 0xF0);
}

template <int BITS>
inline void decode(const uint8_t* p0, const uint8_t* p1, const Codebook& cb, const float* cbp,
                   __m256* w) {
  const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p0)));
  if constexpr (BITS == 4) {
    w[0] = lookup16(d, cb);
    w[1] = lookup16(_mm256_srli_epi32(d, 4), cb);
  } else if constexpr (BITS == 2) {
    w[0] = _mm256_permutevar8x32_ps(cb.lo, d);
    w[1] = _mm256_permutevar8x32_ps(cb.lo, _mm256_srli_epi32(d, 2));
    w[2] = _mm256_permutevar8x32_ps(cb.lo, _mm256_srli_epi32(d, 4));
    w[3] = _mm256_permutevar8x32_ps(cb.lo, _mm256_srli_epi32(d, 6));
  } else if constexpr (BITS == 3) {
    // Plane 1 holds bit 2 of codes 4j..4j+3 in nibble j: byte j/2, shifted by 4 if j odd.
    uint32_t raw;
    std::memcpy(&raw, p1, 4);
    __m128i b = _mm_cvtsi32_si128(static_cast<int>(raw));
    b = _mm_unpacklo_epi8(b, b);
    const __m256i h = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(b),
                                        _mm256_set_epi32(4, 0, 4, 0, 4, 0, 4, 0));
    const __m256i low2 = _mm256_set1_epi32(3);
    // Index bits 0-1 from plane 0, bit 2 from plane 1; vpermps ignores bits 3 and up.
    w[0] = _mm256_permutevar8x32_ps(
        cb.lo, _mm256_or_si256(_mm256_and_si256(d, low2), _mm256_slli_epi32(h, 2)));
    w[1] = _mm256_permutevar8x32_ps(
        cb.lo, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(d, 2), low2),
                               _mm256_slli_epi32(_mm256_srli_epi32(h, 1), 2)));
    w[2] = _mm256_permutevar8x32_ps(
        cb.lo, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(d, 4), low2),
                               _mm256_slli_epi32(_mm256_srli_epi32(h, 2), 2)));
    w[3] = _mm256_permutevar8x32_ps(
        cb.lo, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(d, 6), low2),
                               _mm256_slli_epi32(_mm256_srli_epi32(h, 3), 2)));
  } else if constexpr (BITS == kAffine8) {  // cbp = {a, b}: fma(k, b, a), the exact levels
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(cbp[1]),
                           _mm256_set1_ps(cbp[0]));
  } else {
    w[0] = _mm256_i32gather_ps(cbp, d, 4);
  }
}

// x into the chunk layout for one chunk of 8 * NV values (common.h, Layout): lane j of
// output vector k takes r[j * NV + k]. A plain loop: AVX2 is the fallback variant.
template <int NV>
inline void permute_chunk(const float* r, float* q) {
  for (int k = 0; k < NV; ++k)
    for (int j = 0; j < kLanes; ++j) q[k * kLanes + j] = r[j * NV + k];
}

// kLanes int8 signs (+-1) as floats.
inline V vsigns(const int8_t* s) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s))));
}

#include "rows.inc"

}  // namespace tqcpu::avx2

#pragma GCC pop_options

#endif  // x86-64
