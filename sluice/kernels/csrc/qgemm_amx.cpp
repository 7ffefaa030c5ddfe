// The AMX path of the quantized GEMM (Sapphire Rapids and later): the integer
// dot products run on the tile unit, the float epilogue on AVX-512.
//
// Same layout and arithmetic as the other paths (qgemm.h): for each block of 32
// inputs, one tdpbsud computes the exact int32 sums of up to 16 rows x 16
// channels at once, and the epilogue then runs tile_zmm's own float steps
// (zmm_epilogue, qgemm_zmm.h), in the same order.  So the result is
// bit-identical to every other path and to any batch size.
//
//   A (signed)   : R rows of activations, the block's 32 bytes   (tileloadd, stride K)
//   B (unsigned) : 8 rows of 64 bytes: row kk = 16 channels x k 4kk..4kk+3
//                  -- the packed 8-bit block as it is; a 4-bit block's chunk c
//                  unpacks to rows 2c (low nibbles) and 2c+1 (high nibbles)
//   C (int32)    : R rows x 16 channels
//
// NOTE(amx-permission): Linux hands out the tile state only to a process that asks
// (arch_prctl ARCH_REQ_XCOMP_PERM); amx_ready() asks once and the path is offered
// only if that succeeds.  NOTE(amx-config): the tile configuration is per thread
// and other libraries (oneDNN) may load their own, so every parallel chunk loads
// ours before its first tile instruction and releases the tiles at its end.
#include "qgemm.h"
#include "qgemm_zmm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include "work_pool.h"

namespace sluice {

// a superset of TGT_AVX512, so the shared AVX-512 epilogue (qgemm_zmm.h) inlines here
#define TGT_AMX __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

bool amx_ready() {
  static const bool ok = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512dq"))
      return false;
    // CPUID.(EAX=7,ECX=0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8 (GCC 12's
    // __builtin_cpu_supports does not know them)
    unsigned eax = 7, ebx = 0, ecx = 0, edx = 0;
    __asm__ volatile("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
    if (!((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
#ifdef SYS_arch_prctl
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int kAmxRows = 16;

// tmm0/tmm1: C of even/odd blocks, tmm2/tmm3: their A, tmm4/tmm5: their B.
// Split groups (G = 16): tmm0/tmm1 hold the two half blocks of one block, A and B halves alike.
TGT_AMX void configure(int rows, bool split) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = (uint8_t)rows;  // C
    c.colsb[t] = 64;
    c.rows[2 + t] = (uint8_t)rows;  // A
    c.colsb[2 + t] = split ? 16 : 32;
    c.rows[4 + t] = split ? 4 : 8;  // B
    c.colsb[4 + t] = 64;
  }
  // NOTE(ldtilecfg): not _tile_loadconfig: GCC 12 declares only its first 8 bytes as
  // read, so the stores of rows and colsb above were dropped as dead.
  __asm__ volatile("ldtilecfg %0" : : "m"(c) : "memory");
}

// 4-bit block (4 chunks of 64 bytes) -> 8 B rows of 64 bytes
TGT_AMX inline void unpack_w4(const uint8_t* wp, uint8_t* b) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(wp + c * 64);
    _mm512_store_si512(b + (2 * c) * 64, _mm512_and_si512(v, mask));
    _mm512_store_si512(b + (2 * c + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask));
  }
}

// the float epilogue of one block (qgemm_zmm.h), on the sums the tiles stored and
// on acc as the accumulators; c1: the second half block's sums (split groups only, else unread)
template <bool F16>
TGT_AMX inline __attribute__((always_inline)) void epilogue(const ActQ& a, int64_t m0, int R, const WPack& w,
                                                            int64_t tile, int64_t kb, const int32_t* c0,
                                                            const int32_t* c1, __m512* __restrict__ acc) {
  zmm_epilogue<F16>(a, m0, R, w, tile, kb, reinterpret_cast<const __m512i*>(c0),
                    reinterpret_cast<const __m512i*>(c1), acc);
}

struct Scratch {
  alignas(64) uint8_t b[3][512];                // unpacked 4-bit blocks
  alignas(64) int32_t c[2][kAmxRows * kTile];  // tile sums
};

// R (<= 16) rows x one tile of 16 channels -> res (R x 16), with the matching configuration loaded.
// NOTE(amx-acc-regs): the accumulators are a local array, stored to res once at the end.
// For a full tile of 16 rows, RC = 16 makes the row count a compile-time constant: the
// epilogue's row loops then unroll whole and the compiler keeps acc[] in zmm registers over
// the whole K loop, instead of loading and storing it around every block's epilogue (16 of
// the ~40 stores a block).  RC = 0: a partial tile, R rows at run time.  Same float
// operations in the same order either way: the same bits.
template <int MODE, bool F16, int RC>
TGT_AMX void tile_amx_rows(const ActQ& a, int64_t m0, int R_, const WPack& w, int64_t tile, float* res, Scratch& s) {
  const int R = RC ? RC : R_;
  __m512 acc[kAmxRows];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  auto store_res = [&]() TGT_AMX {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(res + r * kTile, acc[r]);
  };
  constexpr int64_t bb = MODE == kW4 ? 256 : 512;
  const int64_t K = a.K, KB = w.KB;
  const uint8_t* wt = w.data + tile * KB * bb;
  const int8_t* xq = a.q + m0 * K;
  auto bptr = [&](int64_t kb, int buf) TGT_AMX -> const uint8_t* {
    if constexpr (MODE == kW4) {
      unpack_w4(wt + kb * bb, s.b[buf]);
      return s.b[buf];
    } else {
      return wt + kb * bb;
    }
  };
  if (w.G == 16) {  // two half blocks per block, no overlap between blocks
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* b = bptr(kb, 0);
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, xq + kb * kBlock, K);
      _tile_loadd(3, xq + kb * kBlock + 16, K);
      _tile_loadd(4, b, 64);
      _tile_loadd(5, b + 4 * 64, 64);
      _tile_dpbsud(0, 2, 4);
      _tile_dpbsud(1, 3, 5);
      _tile_stored(0, s.c[0], 64);
      _tile_stored(1, s.c[1], 64);
      epilogue<F16>(a, m0, R, w, tile, kb, s.c[0], s.c[1], acc);
    }
    store_res();
    return;
  }
  // A software pipeline over blocks, so that no step waits on the one before it:
  // in iteration kb, block kb+2's weights are unpacked, block kb+1's product is
  // issued (tmm0/tmm1 alternate), block kb's sums are stored, and block kb-1's
  // sums (stored one iteration ago) go through the float epilogue.
  auto unpack = [&](int64_t kb) TGT_AMX {
    if constexpr (MODE == kW4)
      if (kb < KB) unpack_w4(wt + kb * bb, s.b[kb % 3]);
  };
  auto bsrc = [&](int64_t kb) -> const uint8_t* {
    if constexpr (MODE == kW4)
      return s.b[kb % 3];
    else
      return wt + kb * bb;
  };
  auto issue = [&](int64_t kb) TGT_AMX {
    if (kb >= KB) return;
    if (kb & 1) {
      _tile_zero(1);
      _tile_loadd(3, xq + kb * kBlock, K);
      _tile_loadd(5, bsrc(kb), 64);
      _tile_dpbsud(1, 3, 5);
    } else {
      _tile_zero(0);
      _tile_loadd(2, xq + kb * kBlock, K);
      _tile_loadd(4, bsrc(kb), 64);
      _tile_dpbsud(0, 2, 4);
    }
  };
  unpack(0);
  unpack(1);
  issue(0);
  for (int64_t kb = 0; kb < KB; ++kb) {
    prefetch_weights<F16>(w, wt + kb * bb, bb, tile, kb, kPrefetchBytes);  // NOTE(weight-prefetch)
    unpack(kb + 2);
    issue(kb + 1);
    if (kb & 1)
      _tile_stored(1, s.c[1], 64);
    else
      _tile_stored(0, s.c[0], 64);
    if (kb > 0) epilogue<F16>(a, m0, R, w, tile, kb - 1, s.c[(kb - 1) & 1], nullptr, acc);
  }
  epilogue<F16>(a, m0, R, w, tile, KB - 1, s.c[(KB - 1) & 1], nullptr, acc);
  store_res();
}

template <int MODE, bool F16>
TGT_AMX void tile_amx(const ActQ& a, int64_t m0, int R, const WPack& w, int64_t tile, float* res, Scratch& s) {
  if (R == kAmxRows)
    tile_amx_rows<MODE, F16, kAmxRows>(a, m0, R, w, tile, res, s);
  else
    tile_amx_rows<MODE, F16, 0>(a, m0, R, w, tile, res, s);
}

using AmxFn = void (*)(const ActQ&, int64_t, int, const WPack&, int64_t, float*, Scratch&);

AmxFn pick_amx(const WPack& w) {
  // 8-bit: s8 x u8 into int32 never saturates, all 8-bit modes alike
  if (w.mode == kW4) return w.f16 ? tile_amx<kW4, true> : tile_amx<kW4, false>;
  return w.f16 ? tile_amx<kW8, true> : tile_amx<kW8, false>;
}

TGT_AMX void release() { _tile_release(); }

}  // namespace

void run_gemm_amx(const ActQ& a, int64_t M, const WPack& w, const StoreFn& store) {
  TORCH_CHECK(amx_ready(), "AMX path: this CPU or kernel does not grant the tile state");
  const AmxFn fn = pick_amx(w);
  const bool split = w.G == 16;
  constexpr int64_t kRowBlock = 64, kTileGroup = 8;
  const int64_t grain = gemm_grain(w.KB, M);  // NOTE(gemm-grain) in qgemm.h
  sluice::parallel_for(0, w.NT, grain, [&](int64_t t0, int64_t t1) {
    Scratch s;
    alignas(64) float res[kAmxRows * kTile];
    int configured = -1;
    for (int64_t mb = 0; mb < M; mb += kRowBlock) {
      const int64_t me = std::min<int64_t>(M, mb + kRowBlock);
      for (int64_t tg = t0; tg < t1; tg += kTileGroup) {
        const int64_t te = std::min<int64_t>(t1, tg + kTileGroup);
        for (int64_t m0 = mb; m0 < me; m0 += kAmxRows) {
          const int r = (int)std::min<int64_t>(kAmxRows, me - m0);
          if (r != configured) {
            configure(r, split);
            configured = r;
          }
          for (int64_t tile = tg; tile < te; ++tile) {
            fn(a, m0, r, w, tile, res, s);
            store(res, r, m0, tile);
          }
        }
      }
    }
    if (configured >= 0) release();
  });
}

}  // namespace sluice
