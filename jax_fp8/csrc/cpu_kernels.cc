// CPU kernels behind the XLA FFI targets, for the host platform (CI runs these).
// The per-element math comes from fp8_math.h; this file only walks blocks.
#include <nanobind/nanobind.h>
#include <xmmintrin.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <utility>
#include <vector>

#include "ffi_bindings.h"
#include "ffi_common.h"
#include "fp8_math.h"
#include "groups.h"
#include "producers.h"

namespace jf {
namespace {

// XLA may run host code with flush-to-zero / denormals-are-zero set; our numbers are IEEE.
struct IeeeFpEnv {
  unsigned saved = _mm_getcsr();
  IeeeFpEnv() { _mm_setcsr(saved & ~(0x8000u | 0x0040u)); }
  ~IeeeFpEnv() { _mm_setcsr(saved); }
};

// Runs f(i0, i1) over [0, n) in chunks (about four per core, handed out in turn). A call that moves
// 64K elements or more is spread over the host's cores: XLA gives a custom call one thread. Each
// thread sets the IEEE environment itself.
template <class F>
void parallel_for(int64_t n, int64_t elements, F f) {
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t threads = elements < (int64_t(1) << 16) ? 1 : std::max<int64_t>(1, std::min(n, cores));
  const int64_t grain = std::max<int64_t>(1, n / (4 * threads)), chunks = cdiv(n, grain);
  std::atomic<int64_t> next{0};
  const auto work = [&] {
    IeeeFpEnv env;
    for (int64_t c; (c = next++) < chunks;) f(c * grain, std::min(n, (c + 1) * grain));
  };
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

struct LoadF32 {
  using T = float;
  static float get(const T* p, int64_t i) { return p[i]; }
};
struct LoadBF16 {
  using T = uint16_t;
  static float get(const T* p, int64_t i) { return bf16_to_float(p[i]); }
};
struct LoadF16 {
  using T = uint16_t;
  static float get(const T* p, int64_t i) { return f16_to_float(p[i]); }
};

// out[k] = cast(v[k] * m[k]) for k < n, m a per-element array (STRIDE 1) or one value (STRIDE 0).
// The FP8 kind is a compile-time constant so the loop has no branches and vectorizes.
template <int KIND, int STRIDE>
void cast_span(const float* v, const float* m, uint8_t* out, int64_t n) {
  for (int64_t k = 0; k < n; ++k) out[k] = fp8_from_float_sw(v[k] * m[k * STRIDE], KIND);
}
template <int STRIDE>
void cast_span(const float* v, const float* m, uint8_t* out, int64_t n, int fp8) {
  if (fp8 == kE4M3) cast_span<kE4M3, STRIDE>(v, m, out, n);
  else cast_span<kE5M2, STRIDE>(v, m, out, n);
}

// max(acc, amax of v[0, n)) with eight independent lanes, so the compiler vectorizes it.
inline float amax_span(const float* v, int64_t n, float acc) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int e = 0; e < 8; ++e) lane[e] = amax_step(lane[e], v[k + e]);
  for (; k < n; ++k) acc = amax_step(acc, v[k]);
  for (int e = 0; e < 8; ++e) acc = lane[e] > acc ? lane[e] : acc;
  return acc;
}

// Apply f(c, end, j) to each piece [c, end) of columns [c0, c1) that lies in one block j of width bk.
template <class F>
inline void for_blocks_in(int64_t c0, int64_t c1, int bk, F f) {
  for (int64_t c = c0; c < c1;) {
    const int64_t j = c / bk, end = std::min(c1, (j + 1) * bk);
    f(c, end, j);
    c = end;
  }
}

// The block rows of a dense (M, K) matrix: every bm rows from row 0, block row i in scale row i.
struct EvenBlocks {
  int64_t M, bm;
  int64_t size() const { return cdiv(M, bm); }
  RowBlock operator[](int64_t i) const { return {i * bm, std::min(M, i * bm + bm), i, i * bm}; }
};

// Quantize one output: blocks of o.bm rows x o.bk cols of every (M, K) matrix in the batch, its data
// and scales where the output's layout puts them (OutLayout: data (M, K) or transposed (K, M); scales
// in the grid's order or transposed, each stored row padded to the scale buffer's row length).
// rows(b, r, row) writes row r of matrix b as fp32 (an input's row, or a producer's); blocks: the block
// rows (EvenBlocks, or a list of RowBlock: rows in groups, whose scales go to their slots). Walks one
// block-row at a time (block-rows spread over the cores); the inner loops are plain contiguous loops
// (no per-element division) that the compiler can vectorize.
template <class Rows, class Rule, class Blocks>
void quantize_blocks(const Rows& rows, const Blocks& blocks, int64_t B, int64_t M, int64_t K, const OutLayout& o,
                     const Rule& rule, int fp8, uint8_t* data, typename Rule::ScaleT* scale) {
  const int bk = o.bk;
  const int64_t sm = blocks.size(), sk = cdiv(K, bk);
  parallel_for(B * sm, B * M * K, [&](int64_t t0, int64_t t1) {
    std::vector<float> amax(sk), mult(sk), row(K), mult_k(bk == 1 ? 0 : K);
    std::vector<uint8_t> bytes(o.data_transposed ? K : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / sm;
      const auto [r0, r1, i, c0] = blocks[t % sm];
      std::fill(amax.begin(), amax.end(), 0.0f);
      for (int64_t r = r0; r < r1; ++r) {
        rows(b, r, row.data());
        if (bk == 1) {
          for (int64_t k = 0; k < K; ++k) amax[k] = amax_step(amax[k], row[k]);
        } else {
          for_blocks_in(0, K, bk, [&](int64_t k0, int64_t k1, int64_t j) {
            amax[j] = amax_span(row.data() + k0, k1 - k0, amax[j]);
          });
        }
      }
      typename Rule::ScaleT* sb = scale + b * o.s_batch;
      for (int64_t j = 0; j < sk; ++j) rule(amax[j], sb[i * o.s_row + j * o.s_col], mult[j]);
      if (bk > 1)  // per-element multipliers: one long vectorized cast loop per row
        for_blocks_in(0, K, bk, [&](int64_t k0, int64_t k1, int64_t j) { std::fill(&mult_k[k0], &mult_k[0] + k1, mult[j]); });
      const float* mk = bk == 1 ? mult.data() : mult_k.data();
      for (int64_t r = r0; r < r1; ++r) {
        rows(b, r, row.data());
        if (!o.data_transposed) {
          cast_span<1>(row.data(), mk, data + (b * M + r) * K, K, fp8);
        } else {  // (B, K, data_cols): the row's bytes go down its column of the transpose
          cast_span<1>(row.data(), mk, bytes.data(), K, fp8);
          uint8_t* col = data + b * K * o.data_cols + c0 + (r - r0);
          for (int64_t k = 0; k < K; ++k) col[k * o.data_cols] = bytes[k];
        }
      }
    }
  });
  for (int64_t b = 0; b < B; ++b)  // GEMM-ready padding: the scale of an all-zero block
    for (int64_t p = 0; p < o.pad_rows; ++p)
      for (int64_t c = o.pad_from; c < o.ld; ++c) scale[b * o.s_batch + p * o.ld + c] = kGemmScalePad;
}

// The rows of a (B, M, K) input, widened to fp32.
template <class L>
struct InputRows {
  const typename L::T* x;
  int64_t M, K;
  void operator()(int64_t b, int64_t r, float* row) const {
    const typename L::T* xr = x + (b * M + r) * K;
    for (int64_t k = 0; k < K; ++k) row[k] = L::get(xr, k);
  }
};

// Every output of a quantize-style call from the rows of its (B, M, K) tensor.
template <class Rows, class Rule>
void quantize_all(const QuantizeArgs& a, const Rows& rows, const Rule& rule, uint8_t* const* data,
                  void* const* scale) {
  using S = typename Rule::ScaleT;
  for (int k = 0; k < a.n_out; ++k)
    quantize_blocks(rows, EvenBlocks{a.M, a.out[k].bm}, a.B, a.M, a.K, a.out[k], rule, a.fp8, data[k],
                    static_cast<S*>(scale[k]));
}

// Calls f(loader) for the input type.
template <class F>
void with_loader(InType t, F f) {
  switch (t) {
    case InType::kF32: return f(LoadF32{});
    case InType::kBF16: return f(LoadBF16{});
    case InType::kF16: return f(LoadF16{});
  }
}

// x: (B, M, K) float32 / bfloat16 / float16. Per output of the scheme (Scheme::outputs, rowwise
// first): its FP8 data, uint8 (B, M, K), or (B, K, M) for transposed (GEMM-ready columnwise) data,
// and its scales, uint8 E8M0 or fp32 scale_inv: the (B, ceil(M/bm), ceil(K/bk)) grid, or for GEMM-ready
// Float8 scales the grid or its transpose with each stored row padded as the scale buffer is wide. The
// second pair is empty when the scheme has one output.
ffi::Error QuantizeCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> data0, ffi::Result<ffi::AnyBuffer> scale0,
                       ffi::Result<ffi::AnyBuffer> data1, ffi::Result<ffi::AnyBuffer> scale1, Scheme scheme) {
  QuantizeArgs a;
  const QuantizeResult res[2] = {{&*data0, &*scale0}, {&*data1, &*scale1}};
  if (auto e = make_quantize_args(x, res, scheme, &a); e.failure()) return e;
  IeeeFpEnv env;
  uint8_t* data[2] = {static_cast<uint8_t*>(data0->untyped_data()), static_cast<uint8_t*>(data1->untyped_data())};
  void* scale[2] = {scale0->untyped_data(), scale1->untyped_data()};
  with_rule(a, [&](auto rule) {
    with_loader(a.in, [&](auto ld) {
      using L = decltype(ld);
      quantize_all(a, InputRows<L>{static_cast<const typename L::T*>(x.untyped_data()), a.M, a.K}, rule, data, scale);
    });
  });
  return ffi::Error::Success();
}

// x (B, M, K), its rows in the groups of sizes (B, G) int32 (groups.h): every output as jf_quantize's,
// but columnwise blocks of 128 rows restart at every group start and store their scales in their slots
// (scale rows); rows in no group get data 0, and unused scale entries the padding value.
ffi::Error QuantizeGroupedCpu(ffi::AnyBuffer x, ffi::AnyBuffer sizes, ffi::Result<ffi::AnyBuffer> data0,
                              ffi::Result<ffi::AnyBuffer> scale0, ffi::Result<ffi::AnyBuffer> data1,
                              ffi::Result<ffi::AnyBuffer> scale1, Scheme scheme) {
  QuantizeArgs a;
  int64_t G;
  const QuantizeResult res[2] = {{&*data0, &*scale0}, {&*data1, &*scale1}};
  if (auto e = make_grouped_quantize_args(x, sizes, res, scheme, &a, &G); e.failure()) return e;
  IeeeFpEnv env;
  ffi::AnyBuffer* const outs[2][2] = {{&*data0, &*scale0}, {&*data1, &*scale1}};
  for (int k = 0; k < a.n_out; ++k) {  // what no block writes: data 0, scales the padding
    std::fill_n(static_cast<uint8_t*>(outs[k][0]->untyped_data()), outs[k][0]->element_count(), uint8_t(0));
    std::fill_n(static_cast<float*>(outs[k][1]->untyped_data()), outs[k][1]->element_count(), kGemmScalePad);
  }
  const int32_t* group_sizes = static_cast<const int32_t*>(sizes.untyped_data());
  with_block_rule(a, [&](auto rule) {  // make_grouped_quantize_args takes Float8 blockwise alone
    with_loader(a.in, [&](auto ld) {
      using L = decltype(ld);
      const auto* xs = static_cast<const typename L::T*>(x.untyped_data());
      for (int64_t b = 0; b < a.B; ++b)
        for (int k = 0; k < a.n_out; ++k) {
          const OutLayout& o = a.out[k];
          const std::vector<RowBlock> blocks = group_blocks(group_sizes + b * G, G, a.M, o.bm);
          auto* scale = static_cast<float*>(outs[k][1]->untyped_data()) + b * o.s_batch;
          quantize_blocks(InputRows<L>{xs + b * a.M * a.K, a.M, a.K}, blocks, 1, a.M, a.K, o, rule, a.fp8,
                          static_cast<uint8_t*>(outs[k][0]->untyped_data()) + b * (outs[k][0]->element_count() / a.B), scale);
        }
    });
  });
  return ffi::Error::Success();
}

// ---- producers fused with quantization (producers.h) ------------------------------------------

// n elements of an input buffer from element `at`, widened to fp32.
void load_f32(const void* p, InType t, int64_t at, int64_t n, float* out) {
  with_loader(t, [&](auto ld) {
    using L = decltype(ld);
    const auto* x = static_cast<const typename L::T*>(p) + at;
    for (int64_t k = 0; k < n; ++k) out[k] = L::get(x, k);
  });
}

// v rounded to the produced dtype, as fp32.
inline float round_to(InType t, float v) {
  switch (t) {
    case InType::kF32: return v;
    case InType::kBF16: return bf16_to_float(bf16_from_float(v));
    case InType::kF16: return f16_to_float(f16_from_float(v));
  }
  return v;
}

// out[i] = v in dtype t, NaNs canonical.
inline void store_as(InType t, void* out, int64_t i, float v) {
  switch (t) {
    case InType::kF32: static_cast<float*>(out)[i] = canonical_f32(v); break;
    case InType::kBF16: static_cast<uint16_t*>(out)[i] = bf16_from_float(v); break;
    case InType::kF16: static_cast<uint16_t*>(out)[i] = f16_from_float(v); break;
  }
}

// The rows of a producer's (B, M, K) tensor, each value rounded to the produced dtype.
struct ProducedRows {
  const ProduceArgs& p;
  int64_t M, K;
  std::vector<float> gamma, beta;  // the norms', widened once

  void operator()(int64_t b, int64_t r, float* row) const { flat(b * M + r, row); }

  // Row rr of the (B * M, K) view.
  void flat(int64_t rr, float* row) const {
    thread_local std::vector<float> in0, in1;
    switch (p.producer) {
      case Producer::kCast:
        load_f32(p.in[0], p.in_type[0], rr * K, K, row);
        for (int64_t k = 0; k < K; ++k) row[k] = round_to(p.out, row[k]);
        return;
      case Producer::kRmsNorm: {
        load_f32(p.in[0], p.in_type[0], rr * K, K, row);
        const float rstd = p.stats[rr];
        for (int64_t k = 0; k < K; ++k) row[k] = round_to(p.out, (row[k] * rstd) * gamma[k]);
        return;
      }
      case Producer::kLayerNorm: {
        load_f32(p.in[0], p.in_type[0], rr * K, K, row);
        const float mean = p.stats[2 * rr], rstd = p.stats[2 * rr + 1];
        for (int64_t k = 0; k < K; ++k)
          row[k] = round_to(p.out, layer_norm_f(row[k], mean, rstd, gamma[k], beta[k]));
        return;
      }
      case Producer::kSwiglu:  // h (B, M, 2K) = [gate | up]
        in0.resize(2 * K);
        load_f32(p.in[0], p.in_type[0], rr * 2 * K, 2 * K, in0.data());
        for (int64_t k = 0; k < K; ++k) row[k] = round_to(p.out, swiglu_f(in0[k], in0[K + k]));
        return;
      case Producer::kSwigluGrad: {  // da (B, M, F), h (B, M, 2F); the row is [d_gate | d_up], K = 2F
        const int64_t F = K / 2;
        in0.resize(F);
        in1.resize(K);
        load_f32(p.in[0], p.in_type[0], rr * F, F, in0.data());
        load_f32(p.in[1], p.in_type[1], rr * K, K, in1.data());
        for (int64_t k = 0; k < F; ++k) {
          float d_gate, d_up;
          swiglu_grad_pair_f(in0[k], in1[k], in1[F + k], d_gate, d_up);
          row[k] = round_to(p.out, d_gate);
          row[F + k] = round_to(p.out, d_up);
        }
        return;
      }
      case Producer::kGelu:
        load_f32(p.in[0], p.in_type[0], rr * K, K, row);
        for (int64_t k = 0; k < K; ++k) row[k] = round_to(p.out, gelu_f(row[k]));
        return;
      case Producer::kGeluGrad:  // da (B, M, K), x (B, M, K)
        in0.resize(K);
        load_f32(p.in[0], p.in_type[0], rr * K, K, in0.data());
        load_f32(p.in[1], p.in_type[1], rr * K, K, row);
        for (int64_t k = 0; k < K; ++k) row[k] = round_to(p.out, gelu_grad_f(in0[k], row[k]));
        return;
    }
  }
};

// The sum of term(k) over k < K in producers.h's order (kSumLanes partials, then their tree).
template <class Term>
float row_sum(int64_t K, Term term) {
  float part[kSumLanes] = {};
  for (int64_t k = 0; k < K; ++k) part[k % kSumLanes] = part[k % kSumLanes] + term(k);
  sum_tree(part);
  return part[0];
}

// A norm's statistics of every row, written to p.stats (the quantize passes read them): RMSNorm's rstd;
// LayerNorm's mean, then its rstd from the sum of (x - mean)**2 (two passes over the row).
void norm_stats_rows(const ProduceArgs& p, int64_t rows, int64_t K) {
  parallel_for(rows, rows * K, [&](int64_t r0, int64_t r1) {
    std::vector<float> x(K);
    for (int64_t r = r0; r < r1; ++r) {
      load_f32(p.in[0], p.in_type[0], r * K, K, x.data());
      if (p.producer == Producer::kRmsNorm) {
        p.stats[r] = rms_rstd_f(row_sum(K, [&](int64_t k) { return x[k] * x[k]; }), p.inv_k, p.eps);
        continue;
      }
      const float mean = canonical_f32(row_sum(K, [&](int64_t k) { return x[k]; }) * p.inv_k);
      const float ss = row_sum(K, [&](int64_t k) {
        const float d = x[k] - mean;
        return d * d;
      });
      p.stats[2 * r] = mean;
      p.stats[2 * r + 1] = rms_rstd_f(ss, p.inv_k, p.eps);
    }
  });
}

// The producer's rows, a norm's statistics computed first (into p.stats).
ProducedRows producer_rows(const ProduceArgs& p, int64_t B, int64_t M, int64_t K) {
  ProducedRows rows{p, M, K, {}, {}};
  if (is_norm(p.producer)) {
    rows.gamma.resize(K);
    load_f32(p.in[1], p.in_type[1], 0, K, rows.gamma.data());
    if (p.producer == Producer::kLayerNorm) {
      rows.beta.resize(K);
      load_f32(p.in[2], p.in_type[2], 0, K, rows.beta.data());
    }
    norm_stats_rows(p, B * M, K);
  }
  return rows;
}

// The producer's inputs (produce_args.h); y: its tensor in y's dtype (NaNs canonical), and a norm's statistics.
ffi::Error ProduceCpu(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> extra,
                      int32_t producer, float eps) {
  ProduceArgs p;
  int64_t B, M, K;
  if (auto e = make_produce_only(args, *y, *extra, producer, eps, &B, &M, &K, &p); e.failure()) return e;
  IeeeFpEnv env;
  const ProducedRows rows = producer_rows(p, B, M, K);
  void* out = y->untyped_data();
  parallel_for(B * M, B * M * K, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(K);
    for (int64_t rr = r0; rr < r1; ++rr) {
      rows.flat(rr, row.data());
      for (int64_t k = 0; k < K; ++k) store_as(p.out, out, rr * K + k, row[k]);
    }
  });
  return ffi::Error::Success();
}

// The producer's inputs (produce_args.h), its quantize outputs as jf_quantize's, and a norm's statistics.
ffi::Error ProduceQuantizeCpu(ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> data0,
                              ffi::Result<ffi::AnyBuffer> scale0, ffi::Result<ffi::AnyBuffer> data1,
                              ffi::Result<ffi::AnyBuffer> scale1, ffi::Result<ffi::AnyBuffer> extra, Scheme scheme,
                              int32_t producer, int32_t dtype, float eps) {
  QuantizeArgs a;
  ProduceArgs p;
  const QuantizeResult res[2] = {{&*data0, &*scale0}, {&*data1, &*scale1}};
  if (auto e = make_produce_args(args, res, *extra, scheme, producer, dtype, eps, &a, &p); e.failure()) return e;
  IeeeFpEnv env;
  const ProducedRows rows = producer_rows(p, a.B, a.M, a.K);
  uint8_t* data[2] = {static_cast<uint8_t*>(data0->untyped_data()), static_cast<uint8_t*>(data1->untyped_data())};
  void* scale[2] = {scale0->untyped_data(), scale1->untyped_data()};
  with_rule(a, [&](auto rule) { quantize_all(a, rows, rule, data, scale); });
  return ffi::Error::Success();
}

// A norm's backward (producers.h): dx row by row, then the column sums by ranges of columns, each column's
// blocks in order. The workspace is the CUDA kernels'.
ffi::Error NormGradCpu(ffi::AnyBuffer x, ffi::AnyBuffer gamma, ffi::AnyBuffer stats, ffi::AnyBuffer dy,
                       ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> sums,
                       ffi::Result<ffi::AnyBuffer> work, int32_t producer) {
  NormGradArgs a;
  if (auto e = make_norm_grad(x, gamma, stats, dy, *dx, *sums, *work, producer, &a); e.failure()) return e;
  IeeeFpEnv env;
  const int64_t K = a.K, rows = a.B * a.M;
  std::vector<float> g(K);
  load_f32(a.gamma, a.gt, 0, K, g.data());
  const auto mean_of = [&](int64_t r) { return a.layer ? a.stats[2 * r] : 0.0f; };
  const auto rstd_of = [&](int64_t r) { return a.layer ? a.stats[2 * r + 1] : a.stats[r]; };
  parallel_for(rows, rows * K, [&](int64_t r0, int64_t r1) {
    std::vector<float> xh(K), dxh(K);
    for (int64_t r = r0; r < r1; ++r) {
      load_f32(a.x, a.xt, r * K, K, xh.data());
      load_f32(a.dy, a.dyt, r * K, K, dxh.data());
      const float mean = mean_of(r), rstd = rstd_of(r);
      for (int64_t k = 0; k < K; ++k) {
        xh[k] = norm_xhat_f(xh[k], mean, rstd);
        dxh[k] = dxh[k] * g[k];
      }
      const float c1 = a.layer ? row_sum(K, [&](int64_t k) { return dxh[k]; }) * a.inv_k : 0.0f;
      const float c2 = row_sum(K, [&](int64_t k) { return dxh[k] * xh[k]; }) * a.inv_k;
      for (int64_t k = 0; k < K; ++k) store_as(a.dxt, a.dx, r * K + k, norm_dx_f(dxh[k], xh[k], rstd, c1, c2));
    }
  });
  constexpr int64_t kCols = 64;  // columns per range
  parallel_for(cdiv(K, kCols), rows * K, [&](int64_t j0, int64_t j1) {
    std::vector<float> xr(kCols), dr(kCols), part(2 * kCols), total(2 * kCols);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t k0 = j * kCols, w = std::min(kCols, K - k0);
      std::fill(total.begin(), total.end(), 0.0f);
      for (int64_t b = 0; b < a.B; ++b)
        for (int64_t m0 = 0; m0 < a.M; m0 += kGradRows) {
          std::fill(part.begin(), part.end(), 0.0f);
          for (int64_t r = b * a.M + m0; r < b * a.M + std::min(a.M, m0 + kGradRows); ++r) {
            load_f32(a.x, a.xt, r * K + k0, w, xr.data());
            load_f32(a.dy, a.dyt, r * K + k0, w, dr.data());
            const float mean = mean_of(r), rstd = rstd_of(r);
            for (int64_t k = 0; k < w; ++k) {
              part[k] = part[k] + dr[k] * norm_xhat_f(xr[k], mean, rstd);
              part[kCols + k] = part[kCols + k] + dr[k];
            }
          }
          for (int64_t k = 0; k < 2 * kCols; ++k) total[k] = total[k] + part[k];
        }
      for (int i = 0; i < a.n_sums(); ++i)
        for (int64_t k = 0; k < w; ++k) a.sums[i * K + k0 + k] = canonical_f32(total[i * kCols + k]);
    }
  });
  return ffi::Error::Success();
}

// out[b, r, k] = decode(data[b, r, k]) * scale[b, r / bm, k / bk], rounded to the output dtype.
template <class Rule, class Store>
void dequantize_blocks(const uint8_t* data, const typename Rule::ScaleT* scale, int64_t B, int64_t M,
                       int64_t K, int bm, int bk, int fp8, Store store) {
  const int64_t sm = cdiv(M, bm), sk = cdiv(K, bk);
  float lut[256];  // every FP8 byte decoded once
  for (int i = 0; i < 256; ++i) lut[i] = fp8_to_float(uint8_t(i), fp8);
  parallel_for(B * M, B * M * K, [&](int64_t rr0, int64_t rr1) {
    std::vector<float> s(sk);
    for (int64_t rr = rr0; rr < rr1; ++rr) {
      const int64_t b = rr / M, r = rr % M;
      const typename Rule::ScaleT* srow = scale + (b * sm + r / bm) * sk;
      for (int64_t j = 0; j < sk; ++j) s[j] = Rule::dequant_scale(srow[j]);
      const int64_t base = rr * K;
      for_blocks_in(0, K, bk, [&](int64_t k0, int64_t k1, int64_t j) {
        for (int64_t k = k0; k < k1; ++k) store(base + k, lut[data[base + k]] * s[j]);
      });
    }
  });
}

template <class Rule>
ffi::Error dequantize_typed(const uint8_t* d, const void* s, ffi::Result<ffi::AnyBuffer>& out, int64_t B,
                            int64_t M, int64_t K, int bm, int bk, int fp8) {
  const auto* sc = static_cast<const typename Rule::ScaleT*>(s);
  void* o = out->untyped_data();
  switch (out->element_type()) {
    case ffi::DataType::F32:
      dequantize_blocks<Rule>(d, sc, B, M, K, bm, bk, fp8,
                              [o](int64_t i, float v) { static_cast<float*>(o)[i] = canonical_f32(v); });
      break;
    case ffi::DataType::BF16:
      dequantize_blocks<Rule>(d, sc, B, M, K, bm, bk, fp8,
                              [o](int64_t i, float v) { static_cast<uint16_t*>(o)[i] = bf16_from_float(v); });
      break;
    case ffi::DataType::F16:
      dequantize_blocks<Rule>(d, sc, B, M, K, bm, bk, fp8,
                              [o](int64_t i, float v) { static_cast<uint16_t*>(o)[i] = f16_from_float(v); });
      break;
    default:
      return bad("dequantize output must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

// data: (B, M, K) uint8 FP8 bytes; scale: the compact scale grid of the scheme's one output (GEMM-ready
// tensors are compacted before they are dequantized). out: (B, M, K) float32 / bfloat16 / float16.
ffi::Error DequantizeCpu(ffi::AnyBuffer data, ffi::AnyBuffer scale, ffi::Result<ffi::AnyBuffer> out, Scheme scheme) {
  int64_t B, M, K;
  Output u;
  if (auto e = make_dequantize_args(data, scale, scheme, &B, &M, &K, &u); e.failure()) return e;
  IeeeFpEnv env;
  const auto* d = static_cast<const uint8_t*>(data.untyped_data());
  return with_rule_type(scheme, [&](auto rule) {
    return dequantize_typed<decltype(rule)>(d, scale.untyped_data(), out, B, M, K, u.bm, u.bk, scheme.fp8);
  });
}


// ---- master-weight shards: partial amax and partial cast --------------------------------------

// Walk the shard's valid elements [0, n) one row segment at a time: f(j0, r, c0, c1) covers shard
// elements j0 .. j0 + (c1 - c0) of weight row r, columns [c0, c1).
template <class F>
void for_shard_rows(const QuantizeArgs& a, int64_t off, int64_t n, F f) {
  for (int64_t j = 0; j < n;) {
    const int64_t r = (off + j) / a.K, c0 = (off + j) % a.K;
    const int64_t c1 = std::min(a.K, c0 + (n - j));
    f(j, r, c0, c1);
    j += c1 - c0;
  }
}

template <class L>
void partial_amax(const QuantizeArgs& a, const void* shard, int64_t off, int64_t n, const Output& u, void* out) {
  const auto* x = static_cast<const typename L::T*>(shard);
  const int64_t sk = cdiv(a.K, u.bk), nb = n_blocks(a.M, a.K, u.bm, u.bk);
  std::vector<float> amax(nb, 0.0f), row(a.K);
  for_shard_rows(a, off, n, [&](int64_t j0, int64_t r, int64_t c0, int64_t c1) {
    float* arow = amax.data() + (r / u.bm) * sk;
    for (int64_t c = c0; c < c1; ++c) row[c] = L::get(x, j0 + c - c0);
    if (u.bk == 1) {
      for (int64_t c = c0; c < c1; ++c) arow[c] = amax_step(arow[c], row[c]);
    } else {
      for_blocks_in(c0, c1, u.bk, [&](int64_t c, int64_t end, int64_t j) {
        arow[j] = amax_span(row.data() + c, end - c, arow[j]);
      });
    }
  });
  with_rule(a, [&](auto rule) {
    using S = typename decltype(rule)::ScaleT;
    for (int64_t i = 0; i < nb; ++i) static_cast<S*>(out)[i] = rule.partial(amax[i]);
  });
}

// grid: the global scales (E8M0 bytes) or amaxes (fp32). Writes the shard's shard_len FP8 bytes (0 past
// n) and, for fp32 scales, the scale_inv grid.
template <class L>
void partial_cast(const QuantizeArgs& a, const void* shard, int64_t shard_len, int64_t off, int64_t n,
                  const Output& u, const void* grid, uint8_t* data, float* scale_inv) {
  const auto* x = static_cast<const typename L::T*>(shard);
  const int64_t sk = cdiv(a.K, u.bk), nb = n_blocks(a.M, a.K, u.bm, u.bk);
  std::vector<float> mult(nb);
  with_rule(a, [&](auto rule) {
    using S = typename decltype(rule)::ScaleT;
    S stored;
    for (int64_t i = 0; i < nb; ++i) {  // fp32 scales: every rank writes the same scale_inv grid
      rule.from_global(static_cast<const S*>(grid)[i], stored, mult[i]);
      if (scale_inv) scale_inv[i] = float(stored);
    }
  });
  std::fill(data, data + shard_len, uint8_t(0));
  std::vector<float> row(a.K);
  for_shard_rows(a, off, n, [&](int64_t j0, int64_t r, int64_t c0, int64_t c1) {
    const float* mrow = mult.data() + (r / u.bm) * sk;
    for (int64_t c = c0; c < c1; ++c) row[c] = L::get(x, j0 + c - c0);
    if (u.bk == 1) {
      cast_span<1>(row.data() + c0, mrow + c0, data + j0, c1 - c0, a.fp8);
    } else {
      for_blocks_in(c0, c1, u.bk, [&](int64_t c, int64_t end, int64_t j) {
        cast_span<0>(row.data() + c, mrow + j, data + j0 + c - c0, end - c, a.fp8);
      });
    }
  });
}

// Weight w's arguments; its shard's offset and valid elements [0, n), n = clip(min(length, L, M*K - offset), 0).
inline QuantizeArgs weight_args(const QuantizeArgs& a, const GroupWeight& w) {
  QuantizeArgs aw = a;
  aw.M = w.M;
  aw.K = w.K;
  return aw;
}
inline std::pair<int64_t, int64_t> shard_window(const GroupWeight& w, const int32_t* win, size_t i) {
  const int64_t off = win[2 * i];
  return {off, std::max<int64_t>(0, std::min({int64_t(win[2 * i + 1]), w.L, w.M * w.K - off}))};
}

// Runs f(i) for every weight of a group, a large group's weights spread over the cores (as XLA
// would run one call per weight side by side).
template <class F>
void for_weights(const std::vector<GroupWeight>& g, F f) {
  int64_t elements = 0;
  for (const GroupWeight& w : g) elements += w.L;
  parallel_for(int64_t(g.size()), elements, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) f(size_t(i));
  });
}

// windows: (N, 2) int32 (offset, length) per shard; shards: N flat buffers of one dtype. packed: every
// weight's partial values (E8M0 bytes or fp32 amaxes), packed as Scheme.packed_grids lays them out.
ffi::Error PartialAmaxCpu(ffi::AnyBuffer windows, ffi::RemainingArgs shards, ffi::Result<ffi::AnyBuffer> packed,
                          ffi::Span<const int64_t> Ms, ffi::Span<const int64_t> Ks, Scheme scheme) {
  QuantizeArgs a;
  std::vector<GroupWeight> g;
  if (auto e = make_amax_group(windows, shards, *packed, Ms, Ks, scheme, &a, &g); e.failure()) return e;
  const auto* win = static_cast<const int32_t*>(windows.untyped_data());
  auto* out = static_cast<char*>(packed->untyped_data());
  const size_t item = scale_bytes(a.format);
  for_weights(g, [&](size_t i) {
    const QuantizeArgs aw = weight_args(a, g[i]);
    const auto [off, n] = shard_window(g[i], win, i);
    for (int k = 0; k < a.n_out; ++k)
      with_loader(a.in, [&](auto ld) {
        partial_amax<decltype(ld)>(aw, g[i].x, off, n, a.out[k], out + g[i].at[k] * item);
      });
  });
  return ffi::Error::Success();
}

// windows, shards: as above; global: the packed reduced values. scale_inv: the packed fp32 scale_inv
// (empty for E8M0 scales); datas: each shard's FP8 bytes per output (zeros past its elements).
ffi::Error PartialCastCpu(ffi::AnyBuffer windows, ffi::AnyBuffer global, ffi::RemainingArgs shards,
                          ffi::Result<ffi::AnyBuffer> scale_inv, ffi::RemainingRets datas, ffi::Span<const int64_t> Ms,
                          ffi::Span<const int64_t> Ks, Scheme scheme) {
  QuantizeArgs a;
  std::vector<GroupWeight> g;
  std::vector<uint8_t*> data;
  if (auto e = make_cast_group(windows, global, shards, *scale_inv, datas, Ms, Ks, scheme, &a, &g, &data);
      e.failure())
    return e;
  const int nu = a.n_out;
  const auto* win = static_cast<const int32_t*>(windows.untyped_data());
  const auto* glob = static_cast<const char*>(global.untyped_data());
  auto* sinv = static_cast<float*>(scale_inv->untyped_data());
  const size_t item = scale_bytes(a.format);
  for_weights(g, [&](size_t i) {
    const QuantizeArgs aw = weight_args(a, g[i]);
    const auto [off, n] = shard_window(g[i], win, i);
    for (int k = 0; k < nu; ++k)
      with_loader(a.in, [&](auto ld) {
        partial_cast<decltype(ld)>(aw, g[i].x, g[i].L, off, n, a.out[k], glob + g[i].at[k] * item, data[i * nu + k],
                                   partials_are_scales(a.format) ? nullptr : sinv + g[i].at[k]);
      });
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jf

namespace ffi = xla::ffi;

// Every handler of ffi_bindings.h's list (jf::<Name>Cpu above), bound with no context and no traits.
JF_FFI_DEFINE_HANDLERS(Cpu, ffi::Ffi::Bind(), {})

NB_MODULE(_jax_fp8_cpu, m) {
  m.def("registrations", []() {
    nanobind::dict d;
    JF_FFI_REGISTER_HANDLERS(Cpu, d)
    return d;
  });
}
