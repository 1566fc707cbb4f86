// Shared by every variant of the KV-cache attention kernel (kv_cpu.cpp): one call's
// operands, the work split, and the portable helpers.
//
// A coded token's row is packed as tq_kernels/packing.py lays it out: bit planes of
// widths 4, 2 or 1 (lowest bits first), each padded to npad = ceil(d / 8) * 8 codes,
// plane 0's bytes then plane 1's. A variant decodes a row chunk by chunk (one load from
// each plane) into NV vectors of levels, lane by lane in the order its shifts and
// permutes produce them, never in coordinate order: q (score) and the accumulated output
// (accumulate) are laid out to match once per call instead (Layout), so the decoded
// levels never need a shuffle.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace tqkv {

enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// Tokens per parallel work item. Fixed, so that accumulate's partial sums (one per item,
// added in item order) and hence its result never depend on the thread count.
constexpr int64_t kItemTokens = 1024;
// accumulate: tokens per pass over one chunk column (their rows stay in L1 while the
// next chunk column is read).
constexpr int64_t kBlockTokens = 128;

struct Args {
  const uint8_t* codes;   // codes[b * cs_b + h * cs_h + t * cs_t + byte]
  int64_t cs_b, cs_h, cs_t;
  const uint16_t* scale;  // fp16 bits, scale[b * ss_b + h * ss_h + t * ss_t]
  int64_t ss_b, ss_h, ss_t;
  const float* levels;    // [2**bits]
  int64_t H, T, G;
  int64_t npad;           // codes per plane row
  int64_t plane0;         // bytes of plane 0 in a row (where plane 1 starts)
  int64_t K;              // floats per head of x (score) or of a partial sum (accumulate)
  const float* x;         // score: q laid out, [B*H][chunks][G][slots]; accumulate: p [B*H][G][T]
  float* out;             // score: [B*H][G][T]; accumulate: partial sums [B*H][items][G][K]
  int64_t items;          // work items per (b, h): ceil(T / kItemTokens)
};

// Where a loop's vectors take their coordinates from: chunk c of a row covers coordinates
// c * cw .. c * cw + cw, and slot s (lane s % lanes of vector s / lanes) of a chunk holds
// coordinate c * cw + coord(s). Accumulate's layouts are one-to-one (slots == cw); score's
// may hold a coordinate twice (two tokens in one vector).
struct Layout {
  int cw;
  int slots;
  int (*coord)(int s);
};

// One variant's entry points for one code width (kv_loops.inc).
struct Api {
  void (*score)(const Args&, int64_t bh, int64_t t0, int64_t t1);
  void (*accumulate)(const Args&, int64_t bh, int64_t item);
  Layout score_layout, accumulate_layout;
};

inline float half_abs(uint16_t h) {
  return c10::detail::fp16_ieee_to_fp32_value(static_cast<uint16_t>(h & 0x7fff));
}

// Largest divisor of n that is at most cap (at least 1): independent accumulator chains.
constexpr int divisor_upto(int n, int cap) {
  for (int a = std::min(n, cap); a > 1; --a)
    if (n % a == 0) return a;
  return 1;
}

// Plane widths of a code width (tq_kernels/packing.py PLANES, bits 1-5).
constexpr int plane0_width(int bits) { return bits == 3 ? 2 : bits == 5 ? 4 : bits; }
constexpr int plane1_width(int bits) { return bits - plane0_width(bits); }

}  // namespace tqkv
