// Paged attention for a flattened batch, reading K/V in place from the blocks.
//
//   q: (T, H, D) with contiguous rows of D, or the QKV rows (T, (H + 2 Hkv) D)
//   (NOTE(qkv-rows)); k_cache/v_cache: (NB, BS, Hkv, D); block_tables: (S, MB) int32;
//   query_start_loc: (S+1) int32; seq_lens: (S) int32; skip: (S) uint8, sequences
//   whose rows the caller fills itself (left untouched here).  Out: (T, H, D), or
//   (T, H D) for QKV rows.  k_scales/v_scales: (NB, BS, Hkv) float32 for a quantized
//   cache (float8_e4m3fn or int8 codes, value = code * scale of its row and KV head),
//   empty otherwise.  slot_mapping (T) int64 with k_new/v_new (T, Hkv, D), or taken
//   from the QKV rows: stored into an unquantized cache first (NOTE(kv-write)).
//
// Online softmax over the blocks of each sequence, one (token, KV head) per
// work item, OpenMP across items.  A float32 cache is read in place; the V sum
// keeps 16 output dims in registers across a block's keys (measured on a Zen 4
// core, 32 decodes x 160 keys, SmolLM2's heads: 440 -> 280 us a layer), and
// the rows of the blocks two ahead are prefetched (a 30-layer cache far larger
// than the CPU caches: 800 -> 710 us a layer on one core for fp32, 645 -> 390
// for int8), one key row at a time (NOTE(prefetch-spread)).  Float32 queries
// with head dims of 16, 64 and 128 run on 16-float vectors (NOTE(attn-simd)),
// the rest on the generic loops (each variant is compiled for every cache dtype
// and ISA clone: fewer of them keep the build short).  Built at install time (setup.py) without
// -march=native: the row loop is compiled once per ISA (target_clones) and the
// best clone is picked when the library loads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>
#include "build_info.h"
#include "work_pool.h"

namespace {

// fp8 e4m3fn code -> float, branch-free and exact (vectorises; no table).
//   normal    (e > 0): 2^(e-7) * (1 + m/8) = the float with exponent e+120, mantissa m<<20
//   subnormal (e = 0): m * 2^-9            (an integer times 2^-9, so flush-to-zero,
//                                            which the engine sets while the model runs,
//                                            cannot touch it)
// NaN codes (0x7f, 0xff) never occur: the writer clamps to +-448.
static inline __attribute__((always_inline)) float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t mag = b & 0x7Fu;
  const uint32_t normal_bits = (mag << 20) + (120u << 23);
  float normal;
  std::memcpy(&normal, &normal_bits, 4);
  const float sub = (float)(mag & 7u) * 0.001953125f;
  float f = (mag >> 3) ? normal : sub;
  uint32_t fb;
  std::memcpy(&fb, &f, 4);
  fb |= (uint32_t)(b & 0x80u) << 24;
  std::memcpy(&f, &fb, 4);
  return f;
}

struct Fp8 {  // storage tag: the cache holds float8_e4m3fn codes, read as bytes
  uint8_t bits;
};

static inline __attribute__((always_inline)) float to_float(float x) { return x; }
static inline __attribute__((always_inline)) float to_float(c10::BFloat16 x) { return (float)x; }
static inline __attribute__((always_inline)) float to_float(int8_t x) { return (float)x; }
static inline __attribute__((always_inline)) float to_float(Fp8 x) { return fp8_e4m3_to_float(x.bits); }

template <typename scalar_t, typename kv_t>
struct Args {
  const scalar_t* q;
  const kv_t* k;
  const kv_t* v;
  const float* ks;  // (NB, BS, Hkv) row scales; nullptr: the cache is not quantized
  const float* vs;
  const int32_t* bt;
  const int32_t* qsl;
  const int32_t* sl;
  const uint8_t* skip;
  const int32_t* seq_of;
  scalar_t* out;
  int64_t q_row;  // elements between two tokens' query rows (H * D when q is contiguous)
  int64_t H, D, BS, MB, group, kv_row, kv_block;
  float scale;
  const int32_t* work = nullptr;  // NOTE(key-segments): 4 int32 per item (t, hk, k0, slot); nullptr: item = t*Hkv + hk
  float* part = nullptr;          // a split item's partial softmax: slot * group * (D + 2) floats
  int64_t window = 0;             // NOTE(window-keys): a query sees its last `window` keys only; 0: all
  float softcap = 0.f;            // scores soft-capped to (-softcap, softcap) by tanh; 0: not
};

// NOTE(key-segments): a row's keys are cut into segments of kSegKeys, each its own work
// item, when it has more.  One long sequence is otherwise 3 items (SmolLM2's KV heads)
// for 2 threads: one thread did two of them while the other waited (1 x 2048 keys:
// attention was 9.2 ms of a 13.7-ms decode step, against 13.1 ms on one thread).  Each
// segment keeps its own online softmax (max, sum, unnormalized V sum), and the segments
// are merged in key order afterwards.  Where a row is cut depends on its own key count
// only, so its result still depends on nothing else (batch invariance); a row of up to
// kSegKeys keys is one item computed as before, to the bit.
constexpr int64_t kSegKeys = 512;

typedef float v16 __attribute__((vector_size(64)));  // 16 floats: one zmm, two ymm or four xmm

constexpr int kPrefetchBlocks = 2;  // how far ahead an item's K/V rows are requested
constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxDim = 256;    // head_dim
constexpr int kMaxBlock = 64;   // block_size

// NOTE(prefetch-spread): the head's rows in the block kPrefetchBlocks ahead are requested
// one key row at a time, beside the work on the block being read, not all at once: a
// burst of a block's 128 line requests (16 rows x 4 lines x K and V, a 64-dim fp32 head)
// fills the core's line-fill buffers, and each request after that waits for a free one.
struct Prefetch {
  const char* k = nullptr;  // the head's row 0 in the block ahead; nullptr: nothing to request
  const char* v = nullptr;
  int64_t stride = 0, row_bytes = 0;
};

static inline __attribute__((always_inline)) void prefetch_row(const Prefetch& p, int64_t j) {
  if (p.k == nullptr) return;
  for (int64_t c = 0; c < p.row_bytes; c += 64) {
    __builtin_prefetch(p.k + j * p.stride + c);
    __builtin_prefetch(p.v + j * p.stride + c);
  }
}

template <typename scalar_t, typename kv_t>
static inline __attribute__((always_inline)) Prefetch prefetch_target(const Args<scalar_t, kv_t>& a, int64_t blk,
                                                                     int64_t hk) {
  return Prefetch{reinterpret_cast<const char*>(a.k + blk * a.kv_block + hk * a.D),
                  reinterpret_cast<const char*>(a.v + blk * a.kv_block + hk * a.D),
                  a.kv_row * (int64_t)sizeof(kv_t), a.D * (int64_t)sizeof(kv_t)};
}

// The keys row t attends to (causal): its sequence's context before this step's tokens,
// then this step's tokens up to itself.
template <typename scalar_t, typename kv_t>
static inline __attribute__((always_inline)) int64_t causal_keys(const Args<scalar_t, kv_t>& a, int64_t t) {
  const int32_t s = a.seq_of[t];
  return (int64_t)a.sl[s] - (a.qsl[s + 1] - a.qsl[s]) + (t - a.qsl[s]) + 1;
}

// NOTE(window-keys): the first key row t attends to.  With a sliding window (gemma2/3's local layers,
// mistral) its query at position p sees keys p - window + 1 .. p: blocks before that are never read
// (the engine may have freed them, NOTE(window-blocks)), and the first block is read from that key
// on.  The keys a row reads and their order depend on its own position only (batch and chunk
// invariance, as without a window); without one the row starts at key 0, as before, to the bit.
template <typename scalar_t, typename kv_t>
static inline __attribute__((always_inline)) int64_t first_key(const Args<scalar_t, kv_t>& a, int64_t t) {
  return a.window > 0 ? std::max<int64_t>(0, causal_keys(a, t) - a.window) : 0;
}

// Query head h of row t: the V sum over the softmax's sum.
template <typename scalar_t, typename kv_t>
static inline __attribute__((always_inline)) void store_head(const Args<scalar_t, kv_t>& a, int64_t t, int64_t h,
                                                             const float* acc, float l) {
  scalar_t* orow = a.out + (t * a.H + h) * a.D;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  for (int64_t d = 0; d < a.D; ++d) orow[d] = (scalar_t)(acc[d] * inv);
}

// NOTE(attn-simd): the same item for head_dim = 16 x DV (16, 64, 128; float32 queries), written
// on 16-float vectors with the item's query heads and their V sums held in registers.
// The generic loops below leave the compiler a dot product per (head, key), each
// ending in a horizontal sum, and keep the V sums in memory: on the 2-core Sapphire
// Rapids a 64-row x 66-key SmolLM2 layer took 147 us with its K/V in the caches, ~66
// GFLOP/s.  Here a block's 16 keys are scored together: each key's 16 partial sums
// per head are reduced into one vector of the block's 16 scores by a transposing tree
// (15 adds per head and block instead of 16 horizontal sums), the softmax runs on
// that vector, and the V sums take each value row once for every head of the group.
// The order of each head's operations depends only on its own keys (batch
// invariance), as in the generic loops; the bits differ from theirs.
static inline __attribute__((always_inline)) v16 sum_lanes_of_16(const v16* p) {
  v16 r1[8], r2[4], r3[2];
  for (int i = 0; i < 8; ++i)  // keys 2i, 2i+1: 8 partial sums each
    r1[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // keys 4i..4i+3: 4 each
    r2[i] = __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
            __builtin_shufflevector(r1[2 * i], r1[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // keys 8i..8i+7: 2 each
    r3[i] = __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
            __builtin_shufflevector(r2[2 * i], r2[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(r3[0], r3[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(r3[0], r3[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

static inline __attribute__((always_inline)) v16 load16(const float* p) {
  v16 r;
  std::memcpy(&r, p, sizeof r);
  return r;
}

// One block of keys (nb <= 16 rows at krows / vrows, row_stride floats apart) for the G
// query heads of one item: scores, online-softmax update, V sums (q already scaled).
template <int DV>
static inline __attribute__((always_inline)) void attend_block_simd(const float (*qf)[kMaxDim], float (*accf)[kMaxDim],
                                                                     float* m, float* l, int64_t G,
                                                                     const float* krows, const float* vrows,
                                                                     int64_t row_stride, int64_t nb,
                                                                     const Prefetch& pf, float softcap) {
  v16 q[kMaxGroup][DV], acc[kMaxGroup][DV];
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) {
      q[g][c] = load16(qf[g] + 16 * c);
      acc[g][c] = load16(accf[g] + 16 * c);
    }
  for (int64_t j0 = 0; j0 < nb; j0 += 16) {  // a block of up to 64 keys: 16 at a time
    const int64_t n = std::min<int64_t>(16, nb - j0);
    alignas(64) float e[kMaxGroup][16];
    for (int64_t g = 0; g < G; ++g) {
      v16 part[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j < n) {
          const float* kr = krows + (j0 + j) * row_stride;
          v16 p = q[g][0] * load16(kr);
          for (int c = 1; c < DV; ++c) p += q[g][c] * load16(kr + 16 * c);
          part[j] = p;
        } else {
          part[j] = v16{};
        }
      }
      v16 sc = sum_lanes_of_16(part);
      if (softcap > 0.f)
        for (int j = 0; j < 16; ++j) sc[j] = std::tanh(sc[j] / softcap) * softcap;
      float bm = -INFINITY;
      for (int64_t j = 0; j < n; ++j) bm = std::max(bm, sc[j]);
      const float m_new = std::max(m[g], bm);
      const float corr = std::exp(m[g] - m_new);
      // all 16 lanes at once (one vector exp), the lanes past the block's keys then zeroed
      std::memcpy(e[g], &sc, sizeof sc);
      float* eg = e[g];
#pragma omp simd
      for (int j = 0; j < 16; ++j) eg[j] = std::exp(eg[j] - m_new);
      for (int64_t j = n; j < 16; ++j) eg[j] = 0.f;
      float lsum = 0.f;
      for (int j = 0; j < 16; ++j) lsum += e[g][j];
      l[g] = l[g] * corr + lsum;
      m[g] = m_new;
      for (int c = 0; c < DV; ++c) acc[g][c] *= corr;
    }
    for (int64_t j = 0; j < n; ++j) {
      prefetch_row(pf, j0 + j);  // NOTE(prefetch-spread): one row of the block ahead per value row
      const float* vr = vrows + (j0 + j) * row_stride;
      v16 v[DV];
      for (int c = 0; c < DV; ++c) v[c] = load16(vr + 16 * c);
      for (int64_t g = 0; g < G; ++g) {
        const float p = e[g][j];
        for (int c = 0; c < DV; ++c) acc[g][c] += p * v[c];
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < DV; ++c) std::memcpy(accf[g] + 16 * c, &acc[g][c], sizeof(v16));
}

// One work item = one query token x one KV head: the `group` query heads that
// share that KV head are done together, so each K/V row is read once per item.
// For each block of keys: scores, an online-softmax update, then the V sum.
// The reduction order depends only on the item's own keys, never on the batch
// or on how its prompt was chunked (batch invariance).
template <int DV, typename scalar_t, typename kv_t>
static inline __attribute__((always_inline)) void attend_items(const Args<scalar_t, kv_t>& a, int64_t begin,
                                                               int64_t end) {
  const int64_t D = a.D, BS = a.BS, G = a.group, Hkv = a.H / a.group;
  alignas(64) float qf[kMaxGroup][kMaxDim], acc[kMaxGroup][kMaxDim], sc[kMaxGroup][kMaxBlock];
  float kf[kMaxBlock][kMaxDim], vf[kMaxBlock][kMaxDim];
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t item = begin; item < end; ++item) {
    const int32_t* w = a.work != nullptr ? a.work + 4 * item : nullptr;
    const int64_t t = w ? w[0] : item / Hkv, hk = w ? w[1] : item % Hkv;
    const int32_t s = a.seq_of[t];
    if (a.skip[s]) continue;
    const int64_t row_keys = causal_keys(a, t);
    const int64_t k0 = w ? w[2] : first_key(a, t), slot = w ? w[3] : -1;  // this item's keys: [k0, n_keys)
    const int64_t n_keys = slot < 0 ? row_keys : std::min<int64_t>(row_keys, k0 + kSegKeys);
    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* qrow = a.q + t * a.q_row + (hk * G + g) * D;
      for (int64_t d = 0; d < D; ++d) {
        qf[g][d] = (float)qrow[d] * a.scale;
        acc[g][d] = 0.f;
      }
      m[g] = -INFINITY;
      l[g] = 0.f;
    }
    const int32_t* table = a.bt + s * a.MB;
    // blocks from the one holding k0, the first read from k0's row on (NOTE(window-keys))
    for (int64_t start = k0; start < n_keys; start = (start / BS + 1) * BS) {
      const int64_t blk = table[start / BS], j0 = start % BS;
      const int64_t nb = std::min<int64_t>(BS - j0, n_keys - start);
      const kv_t* kb = a.k + blk * a.kv_block + j0 * a.kv_row + hk * D;
      const kv_t* vb = a.v + blk * a.kv_block + j0 * a.kv_row + hk * D;
      // NOTE(prefetch): blocks sit anywhere in a cache far larger than the CPU's
      // caches, and 16 rows of one head are too short a stream for the hardware
      // prefetcher: ask for the rows kPrefetchBlocks blocks ahead, running on
      // into the next item's first blocks.
      // Only a sequence's first query token of the step prefetches: the tokens
      // after it (a prefill chunk) read the same blocks, by then in the cache.
      Prefetch pf;
      if (t == a.qsl[s]) {
        int64_t ahead = start / BS + kPrefetchBlocks, it = item, hk2 = hk;
        const int32_t* tab = table;
        const int64_t nblocks = (n_keys + BS - 1) / BS;
        if (ahead >= nblocks) {
          ahead -= nblocks;
          it = item + 1;
          tab = nullptr;
          if (it < end) {
            const int32_t* w2 = a.work != nullptr ? a.work + 4 * it : nullptr;
            const int64_t t2 = w2 ? w2[0] : it / Hkv;
            const int32_t s2 = a.seq_of[t2];
            const int64_t n2 = causal_keys(a, t2);
            ahead += (w2 ? w2[2] : first_key(a, t2)) / BS;  // the next item's first block (its segment's)
            if (!a.skip[s2] && t2 == a.qsl[s2] && ahead * BS < n2) {
              tab = a.bt + s2 * a.MB;
              hk2 = w2 ? w2[1] : it % Hkv;
            }
          }
        }
        if (tab != nullptr) pf = prefetch_target(a, tab[ahead], hk2);
      }
      // NOTE(kv-load): a float32 cache is read in place; other dtypes are converted
      // to float scratch first, block by block (a quantized one: code * its row's
      // scale), so the loops below are the same for every cache dtype.
      const float* krows;
      const float* vrows;
      int64_t row_stride;
      if constexpr (std::is_same_v<kv_t, float>) {
        krows = kb;
        vrows = vb;
        row_stride = a.kv_row;
      } else {
        if (a.ks != nullptr) {
          const float* ksb = a.ks + (blk * BS + j0) * Hkv + hk;  // row j's scale at [j * Hkv]
          const float* vsb = a.vs + (blk * BS + j0) * Hkv + hk;
          for (int64_t j = 0; j < nb; ++j) {
            const float kscale = ksb[j * Hkv], vscale = vsb[j * Hkv];
            for (int64_t d = 0; d < D; ++d) {
              kf[j][d] = to_float(kb[j * a.kv_row + d]) * kscale;
              vf[j][d] = to_float(vb[j * a.kv_row + d]) * vscale;
            }
          }
        } else {
          for (int64_t j = 0; j < nb; ++j)
            for (int64_t d = 0; d < D; ++d) {
              kf[j][d] = to_float(kb[j * a.kv_row + d]);
              vf[j][d] = to_float(vb[j * a.kv_row + d]);
            }
        }
        krows = &kf[0][0];
        vrows = &vf[0][0];
        row_stride = kMaxDim;
      }
      for (int64_t j = nb; j < BS; ++j) prefetch_row(pf, j);  // a short block: the rows the loops below skip
      if constexpr (DV > 0) {  // NOTE(attn-simd)
        attend_block_simd<DV>(qf, acc, m, l, G, krows, vrows, row_stride, nb, pf, a.softcap);
        continue;
      }
      for (int64_t g = 0; g < G; ++g) {
        float bm = -INFINITY;
        for (int64_t j = 0; j < nb; ++j) {
          if (g == 0) prefetch_row(pf, j);  // NOTE(prefetch-spread)
          float dot = 0.f;
          const float* kr = krows + j * row_stride;
          for (int64_t d = 0; d < D; ++d) dot += qf[g][d] * kr[d];
          if (a.softcap > 0.f) dot = std::tanh(dot / a.softcap) * a.softcap;
          sc[g][j] = dot;
          bm = std::max(bm, dot);
        }
        const float m_new = std::max(m[g], bm);
        const float corr = std::exp(m[g] - m_new);
        float lsum = 0.f;
        for (int64_t j = 0; j < nb; ++j) {
          sc[g][j] = std::exp(sc[g][j] - m_new);
          lsum += sc[g][j];
        }
        l[g] = l[g] * corr + lsum;
        m[g] = m_new;
        // V sum, 16 output dims at a time held in registers across the block's
        // keys (per dim the same operations in the same order: corr, then key by key).
        float* ag = acc[g];
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          if (D - d0 >= 16) {
            v16 r;
            std::memcpy(&r, ag + d0, sizeof r);
            r *= corr;
            for (int64_t j = 0; j < nb; ++j) {
              v16 vr;
              std::memcpy(&vr, vrows + j * row_stride + d0, sizeof vr);
              r += sc[g][j] * vr;
            }
            std::memcpy(ag + d0, &r, sizeof r);
          } else {
            for (int64_t d = d0; d < D; ++d) {
              float r = ag[d] * corr;
              for (int64_t j = 0; j < nb; ++j) r += sc[g][j] * vrows[j * row_stride + d];
              ag[d] = r;
            }
          }
        }
      }
    }
    if (slot >= 0) {  // one segment of a long row: its partial softmax, merged by merge_segments
      float* pp = a.part + slot * G * (D + 2);
      for (int64_t g = 0; g < G; ++g, pp += D + 2) {
        pp[0] = m[g];
        pp[1] = l[g];
        std::memcpy(pp + 2, acc[g], D * sizeof(float));
      }
      continue;
    }
    for (int64_t g = 0; g < G; ++g) store_head(a, t, hk * G + g, acc[g], l[g]);
  }
}

// NOTE(key-segments): a long row's segments (slots first .. first + n - 1, in key order)
// merged into its output: the sums rescaled to the largest max, added in order.
template <typename scalar_t, typename kv_t>
static void merge_segments(const Args<scalar_t, kv_t>& a, int64_t t, int64_t hk, int64_t first, int64_t n) {
  const int64_t D = a.D, G = a.group, stride = G * (D + 2);
  for (int64_t g = 0; g < G; ++g) {
    const float* p0 = a.part + first * stride + g * (D + 2);
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, p0[i * stride]);
    float l = 0.f, acc[kMaxDim];
    for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      const float* pp = p0 + i * stride;
      const float f = std::exp(pp[0] - mx);
      l += pp[1] * f;
      for (int64_t d = 0; d < D; ++d) acc[d] += pp[2 + d] * f;
    }
    store_head(a, t, hk * G + g, acc, l);
  }
}

// NOTE(isa): one clone per ISA, chosen by the loader at start-up; the lambda
// that OpenMP runs only calls these (a lambda would not inherit the target).
#define SLUICE_ATTEND(NAME, QT, KVT)                                                       \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void NAME( \
      const Args<QT, KVT>& a, int64_t b, int64_t e) {                                     \
    if constexpr (std::is_same_v<QT, float>) switch (a.D) { /* NOTE(attn-simd) */              \
        case 16: return attend_items<1>(a, b, e);                                          \
        case 64: return attend_items<4>(a, b, e);                                          \
        case 128: return attend_items<8>(a, b, e);                                         \
        default: break;                                                                    \
      }                                                                                    \
    attend_items<0>(a, b, e);                                                              \
  }                                                                                        \
  void attend(const Args<QT, KVT>& a, int64_t b, int64_t e) { NAME(a, b, e); }

SLUICE_ATTEND(attend_f32, float, float)
SLUICE_ATTEND(attend_f32_bf16kv, float, c10::BFloat16)
SLUICE_ATTEND(attend_f32_fp8kv, float, Fp8)
SLUICE_ATTEND(attend_f32_i8kv, float, int8_t)
SLUICE_ATTEND(attend_bf16, c10::BFloat16, c10::BFloat16)
SLUICE_ATTEND(attend_bf16_f32kv, c10::BFloat16, float)
SLUICE_ATTEND(attend_bf16_fp8kv, c10::BFloat16, Fp8)
SLUICE_ATTEND(attend_bf16_i8kv, c10::BFloat16, int8_t)

template <typename scalar_t, typename kv_t>
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& ks,
         const torch::Tensor& vs, const torch::Tensor& bt, const torch::Tensor& qsl, const torch::Tensor& sl,
         const torch::Tensor& skip, double scale, int64_t window, double softcap, torch::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kc.size(1), Hkv = kc.size(2), S = sl.size(0);
  const int32_t* qslp = qsl.data_ptr<int32_t>();
  std::vector<int32_t> seq_of(T);
  for (int64_t s = 0; s < S; ++s)
    for (int32_t t = qslp[s]; t < qslp[s + 1]; ++t) seq_of[t] = (int32_t)s;
  const bool quant = ks.numel() > 0;
  Args<scalar_t, kv_t> a{q.data_ptr<scalar_t>(),
                         reinterpret_cast<const kv_t*>(kc.data_ptr()),
                         reinterpret_cast<const kv_t*>(vc.data_ptr()),
                         quant ? ks.data_ptr<float>() : nullptr,
                         quant ? vs.data_ptr<float>() : nullptr,
                         bt.data_ptr<int32_t>(), qslp, sl.data_ptr<int32_t>(), skip.data_ptr<uint8_t>(),
                         seq_of.data(), out.data_ptr<scalar_t>(), q.stride(0), H, D, BS, bt.size(1), H / Hkv, Hkv * D,
                         BS * Hkv * D, (float)scale};
  a.window = window;
  a.softcap = (float)softcap;
  // NOTE(key-segments): the work list, only when some row has more than kSegKeys keys
  std::vector<int32_t> work;
  std::vector<int64_t> merges;  // (t, hk, first slot, segments) of each cut row
  int64_t slots = 0;
  bool cut = false;
  for (int64_t t = 0; t < T && !cut; ++t) cut = !a.skip[seq_of[t]] && causal_keys(a, t) - first_key(a, t) > kSegKeys;
  if (cut) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t f = first_key(a, t);  // segments from the window's first key (NOTE(window-keys))
      const int64_t n = a.skip[seq_of[t]] ? 1 : (causal_keys(a, t) - f + kSegKeys - 1) / kSegKeys;
      for (int64_t hk = 0; hk < Hkv; ++hk) {
        if (n > 1) merges.insert(merges.end(), {t, hk, slots, n});
        for (int64_t i = 0; i < n; ++i)
          work.insert(work.end(), {(int32_t)t, (int32_t)hk, (int32_t)(f + i * kSegKeys), n > 1 ? (int32_t)slots++ : -1});
      }
    }
  }
  // uninitialized: every slot is written before the merge reads it (a 2048-token prefill chunk has ~9 MB of them)
  std::unique_ptr<float[]> part(slots > 0 ? new float[slots * (H / Hkv) * (D + 2)] : nullptr);
  a.work = cut ? work.data() : nullptr;
  a.part = part.get();
  const int64_t items = cut ? (int64_t)work.size() / 4 : T * Hkv;
  sluice::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) { attend(a, begin, end); });
  if (!merges.empty())
    sluice::parallel_for(0, (int64_t)merges.size() / 4, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i)
        merge_segments(a, merges[4 * i], merges[4 * i + 1], merges[4 * i + 2], merges[4 * i + 3]);
    });
}

template <typename scalar_t>
void run_q(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& ks,
           const torch::Tensor& vs, const torch::Tensor& bt, const torch::Tensor& qsl, const torch::Tensor& sl,
           const torch::Tensor& skip, double scale, int64_t w, double c, torch::Tensor& out) {
  switch (kc.scalar_type()) {
    case torch::kFloat: return run<scalar_t, float>(q, kc, vc, ks, vs, bt, qsl, sl, skip, scale, w, c, out);
    case torch::kBFloat16: return run<scalar_t, c10::BFloat16>(q, kc, vc, ks, vs, bt, qsl, sl, skip, scale, w, c, out);
    case torch::kFloat8_e4m3fn: return run<scalar_t, Fp8>(q, kc, vc, ks, vs, bt, qsl, sl, skip, scale, w, c, out);
    case torch::kChar: return run<scalar_t, int8_t>(q, kc, vc, ks, vs, bt, qsl, sl, skip, scale, w, c, out);
    default: TORCH_CHECK(false, "paged_attention: KV cache must be float32, bfloat16, float8_e4m3fn or int8");
  }
}

// (T, heads, D) rows of D contiguous elements, any stride between tokens: a
// query or new K/V split out of the fused QKV projection's output, uncopied.
static bool token_rows(const torch::Tensor& x) {
  return x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2);
}

// NOTE(kv-write): the new tokens' K/V go into their cache slots here, in C++,
// before any row is attended (a prefill's later tokens read its earlier ones).
// Two index_copy_ calls a layer cost ~35 us each through the dispatcher (4 ms
// of a 64-row SmolLM2 decode step); the rows are 3 x 64 floats.  Unquantized
// caches only: a quantized one is written by KVCache.write (quantize first).
static void write_slots(const torch::Tensor& x, const torch::Tensor& cache, const int64_t* slots, int64_t T) {
  const int64_t Hkv = cache.size(2), D = cache.size(3), row_bytes = D * (int64_t)cache.element_size();
  const int64_t ld = x.stride(0) * (int64_t)x.element_size(), head = x.stride(1) * (int64_t)x.element_size();
  const char* src = reinterpret_cast<const char*>(x.data_ptr());
  char* dst = reinterpret_cast<char*>(cache.data_ptr());
  sluice::parallel_for(0, T, 256, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
      for (int64_t h = 0; h < Hkv; ++h)
        std::memcpy(dst + (slots[t] * Hkv + h) * row_bytes, src + t * ld + h * head, row_bytes);
  });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor k_scales, torch::Tensor v_scales, torch::Tensor block_tables,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor skip,
                              double scale, std::optional<torch::Tensor> k_new_opt, std::optional<torch::Tensor> v_new_opt,
                              std::optional<torch::Tensor> slot_mapping_opt, int64_t window, double softcap) {
  // NOTE(qkv-rows): q may be the QKV projection's output itself, (T, (H + 2 Hkv) D):
  // the heads are sliced here (a few C++ view ops instead of a dozen Python-level
  // ones a layer), the new K/V come from it, and the output is (T, H D).
  const bool qkv_rows = q.dim() == 2;
  if (qkv_rows) {
    const int64_t T = q.size(0), D = k_cache.size(3), Hkv = k_cache.size(2);
    TORCH_CHECK(q.stride(1) == 1 && q.size(1) % D == 0 && q.size(1) / D > 2 * Hkv,
                "qkv: (T, (H + 2 Hkv) * head_dim) with contiguous rows");
    const int64_t H = q.size(1) / D - 2 * Hkv;
    auto heads = q.view({T, H + 2 * Hkv, D});
    if (slot_mapping_opt.has_value() && !k_new_opt.has_value() && !v_new_opt.has_value()) {
      k_new_opt = heads.narrow(1, H, Hkv);
      v_new_opt = heads.narrow(1, H + Hkv, Hkv);
    }
    q = heads.narrow(1, 0, H);
  }
  TORCH_CHECK(token_rows(q) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "q: (T, H, D) with contiguous rows; contiguous caches");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches of one dtype");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32, "int32 tables");
  TORCH_CHECK(skip.dtype() == torch::kUInt8 && skip.numel() == seq_lens.numel(), "skip: uint8, one per sequence");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(1) / k_cache.size(2) <= kMaxGroup, "query heads per KV head <= 16");
  TORCH_CHECK(q.size(2) <= kMaxDim && k_cache.size(1) <= kMaxBlock, "head_dim <= 256, block_size <= 64");
  const bool quant = k_cache.scalar_type() == torch::kFloat8_e4m3fn || k_cache.scalar_type() == torch::kChar;
  if (quant) {
    const auto want = std::vector<int64_t>{k_cache.size(0), k_cache.size(1), k_cache.size(2)};
    TORCH_CHECK(k_scales.dtype() == torch::kFloat && v_scales.dtype() == torch::kFloat &&
                    k_scales.is_contiguous() && v_scales.is_contiguous() && k_scales.sizes() == want &&
                    v_scales.sizes() == want,
                "a quantized KV cache needs float32 scales of shape (num_blocks, block_size, num_kv_heads)");
  } else {
    TORCH_CHECK(k_scales.numel() == 0 && v_scales.numel() == 0, "scales are for a quantized cache only");
  }
  if (slot_mapping_opt.has_value() && slot_mapping_opt->numel() > 0) {  // write the step's new K/V first (NOTE(kv-write))
    TORCH_CHECK(k_new_opt.has_value() && v_new_opt.has_value(), "slot_mapping comes with k_new and v_new");
    const torch::Tensor &slot_mapping = *slot_mapping_opt, &k_new = *k_new_opt, &v_new = *v_new_opt;
    const int64_t T = slot_mapping.numel(), slots_total = k_cache.size(0) * k_cache.size(1);
    TORCH_CHECK(!quant, "a quantized cache is written by KVCache.write, not by the kernel");
    TORCH_CHECK(slot_mapping.dtype() == torch::kLong && slot_mapping.is_contiguous(), "slot_mapping: contiguous int64");
    for (const auto* x : {&k_new, &v_new}) {
      TORCH_CHECK(token_rows(*x) && x->size(0) == T && x->size(1) == k_cache.size(2) && x->size(2) == k_cache.size(3),
                  "new K/V: (T, num_kv_heads, head_dim) with contiguous rows, one per slot");
      TORCH_CHECK(x->scalar_type() == k_cache.scalar_type(), "new K/V in the cache's dtype");
    }
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "slot ", slots[t], " outside the cache (", slots_total,
                  " slots)");
    write_slots(k_new, k_cache, slots, T);
    write_slots(v_new, v_cache, slots, T);
  }
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap: >= 0 (0: none)");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == torch::kFloat)
    run_q<float>(q, k_cache, v_cache, k_scales, v_scales, block_tables, query_start_loc, seq_lens, skip, scale, window,
                 softcap, out);
  else if (q.scalar_type() == torch::kBFloat16)
    run_q<c10::BFloat16>(q, k_cache, v_cache, k_scales, v_scales, block_tables, query_start_loc, seq_lens, skip,
                         scale, window, softcap, out);
  else
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16 queries only");
  return qkv_rows ? out.view({q.size(0), q.size(1) * q.size(2)}) : out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  SLUICE_BIND_WORK_POOL(m);
  SLUICE_BIND_SOURCE_HASH(m);
  m.def("paged_attention", &paged_attention, "paged attention over the block tables (CPU); writes k_new/v_new at "
        "slot_mapping first unless slot_mapping is empty; q may be the (T, (H + 2 Hkv) D) qkv rows; window: each query "
        "sees its last `window` keys (0: all); softcap: scores tanh-capped (0: not)",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("k_scales"),
        pybind11::arg("v_scales"), pybind11::arg("block_tables"), pybind11::arg("query_start_loc"),
        pybind11::arg("seq_lens"), pybind11::arg("skip"), pybind11::arg("scale"),
        pybind11::arg("k_new") = pybind11::none(), pybind11::arg("v_new") = pybind11::none(),
        pybind11::arg("slot_mapping") = pybind11::none(), pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
}
