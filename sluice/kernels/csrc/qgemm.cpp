// Quantized GEMM kernels: see qgemm.h for the layout and the arithmetic.
//
// Each ISA path is a set of functions compiled with a GCC target attribute
// (no -march=native anywhere), chosen at run time by the caller from
// cpu_features().  All paths compute bit-identical results.
#include "qgemm.h"
#include "fp32_tile.h"
#include "qgemm_zmm.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include <cmath>
#include <cstring>

#include "work_pool.h"

namespace sluice {

#define TGT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TGT_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))

static inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// fp16 -> fp32 (exact), the same value vcvtph2ps gives.
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ff;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline float scale_at(const WPack& w, const void* base, int64_t idx) {
  return w.f16 ? half_to_float(static_cast<const uint16_t*>(base)[idx]) : static_cast<const float*>(base)[idx];
}


// ------------------------------------------------------------------ scalar

template <int R>
void tile_scalar(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res) {
  const int64_t bb = block_bytes(w.mode), K = a.K, KB = w.KB;
  const bool split = w.G == 16;
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < kTile; ++l) res[r * kTile + l] = 0.f;
  for (int64_t kb = 0; kb < KB; ++kb) {
    const uint8_t* wp = w.data + (tile * KB + kb) * bb;
    for (int l = 0; l < kTile; ++l) {
      // unpack the 32 values of lane l
      int32_t qv[32];
      if (w.mode == kW4) {
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t b = wp[c * 64 + l * 4 + j];
            qv[8 * c + j] = b & 0x0f;
            qv[8 * c + 4 + j] = b >> 4;
          }
      } else {
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < 4; ++j) qv[4 * c + j] = wp[c * 64 + l * 4 + j];
      }
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        const int8_t* xq = a.q + m * K + kb * kBlock;
        int32_t s0 = 0, s1 = 0;
        for (int k = 0; k < 16; ++k) s0 += qv[k] * xq[k];
        for (int k = 16; k < 32; ++k) s1 += qv[k] * xq[k];
        const float dx = a.dx[m * KB + kb];
        float acc = res[r * kTile + l];
        if (!split) {
          const int64_t g = kb * kBlock / w.G;
          const float d = scale_at(w, w.scale, sidx(w, tile, g) + l);
          const float mn = scale_at(w, w.mins, sidx(w, tile, g) + l);
          acc = std::fma((float)(s0 + s1), d * dx, acc);
          acc = std::fma(mn, a.dxs[m * KB + kb], acc);
        } else {
          const float d0 = scale_at(w, w.scale, sidx(w, tile, 2 * kb) + l);
          const float d1 = scale_at(w, w.scale, sidx(w, tile, 2 * kb + 1) + l);
          const float n0 = scale_at(w, w.mins, sidx(w, tile, 2 * kb) + l);
          const float n1 = scale_at(w, w.mins, sidx(w, tile, 2 * kb + 1) + l);
          acc = std::fma((float)s0, d0 * dx, acc);
          acc = std::fma((float)s1, d1 * dx, acc);
          acc = std::fma(n0, a.dxs16[m * 2 * KB + 2 * kb], acc);
          acc = std::fma(n1, a.dxs16[m * 2 * KB + 2 * kb + 1], acc);
        }
        res[r * kTile + l] = acc;
      }
    }
  }
}

// ------------------------------------------------------------------ AVX2 / AVX-VNNI (ymm: 8 lanes)

template <bool F16>
TGT_AVX2 static inline __m256 load8(const void* base, int64_t idx) {
  if constexpr (F16)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + idx)));
  else
    return _mm256_loadu_ps(static_cast<const float*>(base) + idx);
}

// sum over 4-byte groups of u8 (w) x s8 (x): one int32 per lane
TGT_AVX2 static inline __m256i dot4_maddubs(__m256i acc, __m256i w, __m256i x) {
  const __m256i p = _mm256_maddubs_epi16(w, x);  // u8*s8 pairs -> i16 (q < 128: no saturation)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
TGT_AVXVNNI static inline __m256i dot4_vnni(__m256i acc, __m256i w, __m256i x) {
  return _mm256_dpbusd_avx_epi32(acc, w, x);
}

// 8-bit values up to 255 on plain AVX2: maddubs would saturate (255*127*2 > 32767),
// so compute (q-128)*x with the sign trick (|q-128| <= 128: 128*127*2 fits) and
// add 128*xs afterwards (done by the caller).
TGT_AVX2 static inline __m256i dot4_signed(__m256i acc, __m256i w_u8, __m256i x) {
  const __m256i s = _mm256_xor_si256(w_u8, _mm256_set1_epi8((char)0x80));  // q - 128 as s8
  const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(s), _mm256_sign_epi8(x, s));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

#define YMM_NAME tile_ymm_avx2
#define YMM_TARGET TGT_AVX2
#define YMM_VNNI 0
#include "qgemm_ymm.inc"
#undef YMM_NAME
#undef YMM_TARGET
#undef YMM_VNNI
#define YMM_NAME tile_ymm_vnni
#define YMM_TARGET TGT_AVXVNNI
#define YMM_VNNI 1
#include "qgemm_ymm.inc"
#undef YMM_NAME
#undef YMM_TARGET
#undef YMM_VNNI

#define YMM_DISPATCH(FN)                                                      \
  switch (w.mode * 2 + (w.f16 ? 1 : 0)) {                                     \
    case kW4 * 2: return FN<R, kW4, false>(a, m0, w, tile, res);              \
    case kW4 * 2 + 1: return FN<R, kW4, true>(a, m0, w, tile, res);           \
    case kW8 * 2: return FN<R, kW8, false>(a, m0, w, tile, res);              \
    case kW8 * 2 + 1: return FN<R, kW8, true>(a, m0, w, tile, res);           \
    case kW8Small * 2: return FN<R, kW8Small, false>(a, m0, w, tile, res);    \
    default: return FN<R, kW8Small, true>(a, m0, w, tile, res);               \
  }

template <int R>
void tile_avx2(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res) {
  YMM_DISPATCH(tile_ymm_avx2)
}
template <int R>
void tile_avxvnni(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res) {
  YMM_DISPATCH(tile_ymm_vnni)
}

// ------------------------------------------------------------------ AVX-512 VNNI (zmm: 16 lanes)

// NOTE(chains): vpdpbusd has a latency of ~5 cycles and a throughput of ~1 per
// cycle, so one accumulator chain per row leaves a 1-row pass 5x slower than its
// issue rate (a lone 13-token prefill is 4+4+4+1 rows).  Each row therefore keeps
// NA int32 accumulators (4 for 1-2 rows, else 2); the products land in them
// round-robin and are added afterwards.  Integer sums are exact, so the result is
// the same whatever NA is: batch invariance and the ISA-independence hold.
template <int R>
constexpr int zmm_chains() {
  return R <= 2 ? 4 : 2;
}

template <int R, int MODE, bool F16>
TGT_AVX512 static void tile_zmm(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res) {
  constexpr int64_t bb = MODE == kW4 ? 256 : 512;
  const int64_t K = a.K, KB = w.KB;
  const bool split = w.G == 16;
  const int8_t* xrow[R];
  for (int r = 0; r < R; ++r) xrow[r] = a.q + (m0 + r) * K;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* wp = w.data + tile * KB * bb;
  // half block h (k 0..15 | 16..31: 4-bit chunks 0-1 | 2-3, 8-bit chunks 0-3 | 4-7)
  // uses chains h*H .. h*H+H-1: split groups (G = 16) need the two halves apart
  constexpr int NA = zmm_chains<R>(), H = NA / 2;
  constexpr int NC = MODE == kW4 ? 4 : 8;  // 64-byte chunks per block
  const __m512i mask = _mm512_set1_epi8(0x0f);
  for (int64_t kb = 0; kb < KB; ++kb, wp += bb) {
    prefetch_weights<F16>(w, wp, bb, tile, kb, kPrefetchBytes);  // NOTE(weight-prefetch) in qgemm_zmm.h
    __m512i is[NA][R];
    for (int j = 0; j < NA; ++j)
      for (int r = 0; r < R; ++r) is[j][r] = _mm512_setzero_si512();
    // NOTE(unroll): the chain index must be a constant for is[][] to stay in registers
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const __m512i v = _mm512_loadu_si512(wp + c * 64);
      const int half = c >= NC / 2 ? H : 0;
      if constexpr (MODE == kW4) {  // low nibbles k = 8c..8c+3, high nibbles 8c+4..8c+7
        const __m512i lo = _mm512_and_si512(v, mask);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        const int j0 = half + (2 * c) % H, j1 = half + (2 * c + 1) % H;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = xrow[r] + kb * kBlock + 8 * c;
          is[j0][r] = _mm512_dpbusd_epi32(is[j0][r], lo, _mm512_set1_epi32(load_i32(xq)));
          is[j1][r] = _mm512_dpbusd_epi32(is[j1][r], hi, _mm512_set1_epi32(load_i32(xq + 4)));
        }
      } else {  // 8-bit: u8 x s8 with int32 accumulation never saturates, all 8-bit modes alike
        const int j = half + c % H;
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i xb = _mm512_set1_epi32(load_i32(xrow[r] + kb * kBlock + 4 * c));
          is[j][r] = _mm512_dpbusd_epi32(is[j][r], v, xb);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 1; j < H; ++j) {
        is[0][r] = _mm512_add_epi32(is[0][r], is[j][r]);
        is[H][r] = _mm512_add_epi32(is[H][r], is[H + j][r]);
      }
      if (!split) is[0][r] = _mm512_add_epi32(is[0][r], is[H][r]);
    }
    zmm_epilogue<F16>(a, m0, R, w, tile, kb, is[0], is[H], acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(res + r * kTile, acc[r]);
}

template <int R>
void tile_avx512(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res) {
  const bool f16 = w.f16;
  if (w.mode == kW4) {
    if (f16) tile_zmm<R, kW4, true>(a, m0, w, tile, res);
    else tile_zmm<R, kW4, false>(a, m0, w, tile, res);
  } else {
    // 8-bit: u8 x s8 with int32 accumulation never saturates, all 8-bit modes alike
    if (f16) tile_zmm<R, kW8, true>(a, m0, w, tile, res);
    else tile_zmm<R, kW8, false>(a, m0, w, tile, res);
  }
}

#define INSTANTIATE(R)                                                                   \
  template void tile_scalar<R>(const ActQ&, int64_t, const WPack&, int64_t, float*);   \
  template void tile_avx2<R>(const ActQ&, int64_t, const WPack&, int64_t, float*);     \
  template void tile_avxvnni<R>(const ActQ&, int64_t, const WPack&, int64_t, float*);  \
  template void tile_avx512<R>(const ActQ&, int64_t, const WPack&, int64_t, float*);
INSTANTIATE(1)
INSTANTIATE(2)
INSTANTIATE(3)
INSTANTIATE(4)
// AVX-512 has 32 vector registers: up to 8 rows share one unpacked weight tile
template void tile_avx512<5>(const ActQ&, int64_t, const WPack&, int64_t, float*);
template void tile_avx512<6>(const ActQ&, int64_t, const WPack&, int64_t, float*);
template void tile_avx512<7>(const ActQ&, int64_t, const WPack&, int64_t, float*);
template void tile_avx512<8>(const ActQ&, int64_t, const WPack&, int64_t, float*);
// the ymm paths: up to 6 rows (NOTE(ymm-registers) in qgemm_ymm.inc)
template void tile_avx2<5>(const ActQ&, int64_t, const WPack&, int64_t, float*);
template void tile_avx2<6>(const ActQ&, int64_t, const WPack&, int64_t, float*);
template void tile_avxvnni<5>(const ActQ&, int64_t, const WPack&, int64_t, float*);
template void tile_avxvnni<6>(const ActQ&, int64_t, const WPack&, int64_t, float*);

}  // namespace sluice

namespace sluice {

// ------------------------------------------------------------------ activation quantization
//
// Per row, per block of 32: dx = max|x| / 127, qx = round_half_even(x * (1/dx)).
// The AVX2 and scalar versions perform the same float operations (cvtps rounds
// to nearest even, as nearbyintf does in the default rounding mode).

static void quant_block_scalar(const float* x, int8_t* q, float* dx, float* dxs, float* dxs16, int32_t* xs,
                               int32_t* xs16) {
  float amax = 0.f;
  for (int k = 0; k < 32; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int32_t s0 = 0, s1 = 0;
  for (int k = 0; k < 32; ++k) {
    const int32_t v = (int32_t)std::nearbyint(x[k] * id);
    q[k] = (int8_t)v;
    (k < 16 ? s0 : s1) += v;
  }
  *dx = d;
  *xs = s0 + s1;
  xs16[0] = s0;
  xs16[1] = s1;
  *dxs = d * (float)(s0 + s1);
  dxs16[0] = d * (float)s0;
  dxs16[1] = d * (float)s1;
}

TGT_AVX2 static void quant_block_avx2(const float* x, int8_t* q, float* dx, float* dxs, float* dxs16, int32_t* xs,
                                      int32_t* xs16) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 mx = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], vid));
  // pack 32 int32 -> 32 int8 in order
  const __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);  // lanes interleaved per 128
  const __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
  __m256i p = _mm256_packs_epi16(p01, p23);
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
  const __m256i s01 = _mm256_add_epi32(qi[0], qi[1]);
  const __m256i s23 = _mm256_add_epi32(qi[2], qi[3]);
  alignas(32) int32_t t0[8], t1[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t0), s01);
  _mm256_store_si256(reinterpret_cast<__m256i*>(t1), s23);
  int32_t s0 = 0, s1 = 0;
  for (int i = 0; i < 8; ++i) {
    s0 += t0[i];
    s1 += t1[i];
  }
  *dx = d;
  *xs = s0 + s1;
  xs16[0] = s0;
  xs16[1] = s1;
  *dxs = d * (float)(s0 + s1);
  dxs16[0] = d * (float)s0;
  dxs16[1] = d * (float)s1;
}

// NOTE(act-quant-zmm): one block is two zmm, exactly its two halves, so the half sums
// need no shuffles; the float operations are those of the AVX2 and scalar versions
// (an exact max, one division, one reciprocal, a product rounded to nearest even,
// integer sums), so the three give the same bits.
TGT_AVX512 static inline void quant_block_avx512(const float* x, int8_t* q, float* dx, float* dxs, float* dxs16,
                                                 int32_t* xs, int32_t* xs16) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m512 vid = _mm512_set1_ps(id);
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(q1));
  const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
  *dx = d;
  *xs = s0 + s1;
  xs16[0] = s0;
  xs16[1] = s1;
  *dxs = d * (float)(s0 + s1);
  dxs16[0] = d * (float)s0;
  dxs16[1] = d * (float)s1;
}

#define QUANT_ROWS(NAME, TARGET, BLOCK)                                                                     \
  TARGET static void NAME(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* dx, float* dxs, \
                          float* dxs16, int32_t* xs, int32_t* xs16) {                                        \
    const int64_t KB = K / kBlock;                                                                           \
    for (int64_t m = 0; m < M; ++m)                                                                          \
      for (int64_t kb = 0; kb < KB; ++kb) {                                                                  \
        const int64_t i = m * KB + kb;                                                                       \
        BLOCK(x + m * ldx + kb * kBlock, q + m * K + kb * kBlock, dx + i, dxs + i, dxs16 + 2 * i, xs + i,    \
              xs16 + 2 * i);                                                                                 \
      }                                                                                                      \
  }
QUANT_ROWS(quant_rows_scalar, , quant_block_scalar)
QUANT_ROWS(quant_rows_avx2, TGT_AVX2, quant_block_avx2)
QUANT_ROWS(quant_rows_avx512, TGT_AVX512, quant_block_avx512)
#undef QUANT_ROWS

int act_quant_isa(int path) {
  static const bool zmm = path_supported(kAvx512Vnni);
  static const bool ymm = path_supported(kAvx2);
  if (path == kScalar || !ymm) return 0;
  return (path == kAvx512Vnni || path == kAmx) && zmm ? 2 : 1;  // a forced AVX2 path stays AVX2 throughout
}

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* dx, float* dxs,
                   float* dxs16, int32_t* xs, int32_t* xs16, int isa) {
  if (isa >= 2)
    quant_rows_avx512(x, M, K, ldx, q, dx, dxs, dxs16, xs, xs16);
  else if (isa == 1)
    quant_rows_avx2(x, M, K, ldx, q, dx, dxs, dxs16, xs, xs16);
  else
    quant_rows_scalar(x, M, K, ldx, q, dx, dxs, dxs16, xs, xs16);
}

// NOTE(act-quant-parallel): rows on the pool from two rows on (NOTE(small-grains) in
// qlinear_op.cpp).  perf put ~12% of a 12-token prefill step's samples on the serial
// quantization (a 2-core Zen 4); the step gained 3-5% (docs/kernels.md): its input was
// just written by both threads (the GEMM before it splits the columns), and reading
// the other core's half is paid in parallel too.
void quantize_rows_parallel(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* dx, float* dxs,
                            float* dxs16, int32_t* xs, int32_t* xs16, int isa) {
  const int64_t KB = K / kBlock;
  auto body = [&](int64_t b, int64_t e) {
    quantize_rows(x + b * ldx, e - b, K, ldx, q + b * K, dx + b * KB, dxs + b * KB, dxs16 + 2 * b * KB, xs + b * KB,
                  xs16 + 2 * b * KB, isa);
  };
  if (M >= 2)
    sluice::parallel_for(0, M, 1, body);
  else
    body(0, M);
}

}  // namespace sluice

namespace sluice {

constexpr int kMaxRows = kMaxTileRows;

int tile_rows(int path) { return path == kAvx512Vnni ? kMaxRows : (path == kAvx2 || path == kAvxVnni) ? 6 : 4; }

TileFn tile_fn(int path, int r) {
  static const TileFn table[4][kMaxRows] = {
      {tile_scalar<1>, tile_scalar<2>, tile_scalar<3>, tile_scalar<4>},
      {tile_avx2<1>, tile_avx2<2>, tile_avx2<3>, tile_avx2<4>, tile_avx2<5>, tile_avx2<6>},
      {tile_avxvnni<1>, tile_avxvnni<2>, tile_avxvnni<3>, tile_avxvnni<4>, tile_avxvnni<5>, tile_avxvnni<6>},
      {tile_avx512<1>, tile_avx512<2>, tile_avx512<3>, tile_avx512<4>, tile_avx512<5>, tile_avx512<6>,
       tile_avx512<7>, tile_avx512<8>},
  };
  return table[path][r - 1];
}

bool path_supported(int path) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  switch (path) {
    case kScalar: return true;
    case kAvx2: return avx2;
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx512Vnni:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni");
    case kAmx: return path_supported(kAvx512Vnni) && amx_ready();
    default: return false;
  }
}

// Write R x 16 results of one tile to out (+ bias, + residual): the same
// float operations whatever the path; plain copies when there is nothing to add.
static inline void store_tile(const float* res, int r, int64_t m0, int64_t tile, int64_t N, float* out, int64_t ldo,
                              int64_t col0, const float* bias, const float* resid, int64_t ldr) {
  const int64_t n0 = tile * kTile;
  const int64_t nn = std::min<int64_t>(kTile, N - n0);
  for (int i = 0; i < r; ++i) {
    const int64_t m = m0 + i;
    float* orow = out + m * ldo + col0 + n0;
    const float* src = res + i * kTile;
    if (!bias && !resid) {
      std::memcpy(orow, src, nn * sizeof(float));
      continue;
    }
    const float* rrow = resid ? resid + m * ldr + col0 + n0 : nullptr;
    for (int64_t l = 0; l < nn; ++l) {
      float y = src[l];
      if (bias) y = y + bias[n0 + l];
      if (rrow) y = rrow[l] + y;
      orow[l] = y;
    }
  }
}

void run_gemm(const ActQ& a, int64_t M, const WPack& w, float* out, int64_t ldo, int64_t col0, const float* bias,
              const float* resid, int64_t ldr, int path) {
  if (path == kAmx) {
    run_gemm_amx(a, M, w, [&](const float* res, int r, int64_t m0, int64_t tile) {
      store_tile(res, r, m0, tile, w.N, out, ldo, col0, bias, resid, ldr);
    });
    return;
  }
  const int rmax = tile_rows(path);
  TileFn fns[kMaxRows] = {};
  for (int r = 1; r <= rmax; ++r) fns[r - 1] = tile_fn(path, r);
  // NOTE(parallel): tiles of output channels are split across threads; the K
  // reduction of one element is never split, so the thread count cannot change it.
  // NOTE(m-blocking): rows are taken 64 at a time so their quantized activations
  // stay in L1/L2 while a thread sweeps its tiles (weights stream once per block).
  constexpr int64_t kRowBlock = 64, kTileGroup = 8;
  const int64_t grain = gemm_grain(w.KB, M);  // NOTE(gemm-grain) in qgemm.h
  sluice::parallel_for(0, w.NT, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) float res[kMaxRows * kTile];
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t me = std::min<int64_t>(M, mb + kRowBlock);
      // NOTE(tile-groups): a row's outputs for 8 consecutive tiles are written together
      // (512 contiguous bytes), so a wide output (an LM head: 49152 columns) does not
      // touch a new page for every 64 bytes it writes.
      for (int64_t tg = t0; tg < t1; tg += kTileGroup) {
        const int64_t te = std::min<int64_t>(t1, tg + kTileGroup);
        for (int64_t m0 = mb; m0 < me; m0 += rmax) {
          const int r = (int)std::min<int64_t>(rmax, me - m0);
          for (int64_t tile = tg; tile < te; ++tile) {
            fns[r - 1](a, m0, w, tile, res);
            store_tile(res, r, m0, tile, w.N, out, ldo, col0, bias, resid, ldr);
          }
        }
      }
    }
  });
}

}  // namespace sluice

// ------------------------------------------------------------------ float32 weights, batch invariant
//
// Layers kept in float inside a quantized model (fallback layers, a float LM
// head) use this instead of BLAS, whose blocking (and so rounding) changes with
// the batch size.  Weights are packed [N/16][K][16]; each output lane is
//   acc = fma(x[k], w[k][lane], acc)   for k = 0 .. K-1, in order,
// on every path and for every batch size.

namespace sluice {

void run_dense_gemm(const float* x, int64_t ldx, int64_t M, const float* wpack, int64_t N, int64_t K, float* out,
                    int64_t ldo, int64_t col0, const float* bias, const float* resid, int64_t ldr, int path) {
  // every int path implies its float ISA: scalar -> scalar, avx2/avxvnni -> avx2, avx512vnni/amx -> avx512
  const int isa = path == kScalar ? 0 : (path == kAvx512Vnni || path == kAmx ? 2 : 1);
  const int64_t NT = (N + kTile - 1) / kTile;
  // NOTE(fp32-streams) in fp32_tile.h: passes of up to max_rows rows over T adjacent tiles at once
  const int rmax = fp32_tile::max_rows(isa);
  const int T = fp32_tile::streams_for(isa, (int)std::min<int64_t>(M, rmax));
  // a chunk: at least 64 Ki products (as NOTE(gemm-grain) in qgemm.h; 1 Mi before, which put a decode's
  // whole qkv or o_proj on one thread), in whole groups of T tiles
  const int64_t per_tile = K * kTile * std::min<int64_t>(std::max<int64_t>(M, 1), 64);
  int64_t grain = std::max<int64_t>(1, 65536 / per_tile);
  grain = (grain + T - 1) / T * T;
  sluice::parallel_for(0, NT, grain, [&](int64_t t0, int64_t t1) {
    alignas(64) float res[fp32_tile::kMaxStreams * fp32_tile::kMaxRows * kTile];
    for (int64_t tile = t0; tile < t1;) {
      const int t = (int)std::min<int64_t>(T, t1 - tile);
      const int tt = t >= 4 ? 4 : (t >= 2 ? 2 : 1);  // 3 tiles left: a pass of 2, then 1
      const float* wt = wpack + tile * K * kTile;
      for (int64_t m0 = 0; m0 < M; m0 += rmax) {
        const int r = (int)std::min<int64_t>(rmax, M - m0);
        fp32_tile::multi(isa, r, tt)(x + m0 * ldx, ldx, wt, K, res);
        for (int j = 0; j < tt; ++j)
          store_tile(res + j * fp32_tile::kMaxRows * kTile, r, m0, tile + j, N, out, ldo, col0, bias, resid, ldr);
      }
      tile += tt;
    }
  });
}

}  // namespace sluice
