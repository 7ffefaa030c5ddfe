// AVX-512 pieces shared by the zmm (qgemm.cpp) and AMX (qgemm_amx.cpp) paths of the
// quantized GEMM: the scale loads and the float epilogue of one block, so the two
// paths perform the same float operations in the same order by construction.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "qgemm.h"

#define TGT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

namespace sluice {

// index of the first of the 16 scales of group g in tile t
inline int64_t sidx(const WPack& w, int64_t tile, int64_t g) { return (tile * w.NG + g) * kTile; }

// NOTE(weight-prefetch): a step streams every weight from memory once (98 MB for
// SmolLM2 Q4_1, far more than the caches), in short runs: one GEMM of a layer is
// 0.2-1.1 MB, split over the threads.  The hardware prefetchers ramp up too late
// for runs that short: a 1.1 MB GEMM at one row read its weights at 6 GB/s cold
// against 23 GB/s for a plain sum over memory.  So the kernels ask for the bytes
// kPrefetchBytes past the block in use (and the matching scale and min rows).
// Measured on a 2-core Sapphire Rapids, in-process lone prompts, three
// alternating rounds: 1 token 7.9-8.4 -> 7.2-7.3 ms, 13 tokens 11.2-11.6 ->
// 10.3-10.8 ms (1024 gained less; 6144 the same).  Prefetches have no effect on
// the results, and one past the end of an array is harmless (it never faults).
constexpr int64_t kPrefetchBytes = 2048;

// Ask for the weight bytes (bb a block) `ahead` bytes past block kb of a tile, and
// the scale / min rows as far ahead (one row of 16 per block when G = 32).
// (no target attribute: prefetches are baseline x86-64, and the AVX2 kernels inline it too)
template <bool F16>
inline __attribute__((always_inline)) void prefetch_weights(const WPack& w, const uint8_t* block, int64_t bb,
                                                           int64_t tile, int64_t kb, int64_t ahead) {
  for (int64_t c = 0; c < bb; c += 64) _mm_prefetch(reinterpret_cast<const char*>(block + ahead + c), _MM_HINT_T0);
  if (w.G != kBlock) return;
  const int64_t es = F16 ? 2 : 4, off = (sidx(w, tile, kb) + ahead / bb * kTile) * es;
  _mm_prefetch(static_cast<const char*>(w.scale) + off, _MM_HINT_T0);
  _mm_prefetch(static_cast<const char*>(w.mins) + off, _MM_HINT_T0);
}

template <bool F16>
TGT_AVX512 inline __attribute__((always_inline)) __m512 load16(const void* base, int64_t idx) {
  if constexpr (F16)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + idx)));
  else
    return _mm512_loadu_ps(static_cast<const float*>(base) + idx);
}

// Block kb of rows m0..m0+R-1 of one tile, after its exact int32 sums: s0[r] holds
// row r's sums over the block (over its first half when the groups are split,
// G = 16, and s1[r] over the second half); acc[r] takes the float steps of qgemm.h.
template <bool F16>
TGT_AVX512 inline __attribute__((always_inline)) void zmm_epilogue(const ActQ& a, int64_t m0, int R, const WPack& w,
                                                                  int64_t tile, int64_t kb, const __m512i* s0,
                                                                  const __m512i* s1, __m512* __restrict__ acc) {
  const int64_t KB = w.KB;
  // NOTE(epilogue-codegen): locals, restrict-qualified: without them GCC reloaded
  // a.dx / a.dxs through `a` and stored acc[r] after each of its two steps (the
  // stores might have aliased them); and the group of block kb without a 64-bit
  // division when the group is one block (G = 32, every GGUF format), ~20 cycles
  // a call.  The float operations and their order are unchanged.
  // The row loops are unrolled whole (a constant R: tile_zmm<R>, and the AMX path's full
  // tiles) so that acc[] can live in registers (NOTE(amx-acc-regs) in qgemm_amx.cpp).
  const float* __restrict__ dxr = a.dx + m0 * KB + kb;
  const float* __restrict__ dxsr = a.dxs + m0 * KB + kb;
  if (w.G != 16) {
    const int64_t g = w.G == kBlock ? kb : kb * kBlock / w.G;
    const __m512 d = load16<F16>(w.scale, sidx(w, tile, g));
    const __m512 mn = load16<F16>(w.mins, sidx(w, tile, g));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 ddx = _mm512_mul_ps(d, _mm512_set1_ps(dxr[r * KB]));
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), ddx, acc[r]);
      v = _mm512_fmadd_ps(mn, _mm512_set1_ps(dxsr[r * KB]), v);
      acc[r] = v;
    }
  } else {
    const __m512 d0 = load16<F16>(w.scale, sidx(w, tile, 2 * kb));
    const __m512 d1 = load16<F16>(w.scale, sidx(w, tile, 2 * kb + 1));
    const __m512 n0 = load16<F16>(w.mins, sidx(w, tile, 2 * kb));
    const __m512 n1 = load16<F16>(w.mins, sidx(w, tile, 2 * kb + 1));
    const float* __restrict__ dxs16r = a.dxs16 + m0 * 2 * KB + 2 * kb;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(dxr[r * KB]);
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0[r]), _mm512_mul_ps(d0, dx), acc[r]);
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1[r]), _mm512_mul_ps(d1, dx), v);
      v = _mm512_fmadd_ps(n0, _mm512_set1_ps(dxs16r[r * 2 * KB]), v);
      v = _mm512_fmadd_ps(n1, _mm512_set1_ps(dxs16r[r * 2 * KB + 1]), v);
      acc[r] = v;
    }
  }
}

}  // namespace sluice
