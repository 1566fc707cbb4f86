// Shared by every CPU kernel variant: the problem description, the activation layout
// each instruction set wants, and the handling of a row's last, partial chunk.
//
// Packed codes follow docs/format.md ("Packed codes"): bit planes of widths 4, 2 or 1,
// lowest bits first, each plane padded to npad = ceil(n / 8) * 8 codes.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace tqcpu {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Where activations sit inside one chunk of `chunk = lanes * per` codes: a SIMD kernel
// decodes byte j of a chunk into lane j, and the byte's `per` codes into `per` vectors,
// so it wants x[c0 + j * per + k] at xp[c0 + k * lanes + j]. Permuting x once per
// forward (O(in)) costs nothing next to shuffling every decoded weight vector.
struct Layout {
  int lanes;
  int per;
  int chunk;
};

inline Layout layout_for(int isa, int bits) {
  if (isa == kScalar) return {1, 1, 8};
  const int lanes = isa == kAvx512 ? 16 : 8;
  const int per = bits == 4 ? 2 : (bits == 2 || bits == 3) ? 4 : 1;
  return {lanes, per, lanes * per};
}

inline int64_t layout_pos(const Layout& L, int64_t c) {
  const int64_t q = c / L.chunk, t = c % L.chunk;
  return q * L.chunk + (t % L.per) * L.lanes + t / L.per;
}

inline bool simd_bits(int bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 8; }

// The widest variant not above `isa` whose chunk fits whole into a group (a chunk that
// straddled two groups would need two scales inside one vector).
inline int effective_isa(int isa, int bits, int64_t group) {
  for (int i = isa; i > kScalar; --i)
    if (simd_bits(bits) && group % layout_for(i, bits).chunk == 0) return i;
  return kScalar;
}

// Bit-plane widths of a code width (tq_kernels/packing.py PLANES).
struct Planes {
  int count;
  int width[3];
};

inline Planes planes_for(int bits) {
  switch (bits) {
    case 1: return {1, {1, 0, 0}};
    case 2: return {1, {2, 0, 0}};
    case 3: return {2, {2, 1, 0}};
    case 4: return {1, {4, 0, 0}};
    case 5: return {2, {4, 1, 0}};
    case 6: return {2, {4, 2, 0}};
    case 7: return {3, {4, 2, 1}};
    default: return {1, {8, 0, 0}};
  }
}

struct Problem {
  const uint8_t* codes;     // [out, row_bytes]
  int64_t row_bytes;
  int64_t plane0_bytes;     // npad * width0 / 8: where plane 1 starts in a row
  const uint16_t* scales;   // fp16 bits [out, groups]
  int64_t groups;
  const float* codebook;    // [2**bits]
  int bits;
  int64_t group;
  int64_t n;                // in_features
  int64_t npad;             // codes per plane row
  int64_t K;                // n rounded up to whole chunks: the row length of xp and W
  int64_t M;                // activation rows
  const float* xp;          // [M, K] rotated activations in the variant's layout
  float* y;                 // y[m * ldy + row]
  int64_t ldy;
  const float* affine;      // {a, b}: 8-bit levels exactly fma(k, b, a) (affine_levels); or null
};

// Pseudo code width for rows.inc: 8-bit codes whose levels are an exact affine grid,
// decoded by arithmetic instead of a gather (same layout and values as 8).
constexpr int kAffine8 = 9;

// Whether levels[k] == fma(k, b, a) bit for bit for every k (a = levels[0], b = levels[1]
// - levels[0]), the value a SIMD fma of the converted code gives: then decoding by
// arithmetic yields exactly the looked-up levels. ab receives {a, b}.
inline bool affine_levels(const float* levels, int count, float* ab) {
  const float a = levels[0], b = levels[1] - levels[0];
  if (!(std::isfinite(a) && std::isfinite(b) && b > 0.f)) return false;
  for (int k = 0; k < count; ++k)
    if (std::fma(static_cast<float>(k), b, a) != levels[k]) return false;
  ab[0] = a;
  ab[1] = b;
  return true;
}

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// In-place normalised Walsh-Hadamard transform of a power-of-two block, with the
// butterflies of tq_kernels/rotation.py walsh_hadamard in the same order (stage h=1,
// then 2, ...), so every variant's result equals the reference's bit for bit.
inline void fwht_scalar(float* v, int64_t size) {
  for (int64_t h = 1; h < size; h *= 2)
    for (int64_t i = 0; i < size; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
  const float norm = static_cast<float>(std::sqrt(static_cast<double>(size)));
  for (int64_t j = 0; j < size; ++j) v[j] /= norm;
}

// r = x * signs (int8 +-1): the portable variant's sign flip.
inline void sign_row_scalar(const float* x, const int8_t* s, float* r, int64_t n) {
  for (int64_t c = 0; c < n; ++c) r[c] = x[c] * s[c];
}

// The identity layout (scalar variant, and 8-bit codes): x zero-padded to K.
inline void permute_identity(const float* r, float* q, int64_t n, int64_t K) {
  std::memcpy(q, r, n * sizeof(float));
  std::memset(q + n, 0, (K - n) * sizeof(float));
}

}  // namespace tqcpu
