// The batch-invariant float32 GEMM tile, shared by qgemm.cpp (float layers
// inside quantized models) and lora.cpp (LoRA deltas), so both compute the
// same float operations:
//
//   res[r][l] = fma(x[r][k], w[k][l], acc) for k = 0 .. K-1, in order, from 0,
//
// for R rows (R <= 4) of one 16-wide tile of weights packed [K][16], on every
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

template <int R>
__attribute__((target("avx2,fma"))) static void tile_avx2(const float* x, int64_t ldx, const float* w, int64_t K,
                                                           float* res) {
  __m256 a0[R], a1[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kWidth), w1 = _mm256_loadu_ps(w + k * kWidth + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_set1_ps(x[r * ldx + k]);
      a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(res + r * kWidth, a0[r]);
    _mm256_storeu_ps(res + r * kWidth + 8, a1[r]);
  }
}

template <int R>
__attribute__((target("avx512f,avx2,fma"))) static void tile_avx512(const float* x, int64_t ldx, const float* w,
                                                                     int64_t K, float* res) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 wv = _mm512_loadu_ps(w + k * kWidth);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + k]), wv, a[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(res + r * kWidth, a[r]);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*);

// [isa: 0 scalar, 1 avx2, 2 avx512][rows - 1]
static const TileFn kTiles[3][4] = {
    {tile_scalar<1>, tile_scalar<2>, tile_scalar<3>, tile_scalar<4>},
    {tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>},
    {tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>},
};

}  // namespace sluice::fp32_tile
