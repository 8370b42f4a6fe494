// Rows in groups, as lax.ragged_dot takes them (jax_fp8/groups.py defines them; this mirrors it): group g
// holds rows [start_g, end_g), end_g = min(size_0 + ... + size_g, M) with each size clipped to [0, M];
// its rows split into blocks of bm rows from start_g, and the blocks of all groups, numbered in order,
// are the "slots" whose scales a grouped tensor stores. And the jf_quantize_grouped call's arguments.
#pragma once

#include <algorithm>
#include <vector>

#include "ffi_common.h"

namespace jf {

// A block of rows [r0, r1) whose scales go to block row `slot` of its output.
struct RowBlock {
  int64_t r0, r1, slot;
};

// groups.py's block_slots: the most slots any sizes give (n = min(G, M) groups of which n - 1 hold one row).
inline int64_t block_slots(int64_t M, int64_t G, int64_t bm) {
  const int64_t n = std::min(G, M);
  return n > 0 ? n + (M - n) / bm : 0;
}

// The blocks of bm rows of every group, in slot order (bm = 1: every row in a group, slot = row).
inline std::vector<RowBlock> group_blocks(const int32_t* sizes, int64_t G, int64_t M, int64_t bm) {
  std::vector<RowBlock> blocks;
  int64_t start = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t end = std::min(M, start + std::clamp<int64_t>(sizes[g], 0, M));
    for (int64_t r = start; r < end; r += bm) blocks.push_back({r, std::min(end, r + bm), int64_t(blocks.size())});
    start = end;
  }
  return blocks;
}

// jf_quantize_grouped: x (B, M, K), group sizes (B, G) int32 (one set per matrix), and the result buffers
// of the scheme's outputs (Float8 blockwise, GEMM-ready 1x128 blocks): rowwise as jf_quantize's;
// columnwise data (B, K, M) and scales (B, S, ld) of block_slots(M, G, 128) slots. Sets *G.
inline ffi::Error make_grouped_quantize_args(const ffi::AnyBuffer& x, const ffi::AnyBuffer& sizes,
                                             const QuantizeResult* res, const Scheme& s, QuantizeArgs* a,
                                             int64_t* G) {
  int64_t B, M, K;
  if (auto e = dims3(x, &B, &M, &K); e.failure()) return e;
  const auto d = sizes.dimensions();
  if (sizes.element_type() != ffi::DataType::S32 || d.size() != 2 || d[0] != B)
    return bad("quantize_grouped: the group sizes must be int32 (batch, groups), one set per matrix");
  *G = d[1];
  if (auto e = fill_quantize_args(x.element_type(), B, M, K, s, a); e.failure()) return e;
  for (int k = 0; k < a->n_out; ++k) {
    const Output& o = a->out[k];
    if (a->format != Format::kBlockwise || o.bm * o.bk != traits(a->format).block || o.data_transposed != (o.bk == 1))
      return bad("quantize_grouped takes Float8 blockwise 1x128 blocks, GEMM-ready");
  }
  return check_quantize_outputs(res, a, block_slots(M, *G, traits(a->format).block));
}

}  // namespace jf
