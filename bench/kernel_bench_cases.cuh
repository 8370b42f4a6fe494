// kernel_bench.cu's quantize cases: the launches it times (the shipped dispatch, or a tile
// configuration at another register cap or tile order), their arguments, and the bit-exact check of
// each against a host loop over the shared per-block math; the master-weight shard variants; the
// dequantize launches at other configurations.
#pragma once

#include "kernel_bench_util.cuh"

using Launch = std::function<void(const QuantizeArgs&, const void*, const Span&, const OutPtrs&)>;

// The shipped tile kernel of Cfg launched over the span `sp` (its tile order sp.group) at the register
// cap MINB (CTAs per SM; 0: the shipped one, dense_min_blocks), where launch_tiles takes the
// configuration's own.
template <class Cfg, int MINB = 0>
void bench_launch_tiles(const QuantizeArgs& a, const void* x, Span sp, const typename Cfg::Rule& rule,
                        Outs<typename Cfg::S> row, Outs<typename Cfg::S> col, ScaleAt row_at, ScaleAt col_at) {
  constexpr int B = MINB ? MINB : dense_min_blocks<LoadBF16, Cfg>();
  const int64_t n_tiles = plan_tiles<LoadBF16, Cfg::TM, Cfg::TK>(sp, a.B, x);
  if (n_tiles > 0)
    tile_kernel<LoadBF16, Cfg, B, FromMemory><<<unsigned(n_tiles), kThreads>>>(
        static_cast<const uint16_t*>(x), sp, rule, a.fp8, row, col, row_at, col_at, FromMemory{});
}

// MINB: a register cap (CTAs per SM) other than the shipped one (0: the shipped one).
template <class Rule, int TM, int TK, int RBK, bool COL, bool TILE, int MINB = 0>
Launch quantize_cfg() {
  return [](const QuantizeArgs& a, const void* x, const Span& sp, const OutPtrs& o) {
    using S = typename Rule::ScaleT;
    Rule rule;
    if constexpr (std::is_same_v<Rule, MxRule>) rule = MxRule{a.fp8};
    else rule = BlockRule{a.fp8, false, 0.0f, 3.38953139e38f};
    Outs<S> r{o.d0, static_cast<S*>(o.s0), nullptr};
    Outs<S> c{o.d1, static_cast<S*>(o.s1), nullptr};
    if (!RBK && !TILE) c = r;  // a single columnwise usage comes first
    using C = TileCfg<Rule, TM, TK, RBK, COL, TILE>;
    // (no rowwise usage: RBK 0; a 1-wide grid then, never a division by zero, which GCC turned into a
    // trap: an "Illegal instruction")
    const ScaleAt r_at = compact_scale_at(sp.M, sp.K, TILE ? TM : 1, TILE ? TK : (RBK ? RBK : 1));
    const ScaleAt c_at = compact_scale_at(sp.M, sp.K, TM, 1);
    bench_launch_tiles<C, MINB>(a, x, sp, rule, r, c, r_at, c_at);
  };
}

struct Case {
  std::string name;
  bool mx;
  int row_bk, col_bm, tile;  // usages: 1 x row_bk, col_bm x 1, tile x tile (0: absent)
  Launch launch;
  bool gemm_ready = false;   // columnwise data transposed (a tile: both orientations); Float8 scales in GEMM order
  int group = 1;             // tile order: groups of this many tile rows (Span::group)
};

// GEMM-ready cases: the shipped dispatch (quantize_tiles) or, with MINB > 0, its tile configuration
// Cfg at another register cap.
template <class Cfg = void, int MINB = 0>
Launch gemm_ready_cfg() {
  return [](const QuantizeArgs& a, const void* x, const Span& sp, const OutPtrs& o) {
    uint8_t* d[2] = {o.d0, o.d1};
    void* s[2] = {o.s0, o.s1};
    if constexpr (MINB == 0) {
      quantize_tiles(nullptr, a, x, d, s);
    } else {
      using S = typename Cfg::S;
      using Rule = typename Cfg::Rule;
      Rule rule;
      if constexpr (std::is_same_v<Rule, MxRule>) rule = MxRule{a.fp8};
      else rule = BlockRule{a.fp8, false, 0.0f, 3.38953139e38f};
      Outs<S> row, col;
      ScaleAt row_at, col_at;
      tile_outputs(a, d, s, row, col, row_at, col_at);
      bench_launch_tiles<Cfg, MINB>(a, x, sp, rule, row, col, row_at, col_at);
    }
  };
}

// Host reference of one usage: bm x bk blocks through the shared rule and the software cast.
template <class Rule>
void host_usage(const std::vector<uint16_t>& x, int64_t M, int64_t K, int bm, int bk, const Rule& rule, int fp8,
                std::vector<uint8_t>& data, std::vector<typename Rule::ScaleT>& scale) {
  const int64_t sm = cdiv(M, bm), sk = cdiv(K, bk);
  data.assign(M * K, 0);
  scale.assign(sm * sk, 0);
  for (int64_t bi = 0; bi < sm; ++bi)
    for (int64_t bj = 0; bj < sk; ++bj) {
      float amax = 0.0f;
      for (int64_t r = bi * bm; r < std::min(M, (bi + 1) * bm); ++r)
        for (int64_t c = bj * bk; c < std::min(K, (bj + 1) * bk); ++c)
          amax = amax_step(amax, bf16_to_float(x[r * K + c]));
      float mult;
      rule(amax, scale[bi * sk + bj], mult);
      for (int64_t r = bi * bm; r < std::min(M, (bi + 1) * bm); ++r)
        for (int64_t c = bj * bk; c < std::min(K, (bj + 1) * bk); ++c)
          data[r * K + c] = fp8_from_float_sw(bf16_to_float(x[r * K + c]) * mult, fp8);
    }
}

template <class T>
bool same(const Buf& dev, const std::vector<T>& host) {
  std::vector<T> got(host.size());
  CUDA_OK(cudaMemcpy(got.data(), dev.p, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return std::memcmp(got.data(), host.data(), host.size() * sizeof(T)) == 0;
}

// E4M3, bf16 input of (1, M, K); E8M0 scales when mx, else fp32 (pow2 off, eps 0); usages as given:
// the outputs Scheme.ffi_attrs lists for them and the layouts make_quantize_args reads from the buffers
// that jax_fp8 passes (GEMM-ready: columnwise data transposed, a tile's both orientations; Float8
// scales transposed as scheme.py's transposed_scales says, stored rows padded to a multiple of 4).
QuantizeArgs bf16_args(bool mx, int row_bk, int col_bm, int tile, int64_t M, int64_t K, bool gemm_ready = false) {
  QuantizeArgs a;
  a.fp8 = kE4M3;
  a.format = mx ? Format::kMxfp8 : Format::kBlockwise;
  a.pow2 = false;
  a.eps = 0.0f;
  a.saturate_inf = true;
  std::vector<Output> outs;
  const bool f8_gemm = gemm_ready && !mx;
  if (tile) {
    outs.push_back({tile, tile, false, false});
    if (gemm_ready) outs.push_back({tile, tile, true, true});
  } else {
    if (row_bk) outs.push_back({1, row_bk, false, f8_gemm});
    if (col_bm) outs.push_back({col_bm, 1, gemm_ready, false});
  }
  a.n_out = int(outs.size());
  a.gemm_scales = false;
  for (int k = 0; k < a.n_out; ++k) {
    const Output& o = outs[k];
    const int64_t row_len = o.scales_transposed ? cdiv(M, o.bm) : cdiv(K, o.bk);
    a.out[k] = out_layout(o, M, K, f8_gemm ? (row_len + 3) / 4 * 4 : row_len);
    a.gemm_scales |= f8_gemm;
  }
  a.in = InType::kBF16;
  a.B = 1;
  a.M = M;
  a.K = K;
  a.inf_value = 3.38953139e38f;
  return a;
}
QuantizeArgs args_of(const Case& c, int64_t M, int64_t K) {
  return bf16_args(c.mx, c.row_bk, c.col_bm, c.tile, M, K, c.gemm_ready);
}

// ---- bench-only variants of the master-weight shard launch --------------------------------------
// The shipped launch (quantize_shards.cuh) runs fill CTAs first at min_blocks_for's register cap. These
// time one MXFP8 row+col job with another cap (MINB), the fill CTAs last (FILL_LAST), or only part of
// its CTAs (to time the fill and the tiles apart).
using MxRowCol = TileCfg<MxRule, 32, 256, 32, true, false>;
enum class Part { kAll, kTiles, kFill };

template <int MODE, int MINB, bool FILL_LAST>
__global__ void __launch_bounds__(kThreads, MINB)
    bench_shard_kernel(const __grid_constant__ ShardGroup<uint8_t> grp, const MxRule rule, int fp8) {
  const ShardJob<uint8_t>& jb = grp.job[0];
  const uint32_t t = blockIdx.x;
  const uint32_t f = FILL_LAST ? t - jb.n_tiles : t;  // fill CTA index (wraps when not a fill CTA)
  if (f < jb.n_fill)
    fill_outside_walk<MxRowCol, MODE>(jb, rule, int64_t(f) * kThreads + threadIdx.x, int64_t(jb.n_fill) * kThreads);
  else
    quantize_tile<LoadBF16, MxRowCol, MODE>(static_cast<const uint16_t*>(jb.x), jb.sp, rule, fp8, jb.row, jb.col,
                                            compact_scale_at(jb.sp.M, jb.sp.K, 1, 32),
                                            compact_scale_at(jb.sp.M, jb.sp.K, 32, 1), FILL_LAST ? t : t - jb.n_fill);
}

// One bf16 MXFP8 row+col shard job, all or part of its CTAs; MINB 0: the shipped launch_shards.
template <int MODE, int MINB = 0, bool FILL_LAST = false>
void launch_one_shard(const QuantizeArgs& a, const ShardIO& io, Part part = Part::kAll) {
  if (MINB == 0 && !FILL_LAST && part == Part::kAll) {
    launch_shards<MODE>(nullptr, a, &io, 1);
    return;
  }
  ShardGroup<uint8_t> grp;
  grp.n = 1;
  shard_job<LoadBF16, MxRowCol, MODE>(io, &grp.job[0]);
  if (part == Part::kFill) grp.job[0].n_tiles = 0;
  if (part == Part::kTiles) grp.job[0].n_fill = 0;
  const unsigned ctas = grp.job[0].n_tiles + grp.job[0].n_fill;
  constexpr int B = MINB ? MINB : min_blocks_for<LoadBF16, MxRule, true, MODE, true>();
  if (ctas) bench_shard_kernel<MODE, B, FILL_LAST><<<ctas, kThreads>>>(grp, MxRule{a.fp8}, a.fp8);
}

// dequantize_kernel at another launch configuration than launch_dequantize's: VEC columns per thread,
// UNROLL rows in flight, ctas_per_sm CTAs' worth of rows per SM.
template <class Rule, class St, int VEC, int UNROLL>
void bench_dequantize(const void* d, const void* s, void* out, int64_t B, int64_t M, int64_t K, int bm, int bk, int fp8,
                      int ctas_per_sm) {
  const bool aligned = K % St::N == 0 && reinterpret_cast<uintptr_t>(d) % 16 == 0;
  dequantize_kernel<Rule, St, VEC, UNROLL><<<dequantize_grid(B, M, K, VEC, ctas_per_sm), kDeqThreads>>>(
      static_cast<const uint8_t*>(d), static_cast<const typename Rule::ScaleT*>(s), int(B), int(M), int(K),
      __builtin_ctz(bm), __builtin_ctz(bk), fp8, aligned, static_cast<typename St::T*>(out));
}

// Each output of the case against the host reference on an odd-shaped input: the data (transposed
// for a transposed output), every block's scale where the output's layout keeps it, and the padding.
bool check(const Case& c) {
  const int64_t M = 1000, K = 1064;
  std::vector<uint16_t> hx(M * K);
  Buf x(M * K * 2);
  fill_bf16<<<64, 256>>>(x.as<uint16_t>(), M * K, 7);
  CUDA_OK(cudaMemcpy(hx.data(), x.p, M * K * 2, cudaMemcpyDeviceToHost));
  const size_t item = c.mx ? 1 : 4;
  Outputs o(M * K, 2 * M * K, 2 * M * K, item);  // room for padded GEMM-ready grids
  const QuantizeArgs a = args_of(c, M, K);
  c.launch(a, x.p, dense_span(M, K, c.group), o.ptrs());
  CUDA_OK(cudaDeviceSynchronize());
  bool ok = true;
  for (int k = 0; k < a.n_out; ++k) {
    const OutLayout& l = a.out[k];
    const Buf& d = k == 0 ? o.d0 : o.d1;
    const Buf& s = k == 0 ? o.s0 : o.s1;
    std::vector<uint8_t> data, want(M * K);
    const int64_t sm = cdiv(M, l.bm), sk = cdiv(K, l.bk);
    std::vector<float> scale;  // the host scales as float (E8M0 bytes widened)
    if (c.mx) {
      std::vector<uint8_t> sc;
      host_usage(hx, M, K, l.bm, l.bk, MxRule{kE4M3}, kE4M3, data, sc);
      scale.assign(sc.begin(), sc.end());
    } else {
      host_usage(hx, M, K, l.bm, l.bk, BlockRule{kE4M3, false, 0.0f, 3.38953139e38f}, kE4M3, data, scale);
    }
    for (int64_t r = 0; r < M; ++r)
      for (int64_t q = 0; q < K; ++q) want[l.data_transposed ? q * M + r : r * K + q] = data[r * K + q];
    ok = ok && same(d, want);
    const int64_t n_stored = std::max(sm * sk, l.pad_rows * l.ld);
    std::vector<uint8_t> raw(n_stored * item);
    CUDA_OK(cudaMemcpy(raw.data(), s.p, raw.size(), cudaMemcpyDeviceToHost));
    const auto at = [&](int64_t idx) {
      if (c.mx) return float(raw[idx]);
      float f;
      std::memcpy(&f, &raw[idx * 4], 4);
      return f;
    };
    for (int64_t i = 0; i < sm; ++i)
      for (int64_t j = 0; j < sk; ++j) ok = ok && at(i * l.s_row + j * l.s_col) == scale[i * sk + j];
    for (int64_t r = 0; r < l.pad_rows; ++r)
      for (int64_t q = l.pad_from; q < l.ld; ++q) ok = ok && at(r * l.ld + q) == kGemmScalePad;
  }
  return ok;
}

// The quantize cases, in the table's order.
inline std::vector<Case> make_cases() {
#define CFG(name, mx, rb, cb, tile, Rule, TM, TK, ...) \
  Case{name, mx, rb, cb, tile, quantize_cfg<Rule, TM, TK, rb, cb != 0, tile != 0, ##__VA_ARGS__>()}
#define GR(name, mx, rb, cb, tile, ...) Case{name, mx, rb, cb, tile, gemm_ready_cfg<__VA_ARGS__>(), true}
  std::vector<Case> cases = {
      CFG("mx row", true, 32, 0, 0, MxRule, 32, 256),
      CFG("mx row+col", true, 32, 32, 0, MxRule, 32, 256),
      CFG("mx col", true, 0, 32, 0, MxRule, 32, 256),
      CFG("f8 1x128", false, 128, 0, 0, BlockRule, 128, 128),
      CFG("f8 1x128+128x1", false, 128, 128, 0, BlockRule, 128, 128),
      CFG("f8 128x128", false, 0, 0, 128, BlockRule, 128, 128),
      // other register caps than the shipped ones (the packed amax needs fewer registers)
      CFG("mx row 5 CTAs/SM", true, 32, 0, 0, MxRule, 32, 256, 5),
      CFG("mx row+col 4 CTAs/SM", true, 32, 32, 0, MxRule, 32, 256, 4),
      CFG("mx col 4 CTAs/SM", true, 0, 32, 0, MxRule, 32, 256, 4),
      CFG("f8 1x128 2 CTAs/SM", false, 128, 0, 0, BlockRule, 128, 128, 2),
      CFG("f8 1x128+128x1 2 CTAs/SM", false, 128, 128, 0, BlockRule, 128, 128, 2),
      CFG("f8 1x128+128x1 4 CTAs/SM", false, 128, 128, 0, BlockRule, 128, 128, 4),
      CFG("f8 128x1", false, 0, 128, 0, BlockRule, 128, 128),
      CFG("f8 128x1 2 CTAs/SM", false, 0, 128, 0, BlockRule, 128, 128, 2),
      CFG("f8 128x128 2 CTAs/SM", false, 0, 0, 128, BlockRule, 128, 128, 2),
      // GEMM-ready (columnwise data transposed in the same pass): shipped, and other register caps
      GR("f8 1x128+128x1T", false, 128, 128, 0),
      GR("f8 128x128 both orientations", false, 0, 0, 128),
      GR("mx row+colT", true, 32, 32, 0),
      GR("f8 1x128+128x1T 2 CTAs/SM", false, 128, 128, 0, TileCfg<BlockRule, 128, 128, 128, true, false, true, true>, 2),
      GR("f8 128x128 both 2 CTAs/SM", false, 0, 0, 128, TileCfg<BlockRule, 128, 128, 0, false, true, true, true>, 2),
      GR("mx row+colT 3 CTAs/SM", true, 32, 32, 0, TileCfg<MxRule, 32, 256, 32, true, false, true>, 3),
      GR("f8 1x128+128x1T 4 CTAs/SM", false, 128, 128, 0, TileCfg<BlockRule, 128, 128, 128, true, false, true, true>, 4),
      GR("f8 128x128 both 4 CTAs/SM", false, 0, 0, 128, TileCfg<BlockRule, 128, 128, 0, false, true, true, true>, 4),
  };
  // two-usage kernels (shipped register caps) in tile orders of groups of G tile rows
  for (const int G : {1, 2, 4, 8}) {
    const std::string tail = " order G" + std::to_string(G);
    cases.push_back(CFG("f8 1x128+128x1" + tail, false, 128, 128, 0, BlockRule, 128, 128));
    cases.push_back(GR("f8 1x128+128x1T" + tail, false, 128, 128, 0,
                       TileCfg<BlockRule, 128, 128, 128, true, false, true, true>, 3));
    cases.push_back(GR("f8 128x128 both" + tail, false, 0, 0, 128, TileCfg<BlockRule, 128, 128, 0, false, true, true, true>,
                       3));
    cases.push_back(GR("mx row+colT" + tail, true, 32, 32, 0, TileCfg<MxRule, 32, 256, 32, true, false, true>, 4));
    for (int k = 1; k <= 4; ++k) cases.end()[-k].group = G;
  }
  return cases;
#undef CFG
#undef GR
}
