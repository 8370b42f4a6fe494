// Rows in groups, as lax.ragged_dot takes them (jax_fp8/groups.py defines them; this mirrors it): group g
// holds rows [start_g, end_g), end_g = min(size_0 + ... + size_g, M) with each size clipped to [0, M];
// its rows split into blocks of bm rows from start_g, and the blocks of all groups, numbered in order,
// are the "slots" whose scales a grouped tensor stores. Plain C++ (the CUTLASS grouped GEMM's translation
// units include it too).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace jf {

// A block of rows [r0, r1) whose scales go to block row `slot` of its output, and whose rows are the
// columns from c0 of a transposed (columnwise) output.
struct RowBlock {
  int64_t r0, r1, slot, c0;
};

// groups.py's block_slots: the most slots any sizes give (n = min(G, M) groups of which n - 1 hold one row).
inline int64_t block_slots(int64_t M, int64_t G, int64_t bm) {
  const int64_t n = std::min(G, M);
  return n > 0 ? n + (M - n) / bm : 0;
}

// groups.py's COL_ALIGN and col_count: each group's columns in a columnwise output start at a multiple of
// kColAlign (the grouped GEMM's TMA loads); the most columns any sizes take.
constexpr int64_t kColAlign = 16;
inline int64_t col_count(int64_t M, int64_t G) { return kColAlign * block_slots(M, G, kColAlign); }

// The blocks of bm rows of every group, in slot order (bm = 1: every row in a group, slot = row).
inline std::vector<RowBlock> group_blocks(const int32_t* sizes, int64_t G, int64_t M, int64_t bm) {
  std::vector<RowBlock> blocks;
  int64_t start = 0, col = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t end = std::min(M, start + std::clamp<int64_t>(sizes[g], 0, M));
    for (int64_t r = start; r < end; r += bm)
      blocks.push_back({r, std::min(end, r + bm), int64_t(blocks.size()), col + r - start});
    col += (end - start + kColAlign - 1) / kColAlign * kColAlign;
    start = end;
  }
  return blocks;
}

}  // namespace jf
