// Shared by both CPU libraries (tq_cpu.cpp and fit_cpu.cpp; cpu_build.py hashes files
// named shared_* into each): the block layout of the blockwise Hadamard rotation.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

namespace tqshared {

// Blocks of the blockwise Hadamard rotation (tq_kernels/rotation.py hadamard_blocks):
// n // block full blocks, then the rest split into powers of two, largest first.
inline std::vector<std::pair<int64_t, int64_t>> hadamard_blocks(int64_t n, int64_t block) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t start = 0;
  for (; start + block <= n; start += block) out.emplace_back(start, block);
  for (int64_t size = block / 2; size >= 1; size /= 2)
    if (n - start >= size) {
      out.emplace_back(start, size);
      start += size;
    }
  return out;
}

}  // namespace tqshared
