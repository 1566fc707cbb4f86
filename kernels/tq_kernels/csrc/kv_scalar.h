// The KV kernel's portable variant: "vectors" of one float, chunks of 8 codes in natural
// order (one byte per bit of plane width). It runs on CPUs without AVX2 and on other
// architectures, through the same loops (kv_loops.inc) as the SIMD variants.
#pragma once

#include "kv_common.h"

namespace tqkv::scalar {

using V = float;
constexpr int kLanes = 1;
constexpr int kRegs = 8;
constexpr int kAccRegs = 32;  // accumulate's floats: the compiler packs them into SIMD
constexpr bool kPairScore = false;

inline V vzero() { return 0.f; }
inline V vset1(float f) { return f; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vadd(V a, V b) { return a + b; }
inline V vmul(V a, V b) { return a * b; }
inline V vfmadd(V a, V b, V c) { return a * b + c; }
inline void store_n(float* p, V v, int) { *p = v; }
inline V tsum(const V* a) { return a[0]; }
inline V tsum_pairs(const V* a) { return a[0]; }  // unused: no pair score here
inline V scales_abs(const uint16_t* s, int64_t, int) { return half_abs(s[0]); }

template <int BITS>
struct Dec {
  static constexpr int W0 = plane0_width(BITS), W1 = plane1_width(BITS);
  static constexpr int NV = 8, CW = 8, B0 = W0, B1 = W1;
  static int coord(int s) { return s; }
  using Tab = const float*;
  static Tab table(const float* l) { return l; }
  static void decode(const uint8_t* p0, const uint8_t* p1, Tab t, V* w) {
    uint64_t lo = 0;
    std::memcpy(&lo, p0, W0);
    const unsigned hi = W1 > 0 ? p1[0] : 0u;
    for (int j = 0; j < 8; ++j) {
      const unsigned c = static_cast<unsigned>((lo >> (j * W0)) & ((1u << W0) - 1)) |
                         (((hi >> j) & 1u) << W0);
      w[j] = t[c];
    }
  }
};

#include "kv_loops.inc"

}  // namespace tqkv::scalar
