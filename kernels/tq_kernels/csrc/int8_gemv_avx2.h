// The AVX2 variant of int8_gemv.h, for CPUs without AVX-512 (included by it, after the
// shared declarations): the same activations and levels, multiplied as llama.cpp does
// without VNNI: vpmaddubsw of |level| and x carrying the level's sign (vpsignb), pairs to
// int32 by vpmaddwd. |level|, |x| <= 127 keep the int16 pair sums below 2^15, and signed
// levels need no offset. 2-, 3- and 4-bit codes, and 8-bit ones on an affine grid.
#pragma once

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace tqcpu::i8gemv::avx2 {

// 64 rounded values (int32, natural order) as int8 in the chunk layout of `chunk_pos`.
inline void store_chunk(const __m256i (&v)[8], int bits, int8_t* out) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i a = _mm256_permutevar8x32_epi32(  // values 0-31, in order
      _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])), order);
  __m256i b = _mm256_permutevar8x32_epi32(  // values 32-63
      _mm256_packs_epi16(_mm256_packs_epi32(v[4], v[5]), _mm256_packs_epi32(v[6], v[7])), order);
  if (bits == 4) {  // even positions, then odd ones
    const __m256i eo = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    a = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(a, eo), 0xD8);  // E0 E1 O0 O1
    b = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(b, eo), 0xD8);  // E2 E3 O2 O3
    const __m256i even = _mm256_permute2x128_si256(a, b, 0x20), odd = _mm256_permute2x128_si256(a, b, 0x31);
    a = even;
    b = odd;
  } else if (bits != 8) {  // four runs of 16: run i holds positions 4j + i
    const __m256i by4 = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                         0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    a = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(a, by4), order);
    b = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(b, by4), order);
    const __m256i lo = _mm256_unpacklo_epi64(a, b), hi = _mm256_unpackhi_epi64(a, b);
    a = _mm256_permute2x128_si256(lo, hi, 0x20);  // runs 0, 1
    b = _mm256_permute2x128_si256(lo, hi, 0x31);  // runs 2, 3
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32), b);
}

// The same rounding as the AVX-512 `quantize` (float32 product, to nearest even), 8 values
// a vector; groups hold whole 64-value chunks (`fits`).
inline void quantize(const Problem& P, const float* xr, const Row& row) {
  const __m256 sign = _mm256_set1_ps(-0.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (int64_t g = 0; g < P.groups; ++g) {
    const int64_t c0 = g * P.group, c1 = std::min(P.n, c0 + P.group);
    __m256 m8 = _mm256_setzero_ps(), bad8 = _mm256_setzero_ps();
    for (int64_t c = c0; c < c1; c += 8) {
      const __m256 v = _mm256_loadu_ps(xr + c);
      m8 = _mm256_max_ps(m8, _mm256_andnot_ps(sign, v));
      bad8 = _mm256_add_ps(bad8, _mm256_sub_ps(v, v));  // NaN where v is NaN or infinite
    }
    alignas(32) float ms[8], bs[8];
    _mm256_store_ps(ms, m8);
    _mm256_store_ps(bs, bad8);
    float m = 0.f;
    bool bad = false;
    for (int k = 0; k < 8; ++k) m = std::max(m, ms[k]), bad = bad || std::isnan(bs[k]);
    const float inv = m > 0.f && std::isfinite(127.f / m) && !bad ? 127.f / m : 0.f;
    __m256i sum = _mm256_setzero_si256();
    const __m256 vinv = _mm256_set1_ps(inv);
    for (int64_t c = c0; c < c1; c += kChunk) {
      __m256i v[8];
      for (int k = 0; k < 8; ++k) {
        const __m256 q = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + c + 8 * k), vinv),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // 0 where inv is 0 (bad groups too: their products may be NaN)
        v[k] = inv > 0.f ? _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(q, lo), hi))
                         : _mm256_setzero_si256();
        sum = _mm256_add_epi32(sum, v[k]);
      }
      store_chunk(v, P.bits, row.q + c);
    }
    alignas(32) int32_t ss[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(ss), sum);
    row.scale[g] = bad ? NAN : inv > 0.f ? m / 127.f : 0.f;
    row.sum[g] = ss[0] + ss[1] + ss[2] + ss[3] + ss[4] + ss[5] + ss[6] + ss[7];
  }
}

// (avx2.h's hsum is compiled for BMI too, so it would not inline here)
inline float hsum8(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(p, _mm_movehdup_ps(p)));
}

template <int RT>
inline void dot_rows(const Problem& P, const Row& x, int64_t row, __m256i table, float step) {
  const int64_t groups = P.groups, group = P.group, chunks = group / kChunk;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* rp[RT];
  const uint16_t* sp[RT];
  __m256 tot[RT];
  for (int r = 0; r < RT; ++r) {
    rp[r] = P.codes + (row + r) * P.row_bytes;
    sp[r] = P.scales + (row + r) * groups;
    tot[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group;
    const int64_t nch = std::min(chunks, (P.n - c0) / kChunk);
    for (int r = 0; r < RT; ++r)
      for (int64_t off = 0; off < group / 2; off += 64)
        __builtin_prefetch(rp[r] + c0 / 2 + kPrefetch + off, 0, 2);
    __m256i acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t at = c0 + c * kChunk;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at + 32));
      for (int r = 0; r < RT; ++r) {
        const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[r] + at / 2));
        const __m256i wl = _mm256_shuffle_epi8(table, _mm256_and_si256(d, low4));
        const __m256i wh = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(d, 4), low4));
        const __m256i pl = _mm256_maddubs_epi16(_mm256_sign_epi8(wl, wl), _mm256_sign_epi8(x0, wl));
        const __m256i ph = _mm256_maddubs_epi16(_mm256_sign_epi8(wh, wh), _mm256_sign_epi8(x1, wh));
        // each pair sum is below 2^15, two of them are not: widen before adding
        acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(pl, ones),
                                                           _mm256_madd_epi16(ph, ones)));
      }
    }
    for (int r = 0; r < RT; ++r)
      tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                               _mm256_set1_ps(_cvtsh_ss(sp[r][g]) * x.scale[g]), tot[r]);
  }
  for (int r = 0; r < RT; ++r) P.y[row + r] = step * hsum8(tot[r]);
}

// 2- and 3-bit codes as the AVX-512 variant's dot_rows_small reads them, with AVX2's
// instructions: per-lane shifts of the broadcast plane-0 bytes, masked (vpshufb zeroes a
// byte whose index has bit 7 set); at 3 bits plane 1's nibbles go one to a byte first
// (pmovzxbw, a copy shifted by 4 blended into the odd bytes), then shifted per lane so
// that a code's bit 2 lands on bit 2.
template <int BITS, int RT>
inline void dot_rows_small(const Problem& P, const Row& x, int64_t row, __m256i table,
                           float step) {
  const int64_t groups = P.groups, group = P.group, chunks = group / kChunk;
  const __m256i s01 = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
  const __m256i s23 = _mm256_setr_epi32(4, 4, 4, 4, 6, 6, 6, 6);
  const __m256i h01 = _mm256_setr_epi32(2, 2, 2, 2, 1, 1, 1, 1);  // left: bit 0 or 1 -> 2
  const __m256i h23 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);  // right: bit 2 or 3 -> 2
  const __m256i low2 = _mm256_set1_epi8(3), bit2 = _mm256_set1_epi8(4);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i odd = _mm_set1_epi16(static_cast<int16_t>(0x8000));
  const uint8_t *p0[RT], *p1[RT];
  const uint16_t* sp[RT];
  __m256 tot[RT];
  for (int r = 0; r < RT; ++r) {
    p0[r] = P.codes + (row + r) * P.row_bytes;
    p1[r] = p0[r] + P.plane0_bytes;
    sp[r] = P.scales + (row + r) * groups;
    tot[r] = _mm256_setzero_ps();
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group;
    const int64_t nch = std::min(chunks, (P.n - c0) / kChunk);
    // the row's bytes in step with its groups, both planes (as int8_gemv.h)
    for (int r = 0; r < RT; ++r)
      for (int64_t off = 0; off < group * BITS / 8; off += 64)
        __builtin_prefetch(p0[r] + g * (group * BITS / 8) + kPrefetch + off, 0, 2);
    __m256i acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t at = c0 + c * kChunk;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at + 32));
      for (int r = 0; r < RT; ++r) {
        const __m256i d = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0[r] + at / 4)));
        __m256i i01 = _mm256_and_si256(_mm256_srlv_epi32(d, s01), low2);
        __m256i i23 = _mm256_and_si256(_mm256_srlv_epi32(d, s23), low2);
        if constexpr (BITS == 3) {
          const __m128i w = _mm_cvtepu8_epi16(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p1[r] + at / 8)));
          const __m256i h =
              _mm256_broadcastsi128_si256(_mm_blendv_epi8(w, _mm_slli_epi16(w, 4), odd));
          i01 = _mm256_or_si256(i01, _mm256_and_si256(_mm256_sllv_epi32(h, h01), bit2));
          i23 = _mm256_or_si256(i23, _mm256_and_si256(_mm256_srlv_epi32(h, h23), bit2));
        }
        const __m256i w01 = _mm256_shuffle_epi8(table, i01);
        const __m256i w23 = _mm256_shuffle_epi8(table, i23);
        const __m256i pa = _mm256_maddubs_epi16(_mm256_sign_epi8(w01, w01), _mm256_sign_epi8(x0, w01));
        const __m256i pb = _mm256_maddubs_epi16(_mm256_sign_epi8(w23, w23), _mm256_sign_epi8(x1, w23));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(pa, ones),
                                                           _mm256_madd_epi16(pb, ones)));
      }
    }
    for (int r = 0; r < RT; ++r)
      tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]),
                               _mm256_set1_ps(_cvtsh_ss(sp[r][g]) * x.scale[g]), tot[r]);
  }
  for (int r = 0; r < RT; ++r) P.y[row + r] = step * hsum8(tot[r]);
}

// 8-bit codes whose levels are an exact affine grid a + b k (the head's uniform codebook,
// P.affine): no lookup. vpmaddubsw multiplies |k - 128| (at most 128) by x carrying the
// sign of k - 128, so pair sums stay below 2^15; per group and row
// sum(x (a + b k)) = b sum(x (k - 128)) + (a + 128 b) sum(x), the second term from the
// group's sum of q. Exact up to groups of 2048 as above (each lane at most 256 * 128 * 127).
template <int RT>
inline void dot_rows8(const Problem& P, const Row& x, int64_t row) {
  const int64_t groups = P.groups, group = P.group, chunks = group / kChunk;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const uint8_t* rp[RT];
  const uint16_t* sp[RT];
  __m256 tot[RT];
  float sums[RT];
  for (int r = 0; r < RT; ++r) {
    rp[r] = P.codes + (row + r) * P.row_bytes;
    sp[r] = P.scales + (row + r) * groups;
    tot[r] = _mm256_setzero_ps();
    sums[r] = 0.f;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t c0 = g * group;
    const int64_t nch = std::min(chunks, (P.n - c0) / kChunk);
    for (int r = 0; r < RT; ++r)
      for (int64_t off = 0; off < group; off += 64)
        __builtin_prefetch(rp[r] + c0 + kPrefetch + off, 0, 2);
    __m256i acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = _mm256_setzero_si256();
    for (int64_t c = 0; c < nch; ++c) {
      const int64_t at = c0 + c * kChunk;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + at + 32));
      for (int r = 0; r < RT; ++r) {
        const __m256i k0 = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[r] + at)), flip);
        const __m256i k1 = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp[r] + at + 32)), flip);
        const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(k0, k0), _mm256_sign_epi8(x0, k0));
        const __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(k1, k1), _mm256_sign_epi8(x1, k1));
        acc[r] = _mm256_add_epi32(acc[r], _mm256_add_epi32(_mm256_madd_epi16(p0, ones),
                                                           _mm256_madd_epi16(p1, ones)));
      }
    }
    for (int r = 0; r < RT; ++r) {
      const float s = _cvtsh_ss(sp[r][g]) * x.scale[g];
      tot[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_set1_ps(s), tot[r]);
      sums[r] = std::fma(s, static_cast<float>(x.sum[g]), sums[r]);  // as int8_gemv.h
    }
  }
  const float a = P.affine[0], b = P.affine[1];
  for (int r = 0; r < RT; ++r) {
    const float shift = (a + 128.f * b) * sums[r];
    P.y[row + r] = std::fma(b, hsum8(tot[r]), shift);
  }
}

// (qualified calls: the arguments' namespace holds the AVX-512 templates of these names)
inline void rows(const Problem& P, const Row& x, int64_t r0, int64_t r1) {
  int64_t r = r0;
  if (P.bits == 8) {
    for (; r + kRows <= r1; r += kRows) avx2::dot_rows8<kRows>(P, x, r);
    for (; r < r1; ++r) avx2::dot_rows8<1>(P, x, r);
    return;
  }
  alignas(32) uint8_t bytes[32];
  const float step = level_table(P.codebook, P.bits, bytes, 0);
  const __m256i table = _mm256_load_si256(reinterpret_cast<const __m256i*>(bytes));
  if (P.bits == 2) {
    for (; r + kRows <= r1; r += kRows) avx2::dot_rows_small<2, kRows>(P, x, r, table, step);
    for (; r < r1; ++r) avx2::dot_rows_small<2, 1>(P, x, r, table, step);
  } else if (P.bits == 3) {
    for (; r + kRows <= r1; r += kRows) avx2::dot_rows_small<3, kRows>(P, x, r, table, step);
    for (; r < r1; ++r) avx2::dot_rows_small<3, 1>(P, x, r, table, step);
  } else {
    for (; r + kRows <= r1; r += kRows) avx2::dot_rows<kRows>(P, x, r, table, step);
    for (; r < r1; ++r) avx2::dot_rows<1>(P, x, r, table, step);
  }
}

}  // namespace tqcpu::i8gemv::avx2

#pragma GCC pop_options
