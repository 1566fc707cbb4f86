// The portable variant: any code width 1-8, any group size, no SIMD assumptions. It is
// what runs on CPUs without AVX2 (and on other architectures), and the layout it reads
// (xp = x, zero-padded to npad) is the identity.
#pragma once

#include <vector>

#include "common.h"

namespace tqcpu::scalar {

// One row's codes, plane by plane (docs/format.md, "Packed codes").
inline void unpack_row(const Problem& P, const uint8_t* row, uint8_t* code) {
  const Planes pl = planes_for(P.bits);
  std::memset(code, 0, P.npad);
  int64_t offset = 0;
  int shift = 0;
  for (int p = 0; p < pl.count; ++p) {
    const int w = pl.width[p];
    const int mask = (1 << w) - 1;
    for (int64_t c = 0; c < P.npad; ++c) {
      const int bit = static_cast<int>((c * w) % 8);
      code[c] |= static_cast<uint8_t>(((row[offset + c * w / 8] >> bit) & mask) << shift);
    }
    offset += P.npad * w / 8;
    shift += w;
  }
}

inline void gemv_rows(const Problem& P, int64_t r0, int64_t r1) {
  std::vector<uint8_t> code(P.npad);
  for (int64_t r = r0; r < r1; ++r) {
    unpack_row(P, P.codes + r * P.row_bytes, code.data());
    const uint16_t* srow = P.scales + r * P.groups;
    for (int64_t m = 0; m < P.M; ++m) {
      const float* x = P.xp + m * P.K;
      float total = 0.f;
      for (int64_t g = 0; g < P.groups; ++g) {
        const int64_t c0 = g * P.group, c1 = std::min(P.n, c0 + P.group);
        float acc = 0.f;
        for (int64_t c = c0; c < c1; ++c) acc += P.codebook[code[c]] * x[c];
        total += acc * half_to_float(srow[g]);
      }
      P.y[m * P.ldy + r] = total;
    }
  }
}

// Rows r0..r1 of W (natural column order, K = npad columns, zero past n) into W[0..].
inline void dequant_rows(const Problem& P, float* W, int64_t ldw, int64_t r0, int64_t r1) {
  std::vector<uint8_t> code(P.npad);
  for (int64_t r = r0; r < r1; ++r) {
    unpack_row(P, P.codes + r * P.row_bytes, code.data());
    const uint16_t* srow = P.scales + r * P.groups;
    float* out = W + (r - r0) * ldw;
    for (int64_t g = 0; g < P.groups; ++g) {
      const int64_t c0 = g * P.group, c1 = std::min(P.n, c0 + P.group);
      const float s = half_to_float(srow[g]);
      for (int64_t c = c0; c < c1; ++c) out[c] = P.codebook[code[c]] * s;
    }
    for (int64_t c = P.n; c < P.K; ++c) out[c] = 0.f;
  }
}

}  // namespace tqcpu::scalar
