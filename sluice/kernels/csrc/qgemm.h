// Quantized GEMM: int8 activations x int4/int8 group-wise weights, fp32 out.
//
// Weight layout (packed at load by sluice/kernels/qlinear.py from the canonical
// form w = d*(q - z) + m, see sluice/kernels/qweight.py):
//
//   N output channels in tiles of 16 (zero-padded), K in blocks of 32.
//   data: [N/16 tiles][K/32 blocks][B bytes]     B = 256 (4-bit) or 512 (8-bit)
//
//   8-bit block: 8 chunks of 64 bytes; chunk c holds k = 4c..4c+3:
//       byte c*64 + lane*4 + j  =  q[lane][4c + j]
//   4-bit block: 4 chunks of 64 bytes; chunk c holds k = 8c..8c+7:
//       byte c*64 + lane*4 + j  =  q[lane][8c + j] | q[lane][8c + 4 + j] << 4
//
//   so one 64-byte chunk is one zmm: 16 int32 lanes (one per channel), each
//   lane 4 consecutive k -- exactly what vpdpbusd (u8 x s8 -> +int32) wants
//   with the 4 activation bytes broadcast; AVX2 reads it as two ymm halves.
//
//   scale: [N/16][K/G][16] (fp16 or fp32)   d of the group
//   mins:  [N/16][K/G][16] (fp16 or fp32)   m - d*z of the group
//
// Activations are quantized per row in blocks of 32 (symmetric, |q| <= 127):
//   x ~ dx * qx;  xs = sum(qx) over the block (and over each half: xs16).
//
// One output element, for each block kb in order:
//   acc = fma((float)isum, d * dx, acc)         isum = sum_k q[k] * qx[k] (exact int32)
//   acc = fma(mn, dx * xs, acc)                  (halves separately when G = 16)
// Integer sums are exact, the float steps are the same instructions in the
// same order on every path and for every batch size: a row's result never
// depends on its neighbours (batch invariance), nor on the ISA.
#pragma once

#include <cstdint>
#include <functional>

namespace sluice {

enum Path : int { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3, kAmx = 4 };

// storage modes
enum Mode : int { kW4 = 0, kW8 = 1, kW8Small = 2 };  // kW8Small: every q < 128 (Q5_K, Q6_K)

struct ActQ {
  const int8_t* q;      // (M, K)
  const float* dx;      // (M, K/32)
  const float* dxs;     // (M, K/32) dx * sum(qx) over the block
  const float* dxs16;   // (M, K/16) dx * sum(qx) over each half block
  const int32_t* xs;    // (M, K/32) sum(qx) over the block
  const int32_t* xs16;  // (M, K/16) sum(qx) over each half block
  int64_t K;
};

struct WPack {
  const uint8_t* data;
  const void* scale;
  const void* mins;
  int64_t N, K, NT, KB, NG;  // channels, inputs, tiles, blocks, groups per row
  int G;                     // group size (16 or a multiple of 32)
  int mode;                  // Mode
  bool f16;                  // scales stored as fp16
};

constexpr int kTile = 16;
constexpr int kBlock = 32;

inline int64_t block_bytes(int mode) { return mode == kW4 ? 256 : 512; }

// NOTE(gemm-grain): the fewest tiles of output channels one thread takes, so that a
// chunk holds at least 256 (block x row) products.  It was 2048: at one row that put
// the whole qkv, o_proj and down GEMMs of a SmolLM2 layer (60, 36 and 36 tiles, 18 or
// 48 blocks each) on one thread while the other spun, and a lone token's step read
// its weights at ~23 GB/s.  A chunk is still 64 KiB of weights or more at one row
// (a pool dispatch costs ~1 us), and at 8 rows and up the grain is one tile as before.
inline int64_t gemm_grain(int64_t KB, int64_t rows) {
  const int64_t per_tile = KB * (rows < 1 ? 1 : rows > 64 ? 64 : rows);
  return per_tile >= 256 ? 1 : 256 / per_tile;
}

// Quantize rows of x (M, K), K % 32 == 0, into the ActQ arrays (caller-allocated).
// isa: 0 scalar, 1 AVX2, 2 AVX-512 (every one gives the same bits); act_quant_isa(path)
// is the one a kernel path uses (scalar, AVX2 for the ymm paths, AVX-512 for the zmm and
// AMX ones), capped by what this CPU has.
// quantize_rows_parallel: the same, its rows on the work pool from two rows on.
int act_quant_isa(int path);
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* dx, float* dxs,
                   float* dxs16, int32_t* xs, int32_t* xs16, int isa);
void quantize_rows_parallel(const float* x, int64_t M, int64_t K, int64_t ldx, int8_t* q, float* dx, float* dxs,
                            float* dxs16, int32_t* xs, int32_t* xs16, int isa);

// Whether this CPU can run a kernel path.
bool path_supported(int path);

// out[m, col0 + n] = (resid[m, col0 + n] +) (bias[n] +) x[m] . w[n], for m < M, n < w.N (OpenMP over tiles)
void run_gemm(const ActQ& a, int64_t M, const WPack& w, float* out, int64_t ldo, int64_t col0, const float* bias,
              const float* resid, int64_t ldr, int path);

// The same for float32 weights packed [N/16][K][16] (batch invariant, unlike BLAS)
void run_dense_gemm(const float* x, int64_t ldx, int64_t M, const float* wpack, int64_t N, int64_t K, float* out,
                    int64_t ldo, int64_t col0, const float* bias, const float* resid, int64_t ldr, int path);

// The AMX path (qgemm_amx.cpp): whether this CPU has it and the kernel granted the
// tile state to this process (asked once), and its GEMM, which hands each R x 16
// block of results (res, R, m0, tile) to `store`.
bool amx_ready();
using StoreFn = std::function<void(const float* res, int r, int64_t m0, int64_t tile)>;
void run_gemm_amx(const ActQ& a, int64_t M, const WPack& w, const StoreFn& store);

// Compute R rows (m0..m0+R-1) x one tile of 16 channels; res: R x 16 floats.
// tile_fn(path, r) is the function a path runs for r rows, 1 <= r <= tile_rows(path): 8 rows on
// AVX-512's 32 registers, 6 on the ymm paths, 4 on the scalar one (the AMX path has its own
// driver, run_gemm_amx).  run_gemm and the grouped expert GEMM (moe_op.cpp) both call them.
using TileFn = void (*)(const ActQ&, int64_t, const WPack&, int64_t, float*);
constexpr int kMaxTileRows = 8;
int tile_rows(int path);
TileFn tile_fn(int path, int r);

template <int R>
void tile_scalar(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res);
template <int R>
void tile_avx2(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res);
template <int R>
void tile_avxvnni(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res);
template <int R>
void tile_avx512(const ActQ& a, int64_t m0, const WPack& w, int64_t tile, float* res);

}  // namespace sluice
