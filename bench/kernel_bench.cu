// Kernel-level benchmark of the CUDA quantize/dequantize kernels, without Python or XLA: CUDA-event
// timing of many back-to-back launches over three rotating inputs (so L2 holds none of them), median
// of several runs, against a device-to-device cudaMemcpy. Used to choose the kernels' launch
// configuration (registers per thread, dequantize unroll and grid); bench_kernels.py times the
// shipped configuration through JAX against the XLA-fused reference.
// Before timing, every configuration is checked bit for bit against a host loop over the shared
// per-block math (fp8_math.h) on an odd-shaped input.
//
//   bash bench/build_kernel_bench.sh && bench/.bin/kernel_bench [M K [FILTER]]   (default 32768 16384)
// FILTER runs only the quantize cases whose names contain it ("dequant": dequantize and the traffic
// ceilings), e.g. to profile one kernel: ncu -k regex:tile_kernel --launch-skip 2 --launch-count 1 ...
#include "kernel_bench_cases.cuh"
#include "kernel_bench_traffic.cuh"

// Times every case whose name contains `only`, each checked first.
void bench_cases(const std::vector<Case>& cases, const Inputs& in, const Report& report, const std::string& only) {
  const int64_t M = in.M, K = in.K, n = in.n;
  const std::vector<Buf*>& xs = in.xs;
  for (const Case& c : cases) {
    if (c.name.find(only) == std::string::npos) continue;
    const int64_t b = c.mx ? 32 : 128;
    const int64_t item = c.mx ? 1 : 4;
    // outputs: one per usage; GEMM-ready tiles write both orientations
    const int usages = (c.row_bk > 0) + (c.col_bm > 0) + (c.tile > 0) * (c.gemm_ready ? 2 : 1);
    const int64_t n_scales = c.tile ? n / (b * b) : n / b;
    // one set of outputs per input buffer, so that no launch finds the previous one's outputs (its
    // scales above all, stored with an L2 policy that keeps them) still in L2
    std::unique_ptr<Outputs> o[3];
    for (auto& oi : o) oi = std::make_unique<Outputs>(n, 2 * n_scales + 4096, 2 * n_scales + 4096, item);  // room for padded GEMM-ready grids
    const bool ok = check(c);
    const QuantizeArgs a = args_of(c, M, K);
    const double us = time_us([&](int i) { c.launch(a, xs[i]->p, dense_span(M, K, c.group), o[i]->ptrs()); });
    report(c.name, us,
           double(n) * 2 + usages * double(n + n_scales * item), ok ? "exact" : "MISMATCH");
  }
}

// Many small weights (launch overhead on the GPU side, no host dispatch): 64 launches of case c (mx
// row+col) on separate 1024x1024 tensors back to back against one launch on the same bytes stacked as
// (64*1024) x 1024, whose outputs are identical (column blocks of 32 rows never cross a 1024-row
// boundary).
void bench_many_tensors(const Case& c, const Inputs& in) {
  const std::vector<Buf*>& xs = in.xs;
  if (in.n < 64 * 1024 * 1024) return;
  const int64_t T = 64, m = 1024, k = 1024;
  Outputs o(T * m * k, T * m * k / 32, T * m * k / 32, 1);
  const QuantizeArgs one = args_of(c, m, k), all = args_of(c, T * m, k);
  const OutPtrs op = o.ptrs();
  const double t_many = time_us([&](int i) {
    for (int64_t j = 0; j < T; ++j) {
      const OutPtrs v{op.d0 + j * m * k, static_cast<uint8_t*>(op.s0) + j * m * k / 32, op.d1 + j * m * k,
                      static_cast<uint8_t*>(op.s1) + j * m * k / 32};
      c.launch(one, xs[i]->as<uint16_t>() + j * m * k, dense_span(m, k, 1), v);
    }
  });
  const double t_one = time_us([&](int i) { c.launch(all, xs[i]->p, dense_span(T * m, k, 1), op); });
  std::printf("%lld launches of mx row+col on 1024x1024: %.1f us (%.2f us per tensor); one launch on the "
              "%lldx1024 stack: %.1f us (%.2f us per tensor)\n",
              (long long)T, t_many, t_many / T, (long long)(T * m), t_one, t_one / T);
}

// Partial amax / cast of a master-weight shard: half the weight, from element n/4. The amax as
// shipped (fill and tile CTAs in one launch) against the fill and the tiles as two launches, and
// against the previous scheme (memsets of both grids, then the tiles); the first and last must agree.
void bench_shard(const Inputs& in, const Report& report) {
  const int64_t M = in.M, K = in.K, n = in.n;
  const std::vector<Buf*>& xs = in.xs;
  const int64_t L = n / 2;
  Buf win(8);
  const int32_t hv[2] = {int32_t(n / 4), int32_t(L)};
  CUDA_OK(cudaMemcpy(win.p, hv, 8, cudaMemcpyHostToDevice));
  const QuantizeArgs a = bf16_args(true, 32, 32, 0, M, K);
  Outputs o(L, n / 32, n / 32, 1);
  const auto io = [&](int i, bool cast) {
    return ShardIO{xs[i]->p, L, M, K, win.as<int32_t>(),
                   {cast ? o.d0.as<uint8_t>() : nullptr, cast ? o.d1.as<uint8_t>() : nullptr},
                   {cast ? nullptr : o.s0.p, cast ? nullptr : o.s1.p},
                   {cast ? o.s0.p : nullptr, cast ? o.s1.p : nullptr}};
  };
  const auto amax = [&](int i, Part part) { launch_one_shard<kAmax>(a, io(i, false), part); };
  const auto memset_tiles = [&](int i) {
    cudaMemsetAsync(o.s0.p, 0, n / 32);
    cudaMemsetAsync(o.s1.p, 0, n / 32);
    amax(i, Part::kTiles);
  };
  const auto grids = [&] {
    std::vector<uint8_t> h(2 * (n / 32));
    CUDA_OK(cudaMemcpy(h.data(), o.s0.p, n / 32, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(h.data() + n / 32, o.s1.p, n / 32, cudaMemcpyDeviceToHost));
    return h;
  };
  memset_tiles(0);
  const std::vector<uint8_t> want = grids();
  CUDA_OK(cudaMemset(o.s0.p, 0xAB, n / 32));
  CUDA_OK(cudaMemset(o.s1.p, 0xAB, n / 32));
  amax(0, Part::kAll);
  const char* same_amax = grids() == want ? "same" : "MISMATCH";
  const double amax_bytes = double(L) * 2 + 2.0 * (n / 32);
  report("partial amax mx r+c (one launch)", time_us([&](int i) { amax(i, Part::kAll); }), amax_bytes, same_amax);
  report("partial amax: fill, tiles (two)", time_us([&](int i) {
           amax(i, Part::kFill);
           amax(i, Part::kTiles);
         }), amax_bytes, "-");
  report("partial amax: memsets + tiles", time_us(memset_tiles), amax_bytes, "-");
  report("partial amax: tiles alone", time_us([&](int i) { amax(i, Part::kTiles); }), amax_bytes, "-");
  // the shipped one-launch amax against other register caps (CTAs per SM) and the fill CTAs last
  const auto variant = [&](auto minb, auto fill_last) {
    constexpr int B = decltype(minb)::value;
    constexpr bool LAST = decltype(fill_last)::value;
    const auto go = [&](int i) { launch_one_shard<kAmax, B, LAST>(a, io(i, false)); };
    CUDA_OK(cudaMemset(o.s0.p, 0xAB, n / 32));
    CUDA_OK(cudaMemset(o.s1.p, 0xAB, n / 32));
    go(0);
    const char* same = grids() == want ? "same" : "MISMATCH";
    report("partial amax " + std::to_string(B) + " CTAs/SM, fill " + (LAST ? "last" : "first"), time_us(go),
           amax_bytes, same);
  };
  using std::integral_constant;
  variant(integral_constant<int, 4>{}, std::false_type{});
  variant(integral_constant<int, 5>{}, std::false_type{});
  variant(integral_constant<int, 6>{}, std::true_type{});
  const auto cast = [&](int i, Part part) { launch_one_shard<kCast>(a, io(i, true), part); };
  const double cast_bytes = double(L) * 2 + 2.0 * L + 2.0 * (n / 32);
  report("partial cast mx r+c (one launch)", time_us([&](int i) { cast(i, Part::kAll); }), cast_bytes, "-");
  report("partial cast: tiles alone", time_us([&](int i) { cast(i, Part::kTiles); }), cast_bytes, "-");
  report("partial cast 4 CTAs/SM", time_us([&](int i) { launch_one_shard<kCast, 4>(a, io(i, true)); }), cast_bytes,
         "-");
}

// Many small master weights: 64 weights of 1024x1024, a rank's 1/8 shard of each; one group launch
// per 24 weights against one launch per weight (the same kernel, group of one).
void bench_grouped_shards(const Inputs& in) {
  const std::vector<Buf*>& xs = in.xs;
  if (in.n < 64 * 1024 * 1024) return;
  const int64_t T = 64, mk = 1024 * 1024, L = mk / 8;
  Buf win(8);
  const int32_t hv[2] = {int32_t(3 * L), int32_t(L)};
  CUDA_OK(cudaMemcpy(win.p, hv, 8, cudaMemcpyHostToDevice));
  const QuantizeArgs a = bf16_args(true, 32, 32, 0, 0, 0);
  Outputs o(T * L, T * mk / 32, T * mk / 32, 1);
  const auto ios = [&](int i, bool cast) {
    std::vector<ShardIO> v;
    for (int64_t j = 0; j < T; ++j) {
      uint8_t* s0 = o.s0.as<uint8_t>() + j * mk / 32;
      uint8_t* s1 = o.s1.as<uint8_t>() + j * mk / 32;
      v.push_back(ShardIO{xs[i]->as<uint16_t>() + j * L, L, 1024, 1024, win.as<int32_t>(),
                          {cast ? o.d0.as<uint8_t>() + j * L : nullptr, cast ? o.d1.as<uint8_t>() + j * L : nullptr},
                          {cast ? nullptr : s0, cast ? nullptr : s1},
                          {cast ? s0 : nullptr, cast ? s1 : nullptr}});
    }
    return v;
  };
  for (const bool is_cast : {false, true}) {
    const std::vector<ShardIO> v[3] = {ios(0, is_cast), ios(1, is_cast), ios(2, is_cast)};
    const auto run = [&](const ShardIO* w, int k) {
      if (is_cast) launch_shards<kCast>(nullptr, a, w, k);
      else launch_shards<kAmax>(nullptr, a, w, k);
    };
    const double t_group = time_us([&](int i) { run(v[i].data(), int(T)); });
    const double t_each = time_us([&](int i) {
      for (int64_t j = 0; j < T; ++j) run(&v[i][j], 1);
    });
    std::printf("partial %s, %lld weights 1024x1024 (1/8 shards): grouped %.2f us per weight, one launch each "
                "%.2f us per weight (%.2fx)\n",
                is_cast ? "cast" : "amax", (long long)T, t_group / T, t_each / T, t_each / t_group);
  }
}

// Dequantize MXFP8 rowwise -> bf16: rows in flight per thread and grid size.
void bench_dequantize_sweep(const Inputs& in, const Report& report) {
  const int64_t M = in.M, K = in.K, n = in.n;
  const std::vector<Buf*>& xs = in.xs;
  Buf out(n * 2);
  const QuantizeArgs a = bf16_args(true, 32, 0, 0, M, K);
  Outputs q(n, n / 32, 0, 1);
  launch_tiles<LoadBF16, TileCfg<MxRule, 32, 256, 32, false, false>>(
      nullptr, a, xs[0]->p, MxRule{kE4M3}, Outs<uint8_t>{q.d0.as<uint8_t>(), q.s0.as<uint8_t>(), nullptr},
      Outs<uint8_t>{}, compact_scale_at(M, K, 1, 32), ScaleAt{});
  // host reference on the first 64 rows
  const int64_t R = std::min<int64_t>(64, M);
  std::vector<uint8_t> hd(R * K), hs(R * cdiv(K, 32));
  CUDA_OK(cudaMemcpy(hd.data(), q.d0.p, hd.size(), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(hs.data(), q.s0.p, hs.size(), cudaMemcpyDeviceToHost));
  std::vector<uint16_t> want(R * K);
  for (int64_t i = 0; i < R * K; ++i)
    want[i] = bf16_from_float(fp8_to_float(hd[i], kE4M3) * e8m0_to_float(hs[(i / K) * cdiv(K, 32) + (i % K) / 32]));
  const double bytes = double(n) + n / 32 + 2.0 * n;
  // B > 1: the same rows as B matrices of M / B rows (the same scales and output)
  const auto run = [&](auto unroll, auto vec, int per_sm, int64_t B = 1) {
    constexpr int U = decltype(unroll)::value, V = decltype(vec)::value;
    const auto go = [&](int) {
      bench_dequantize<MxRule, Store16<false>, V, U>(q.d0.p, q.s0.p, out.p, B, M / B, K, 1, 32, kE4M3, per_sm);
    };
    go(0);
    CUDA_OK(cudaDeviceSynchronize());
    std::vector<uint16_t> got(R * K);
    CUDA_OK(cudaMemcpy(got.data(), out.p, got.size() * 2, cudaMemcpyDeviceToHost));
    const bool ok = std::memcmp(got.data(), want.data(), got.size() * 2) == 0;
    report("dequant mx->bf16 vec " + std::to_string(V) + " unroll " + std::to_string(U) + " ctas/sm " +
               std::to_string(per_sm) + (B > 1 ? " B=" + std::to_string(B) : ""),
           time_us(go), bytes, ok ? "exact" : "MISMATCH");
  };
  using U1 = std::integral_constant<int, 1>;
  using U2 = std::integral_constant<int, 2>;
  using U4 = std::integral_constant<int, 4>;
  using U6 = std::integral_constant<int, 6>;
  using U8 = std::integral_constant<int, 8>;
  using V8 = std::integral_constant<int, 8>;
  using V16 = std::integral_constant<int, 16>;
  using V32 = std::integral_constant<int, 32>;
  using Shipped = std::integral_constant<int, kDeqUnroll>;
  using ShippedVec = std::integral_constant<int, kDeqVec>;
  run(Shipped{}, ShippedVec{}, kDeqCtasPerSm);  // the shipped configuration (launch_dequantize's)
  run(U4{}, V8{}, 32);
  run(U8{}, V8{}, 32);
  run(U8{}, V8{}, 16);
  run(U8{}, V8{}, 64);
  run(U6{}, V8{}, 32);
  run(U2{}, V8{}, 32);
  run(U2{}, V16{}, 32);
  run(U4{}, V16{}, 32);
  run(U2{}, V32{}, 32);
  if (M % 4 == 0) run(U4{}, V8{}, 64, 4);
  // shaped like the traffic ceiling below: one row per CTA (ctas/sm so large that gy = B*M)
  run(U1{}, V8{}, 1024);
}

int main(int argc, char** argv) {
  const int64_t M = argc > 2 ? std::atoll(argv[1]) : 32768, K = argc > 2 ? std::atoll(argv[2]) : 16384;
  // a third argument: run only the cases whose names contain it (for profiling one kernel)
  const std::string only = argc > 3 ? argv[3] : "";
  const int64_t n = M * K;
  cudaDeviceProp prop;
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs; bf16 %lldx%lld\n", prop.name, prop.multiProcessorCount, (long long)M, (long long)K);
  std::vector<Buf*> xs;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(new Buf(n * 2));
    fill_bf16<<<1024, 256>>>(xs[i]->as<uint16_t>(), n, 1234u + i);
  }
  Buf copy_out(n * 2);
  const double t_copy = time_us([&](int i) {
    cudaMemcpyAsync(copy_out.p, xs[i]->p, n * 2, cudaMemcpyDeviceToDevice);
  });
  const double copy_gbs = 2.0 * n * 2 / t_copy / 1e3;
  std::printf("%-34s %9s %8s %7s\n", "kernel", "us", "GB/s", "%copy");
  std::printf("%-34s %9.1f %8.0f %7.1f\n", "cudaMemcpy d2d", t_copy, copy_gbs, 100.0);
  const Report report{copy_gbs};
  const Inputs in{M, K, n, xs};
  const std::vector<Case> cases = make_cases();
  bench_cases(cases, in, report, only);
  // The rest runs without a filter; the filter "dequant" runs dequantize and the traffic ceilings only.
  const bool all = only.empty();
  if (all) {
    bench_many_tensors(cases[1], in);  // mx row+col
    bench_shard(in, report);
    bench_grouped_shards(in);
  }
  if (all || only == "dequant") {
    bench_dequantize_sweep(in, report);
    bench_flat_ceilings(in, report);
    bench_tiled_ceilings(in, report);
  }
  for (Buf* b : xs) delete b;
  return 0;
}
