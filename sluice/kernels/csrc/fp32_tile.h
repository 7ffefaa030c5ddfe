// The batch-invariant float32 GEMM tile, shared by qgemm.cpp (float layers
// inside quantized models) and lora.cpp (LoRA deltas), so both compute the
// same float operations:
//
//   res[r][l] = fma(x[r][k], w[k][l], acc) for k = 0 .. K-1, in order, from 0,
//
// for R rows of T adjacent 16-wide tiles of weights packed [K][16], on every
// ISA path (compiled without FP contraction; an fma rounds once everywhere).
// ``x`` points at the tile's first row, ``ldx`` apart.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace sluice::fp32_tile {

constexpr int64_t kWidth = 16;

template <int R>
static void tile_scalar(const float* x, int64_t ldx, const float* w, int64_t K, float* res) {
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * ldx;
    for (int l = 0; l < kWidth; ++l) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(xr[k], w[k * kWidth + l], acc);
      res[r * kWidth + l] = acc;
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*);

// NOTE(fp32-streams): one tile keeps one accumulator chain per row, so at one or two rows (a decode, a
// verification of few drafts) a thread waited on the fma latency, not on memory: 22 GB/s for SmolLM2's
// float layers at one row where BLAS's gemv reads 38.  ``multi_*<R, T>`` run T adjacent tiles (T weight
// streams, packed ``K * kWidth`` floats apart) for R rows at once: R x T independent chains.  Each output
// lane is still fma(x[r][k], w[k][l], acc) for k = 0 .. K-1 in order, from 0: the same bits as
// ``tile_scalar`` for any R and T.  ``res`` holds tile t's row r at ``(t * kMaxRows + r) * kWidth``.
constexpr int kMaxRows = 8;   // rows in one pass on AVX-512 (R x T <= 16 of its 32 registers)
constexpr int kMaxStreams = 4;

template <int R, int T>
__attribute__((target("avx512f,avx2,fma"))) static void multi_avx512(const float* x, int64_t ldx, const float* w,
                                                                      int64_t K, float* res) {
  __m512 a[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) a[t][r] = _mm512_setzero_ps();
  const int64_t ts = K * kWidth;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[T];
    for (int t = 0; t < T; ++t) wv[t] = _mm512_loadu_ps(w + t * ts + k * kWidth);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      for (int t = 0; t < T; ++t) a[t][r] = _mm512_fmadd_ps(xb, wv[t], a[t][r]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(res + (t * kMaxRows + r) * kWidth, a[t][r]);
}

template <int R, int T>
__attribute__((target("avx2,fma"))) static void multi_avx2(const float* x, int64_t ldx, const float* w, int64_t K,
                                                            float* res) {
  __m256 a0[T][R], a1[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) a0[t][r] = a1[t][r] = _mm256_setzero_ps();
  const int64_t ts = K * kWidth;
  for (int64_t k = 0; k < K; ++k) {
    for (int t = 0; t < T; ++t) {
      const __m256 w0 = _mm256_loadu_ps(w + t * ts + k * kWidth), w1 = _mm256_loadu_ps(w + t * ts + k * kWidth + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_set1_ps(x[r * ldx + k]);
        a0[t][r] = _mm256_fmadd_ps(xb, w0, a0[t][r]);
        a1[t][r] = _mm256_fmadd_ps(xb, w1, a1[t][r]);
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(res + (t * kMaxRows + r) * kWidth, a0[t][r]);
      _mm256_storeu_ps(res + (t * kMaxRows + r) * kWidth + 8, a1[t][r]);
    }
}

template <int R, int T>
static void multi_scalar(const float* x, int64_t ldx, const float* w, int64_t K, float* res) {
  for (int t = 0; t < T; ++t) {
    alignas(64) float one[R * kWidth];
    tile_scalar<R>(x, ldx, w + t * K * kWidth, K, one);
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kWidth; ++l) res[(t * kMaxRows + r) * kWidth + l] = one[r * kWidth + l];
  }
}

// [isa: 0 scalar, 1 avx2, 2 avx512][rows - 1]: one tile (lora.cpp, moe_op.cpp; ``res`` is [r][16], the
// layout of ``multi_*<R, 1>``)
static const TileFn kTiles[3][4] = {
    {tile_scalar<1>, tile_scalar<2>, tile_scalar<3>, tile_scalar<4>},
    {multi_avx2<1, 1>, multi_avx2<2, 1>, multi_avx2<3, 1>, multi_avx2<4, 1>},
    {multi_avx512<1, 1>, multi_avx512<2, 1>, multi_avx512<3, 1>, multi_avx512<4, 1>},
};

// The most rows of one pass, and the streams for a pass of ``rows`` rows, on an ISA (0 scalar, 1 avx2,
// 2 avx512): accumulators within the registers (AVX2: 16 ymm, two per row and tile).
inline int max_rows(int isa) { return isa == 2 ? kMaxRows : 4; }
inline int streams_for(int isa, int rows) {
  if (isa == 2) return rows <= 6 ? 4 : 2;
  if (isa == 1) return rows == 1 ? 4 : (rows == 2 ? 2 : 1);
  return 1;
}

template <int R>
static TileFn multi_fn(int isa, int t) {
  if (isa == 2) {
    if constexpr (R <= kMaxRows) return t == 4 ? multi_avx512<R, 4> : (t == 2 ? multi_avx512<R, 2> : multi_avx512<R, 1>);
  }
  if constexpr (R <= 4) {
    if (isa == 1) return t == 4 ? multi_avx2<R, 4> : (t == 2 ? multi_avx2<R, 2> : multi_avx2<R, 1>);
    return t == 4 ? multi_scalar<R, 4> : (t == 2 ? multi_scalar<R, 2> : multi_scalar<R, 1>);
  }
  return nullptr;
}

// ``rows`` (<= max_rows(isa)) rows of ``t`` (1, 2 or 4; at most streams_for) adjacent tiles.
inline TileFn multi(int isa, int rows, int t) {
  switch (rows) {
    case 1: return multi_fn<1>(isa, t);
    case 2: return multi_fn<2>(isa, t);
    case 3: return multi_fn<3>(isa, t);
    case 4: return multi_fn<4>(isa, t);
    case 5: return multi_fn<5>(isa, t);
    case 6: return multi_fn<6>(isa, t);
    case 7: return multi_fn<7>(isa, t);
    default: return multi_fn<8>(isa, t);
  }
}

}  // namespace sluice::fp32_tile
