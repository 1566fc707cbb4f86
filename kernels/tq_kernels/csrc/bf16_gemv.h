// The decode GEMV (one activation row) of 2-, 3- and 4-bit layers with bf16 dot products, for CPUs
// with AVX512-BF16: the same products class as the prefill's bf16 GEMM (gemm_path.inc),
// chosen by the same switch (tq_kernels.cpu.gemm_precision; TQ_CPU_GEMM=fp32 keeps float32
// products everywhere).
//
// The float32 GEMV (rows.inc) decodes 32 codes with a vpmovzxbd and two vpermps per
// 16-lane FMA pair: three shuffle-port instructions per 32 weights, which caps it at about
// 21 G weights/s a core here. Here 64 codes are one vpmovzxbw and two vpermw lookups into
// the codebook rounded to bf16, and two vdpbf16ps (32 products each, float32
// accumulation): about 1.5x the weights per cycle (a scratch benchmark of both inner
// loops on this machine's shapes: 31-34 against 21-23 G weights/s, one core).
//
// Layout: the codes are the packed rows as they are (byte b of a row holds codes 2b and
// 2b+1), so for each 64-code chunk the activations go as 32 bf16 values at even
// positions, then 32 at odd ones (`to_layout`). Groups must hold whole chunks and rows
// no partial chunk (`fits`); other layers keep the float32 GEMV.
#pragma once
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__) && \
    (__GNUC__ >= 10 || defined(__clang__))
#define TQ_BF16_GEMV 1

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "common.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")

namespace tqcpu::bf16gemv {

constexpr int64_t kChunk = 64;
constexpr int kRows = 4;  // weight rows per pass over x
constexpr int64_t kPrefetch = 8192;  // as rows.inc: bytes ahead of each row's group

inline bool fits(const Problem& P) {
  return P.bits >= 2 && P.bits <= 4 && P.n % kChunk == 0 && P.group % kChunk == 0 &&
         P.affine == nullptr;
}

// xr (rotated, natural order, n floats) -> xb: per chunk, bf16 (round to nearest even) of
// the 32 even-position values, then the 32 odd ones.
inline void to_layout(const float* xr, uint16_t* xb, int64_t n) {
  alignas(64) static constexpr int32_t even[16] = {0, 2, 4, 6, 8, 10, 12, 14,
                                                   16, 18, 20, 22, 24, 26, 28, 30};
  const __m512i e = _mm512_load_si512(even), o = _mm512_add_epi32(e, _mm512_set1_epi32(1));
  for (int64_t c = 0; c < n; c += kChunk) {
    const __m512 a = _mm512_loadu_ps(xr + c), b = _mm512_loadu_ps(xr + c + 16);
    const __m512 d = _mm512_loadu_ps(xr + c + 32), f = _mm512_loadu_ps(xr + c + 48);
    const __m512bh ev = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(d, e, f),
                                            _mm512_permutex2var_ps(a, e, b));
    const __m512bh od = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(d, o, f),
                                            _mm512_permutex2var_ps(a, o, b));
    std::memcpy(xb + c, &ev, 64);
    std::memcpy(xb + c + 32, &od, 64);
  }
}

// The same for 2- and 3-bit codes (four codes per plane-0 byte): per chunk, four runs of
// 16 bf16 values, run k holding positions 4j + k.
inline void to_layout4(const float* xr, uint16_t* xb, int64_t n) {
  alignas(64) static constexpr int32_t stride4[16] = {0, 4, 8, 12, 16, 20, 24, 28,
                                                      0, 4, 8, 12, 16, 20, 24, 28};
  const __m512i base = _mm512_load_si512(stride4);
  for (int64_t c = 0; c < n; c += kChunk) {
    const __m512 a = _mm512_loadu_ps(xr + c), b = _mm512_loadu_ps(xr + c + 16);
    const __m512 d = _mm512_loadu_ps(xr + c + 32), f = _mm512_loadu_ps(xr + c + 48);
    for (int k = 0; k < 4; ++k) {
      const __m512i idx = _mm512_add_epi32(base, _mm512_set1_epi32(k));
      const __m512 lo = _mm512_permutex2var_ps(a, idx, b), hi = _mm512_permutex2var_ps(d, idx, f);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_shuffle_f32x4(lo, hi, 0x44));
      std::memcpy(xb + c + 16 * k, &h, 32);
    }
  }
}

// The 4 or 8 levels rounded to bf16, repeated over 16 entries: a 256-bit vpermw reads 4
// index bits, and the bits above a code's own are another code's (or plane 1's).
inline __m256i codebook_words16(const float* cb, int bits) {
  alignas(64) float t[16];
  for (int i = 0; i < 16; ++i) t[i] = cb[i % (1 << bits)];
  const __m256bh w = _mm512_cvtneps_pbh(_mm512_load_ps(t));
  __m256i out;
  std::memcpy(&out, &w, 32);
  return out;
}

// The 16 levels rounded to bf16, twice over: vpermw reads 5 index bits, and bit 4 of a
// byte's low nibble index is its high nibble's bit 0.
inline __m512i codebook_words(const float* cb) {
  alignas(64) float t[32];
  for (int i = 0; i < 32; ++i) t[i] = cb[i % 16];
  const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_load_ps(t + 16), _mm512_load_ps(t));
  __m512i out;
  std::memcpy(&out, &w, 64);
  return out;
}

template <int RT>
inline void dot_rows(const Problem& P, const uint16_t* xb, int64_t row, __m512i cb) {
  const int64_t groups = P.groups, group = P.group, chunks = group / kChunk;
  const uint8_t* rp[RT];
  const uint16_t* sp[RT];
  __m512 tot[RT];
  for (int r = 0; r < RT; ++r) {
    rp[r] = P.codes + (row + r) * P.row_bytes;
    sp[r] = P.scales + (row + r) * groups;
    tot[r] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group;
    const int64_t nch = std::min(chunks, (P.n - c0) / kChunk);
    for (int r = 0; r < RT; ++r)
      for (int64_t off = 0; off < group / 2; off += 64)
        __builtin_prefetch(rp[r] + c0 / 2 + kPrefetch + off, 0, 2);
    __m512 lo[RT], hi[RT];
    for (int r = 0; r < RT; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t at = c0 + c * kChunk;
      __m512bh x0, x1;
      std::memcpy(&x0, xb + at, 64);
      std::memcpy(&x1, xb + at + 32, 64);
      for (int r = 0; r < RT; ++r) {
        const __m512i d = _mm512_cvtepu8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[r] + at / 2)));
        const __m512i wl = _mm512_permutexvar_epi16(d, cb);
        const __m512i wh = _mm512_permutexvar_epi16(_mm512_srli_epi16(d, 4), cb);
        __m512bh bl, bh;
        std::memcpy(&bl, &wl, 64);
        std::memcpy(&bh, &wh, 64);
        lo[r] = _mm512_dpbf16_ps(lo[r], bl, x0);
        hi[r] = _mm512_dpbf16_ps(hi[r], bh, x1);
      }
    }
    for (int r = 0; r < RT; ++r)
      tot[r] = _mm512_fmadd_ps(_mm512_add_ps(lo[r], hi[r]),
                               _mm512_set1_ps(_cvtsh_ss(sp[r][g])), tot[r]);
  }
  for (int r = 0; r < RT; ++r) P.y[row + r] = _mm512_reduce_add_ps(tot[r]);
}

// One 64-code chunk of 2- or 3-bit codes as four vectors of 16 bf16 levels, vector k
// holding codes 4j + k: plane-0 byte j has their low two bits at bits 2k, plane 1 (3-bit)
// their bit 2 in nibble j (as avx512.h's decode<3>).
template <int BITS>
inline void decode_small(const uint8_t* p0, const uint8_t* p1, __m256i cb, __m256bh* w) {
  const __m256i d = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0)));
  __m256i idx[4];
  if constexpr (BITS == 2) {
    for (int k = 0; k < 4; ++k) idx[k] = _mm256_srli_epi16(d, 2 * k);
  } else {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1));
    b = _mm_unpacklo_epi8(b, b);
    const __m256i h = _mm256_srlv_epi16(_mm256_cvtepu8_epi16(b),
                                        _mm256_set_epi16(4, 0, 4, 0, 4, 0, 4, 0,
                                                         4, 0, 4, 0, 4, 0, 4, 0));
    const __m256i low2 = _mm256_set1_epi16(3);
    // 0xCA: (low2 ? plane-0 bits : plane-1 bits); bit k of h lands on bit 2
    idx[0] = _mm256_ternarylogic_epi32(low2, d, _mm256_slli_epi16(h, 2), 0xCA);
    idx[1] = _mm256_ternarylogic_epi32(low2, _mm256_srli_epi16(d, 2), _mm256_slli_epi16(h, 1),
                                       0xCA);
    idx[2] = _mm256_ternarylogic_epi32(low2, _mm256_srli_epi16(d, 4), h, 0xCA);
    idx[3] = _mm256_ternarylogic_epi32(low2, _mm256_srli_epi16(d, 6), _mm256_srli_epi16(h, 1),
                                       0xCA);
  }
  for (int k = 0; k < 4; ++k) {
    const __m256i v = _mm256_permutexvar_epi16(idx[k], cb);
    std::memcpy(&w[k], &v, 32);
  }
}

template <int BITS, int RT>
inline void dot_rows_small(const Problem& P, const uint16_t* xb, int64_t row, __m256i cb) {
  const int64_t groups = P.groups, group = P.group, chunks = group / kChunk;
  const uint8_t *r0[RT], *r1[RT];
  const uint16_t* sp[RT];
  __m256 tot[RT];
  for (int r = 0; r < RT; ++r) {
    r0[r] = P.codes + (row + r) * P.row_bytes;
    r1[r] = r0[r] + P.plane0_bytes;
    sp[r] = P.scales + (row + r) * groups;
    tot[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group;
    const int64_t nch = std::min(chunks, (P.n - c0) / kChunk);
    // 3 bits: the row's bytes in step with its groups, both planes (as int8_gemv.h)
    const int64_t span = BITS == 3 ? group * 3 / 8 : group / 4;
    for (int r = 0; r < RT; ++r)
      for (int64_t off = 0; off < span; off += 64)
        __builtin_prefetch(r0[r] + g * span + kPrefetch + off, 0, 2);
    __m256 acc[RT][2];
    for (int r = 0; r < RT; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t at = c0 + c * kChunk;
      __m256bh x[4];
      std::memcpy(x, xb + at, 128);
      for (int r = 0; r < RT; ++r) {
        __m256bh w[4];
        decode_small<BITS>(r0[r] + at / 4, r1[r] + at / 8, cb, w);
        acc[r][0] = _mm256_dpbf16_ps(acc[r][0], w[0], x[0]);
        acc[r][1] = _mm256_dpbf16_ps(acc[r][1], w[1], x[1]);
        acc[r][0] = _mm256_dpbf16_ps(acc[r][0], w[2], x[2]);
        acc[r][1] = _mm256_dpbf16_ps(acc[r][1], w[3], x[3]);
      }
    }
    for (int r = 0; r < RT; ++r)
      tot[r] = _mm256_fmadd_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                               _mm256_set1_ps(_cvtsh_ss(sp[r][g])), tot[r]);
  }
  for (int r = 0; r < RT; ++r) {
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(tot[r]), _mm256_extractf128_ps(tot[r], 1));
    const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
    P.y[row + r] = _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
  }
}

template <int BITS>
inline void rows_small(const Problem& P, const uint16_t* xb, int64_t r0, int64_t r1) {
  const __m256i cb = codebook_words16(P.codebook, BITS);
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) dot_rows_small<BITS, kRows>(P, xb, r, cb);
  for (; r < r1; ++r) dot_rows_small<BITS, 1>(P, xb, r, cb);
}

// The activation row in this path's layout for P's width.
inline void layout(const Problem& P, const float* xr, uint16_t* xb) {
  if (P.bits == 4) to_layout(xr, xb, P.n);
  else to_layout4(xr, xb, P.n);
}

// y[r0:r1] for one activation row (P.M == 1) from xb (`layout`).
inline void rows(const Problem& P, const uint16_t* xb, int64_t r0, int64_t r1) {
  if (P.bits == 2) return rows_small<2>(P, xb, r0, r1);
  if (P.bits == 3) return rows_small<3>(P, xb, r0, r1);
  const __m512i cb = codebook_words(P.codebook);
  int64_t r = r0;
  for (; r + kRows <= r1; r += kRows) dot_rows<kRows>(P, xb, r, cb);
  for (; r < r1; ++r) dot_rows<1>(P, xb, r, cb);
}

}  // namespace tqcpu::bf16gemv

#pragma GCC pop_options
#endif
