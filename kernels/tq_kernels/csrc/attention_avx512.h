// Attention of one query head over a run of cached positions, float32, AVX-512: what a
// compiled decode step's attention does per head (decode_attention.inc), without SDPA's
// per-call setup (its flash kernel sizes and allocates blocks for every call): 21 us for
// SmolLM2's 9 heads over 160 positions against 10.5 here. Scores are q.k scaled, the
// softmax subtracts their maximum and exponentiates with Cephes' expf polynomial, then
// sum(p v) / sum(p) (tests/test_cpu_kernel.py bounds the error against float64 SDPA). Positions the mask leaves
// out take no part (p = 0 exactly). Compiled under a target pragma; called only after a
// runtime CPU check.
#pragma once
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

namespace tqcpu::attention512 {

// e^x for x <= 0 (scores minus their maximum): 2^n e^r with n = round(x / ln 2) and
// r = x - n ln 2 (Cody-Waite, two parts), e^r = 1 + r + r^2 P(r) (Cephes expf).
// Below -87 the result is flushed to 0, as the true value underflows.
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// out[0:D] = softmax(scale q.k_s over the run) . v_s for one head; D a multiple of 16,
// at most 256. k and v: the run's first position, rows `ks` / `vs` floats apart. keep:
// null (every position attends) or the run's mask; scores: room for len floats.
inline void head(const float* q, const float* k, int64_t ks, const float* v, int64_t vs,
                 const bool* keep, int64_t len, int64_t D, float scale, float* scores,
                 float* out) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const int64_t nv = D / 16;
  __m512 qv[16];
  for (int64_t j = 0; j < nv; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
  float top = kNegInf;
  for (int64_t s = 0; s < len; ++s) {
    if (keep != nullptr && !keep[s]) {
      scores[s] = kNegInf;
      continue;
    }
    const float* ks_row = k + s * ks;
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(ks_row));
    for (int64_t j = 1; j < nv; ++j)
      acc = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(ks_row + 16 * j), acc);
    const float sc = _mm512_reduce_add_ps(acc) * scale;
    scores[s] = sc;
    top = std::max(top, sc);
  }
  const __m512 topv = _mm512_set1_ps(top);
  __m512 sum = _mm512_setzero_ps();
  int64_t s = 0;
  for (; s + 16 <= len; s += 16) {
    const __m512 p = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(scores + s), topv));
    _mm512_storeu_ps(scores + s, p);
    sum = _mm512_add_ps(sum, p);
  }
  if (s < len) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (len - s)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(tail, scores + s);
    const __m512 p = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(x, topv)));
    _mm512_mask_storeu_ps(scores + s, tail, p);
    sum = _mm512_add_ps(sum, p);
  }
  __m512 acc[16];
  for (int64_t j = 0; j < nv; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    if (scores[t] == 0.0f) continue;  // masked out (or underflowed): adds nothing
    const __m512 p = _mm512_set1_ps(scores[t]);
    const float* v_row = v + t * vs;
    for (int64_t j = 0; j < nv; ++j)
      acc[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v_row + 16 * j), acc[j]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(acc[j], inv));
}

}  // namespace tqcpu::attention512

#pragma GCC pop_options

#endif  // x86-64
