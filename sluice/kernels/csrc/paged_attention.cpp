// Paged attention for a flattened batch, reading K/V in place from the blocks.
//
//   q: (T, H, D); k_cache/v_cache: (NB, BS, Hkv, D); block_tables: (S, MB) int32;
//   query_start_loc: (S+1) int32; seq_lens: (S) int32; skip: (S) uint8, sequences
//   whose rows the caller fills itself (left untouched here).  Out: (T, H, D).
//
// Online softmax over the blocks of each sequence, one (token, KV head) per
// work item, OpenMP across items.  Built at install time (setup.py) without
// -march=native: the row loop is compiled once per ISA (target_clones) and the
// best clone is picked when the library loads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

template <typename scalar_t>
struct Args {
  const scalar_t* q;
  const scalar_t* k;
  const scalar_t* v;
  const int32_t* bt;
  const int32_t* qsl;
  const int32_t* sl;
  const uint8_t* skip;
  const int32_t* seq_of;
  scalar_t* out;
  int64_t H, D, BS, MB, group, kv_row, kv_block;
  float scale;
};

constexpr int kMaxGroup = 16;   // query heads per KV head
constexpr int kMaxDim = 256;    // head_dim
constexpr int kMaxBlock = 64;   // block_size

// One work item = one query token x one KV head: the `group` query heads that
// share that KV head are done together, so each K/V row is read once per item.
// For each block of keys: scores, an online-softmax update, then the V sum.
// The reduction order depends only on the item's own keys, never on the batch
// or on how its prompt was chunked (batch invariance).
template <typename scalar_t>
static inline __attribute__((always_inline)) void attend_items(const Args<scalar_t>& a, int64_t begin,
                                                               int64_t end) {
  const int64_t D = a.D, BS = a.BS, G = a.group, Hkv = a.H / a.group;
  float qf[kMaxGroup][kMaxDim], acc[kMaxGroup][kMaxDim], sc[kMaxGroup][kMaxBlock];
  float kf[kMaxBlock][kMaxDim], vf[kMaxBlock][kMaxDim];
  float m[kMaxGroup], l[kMaxGroup];
  for (int64_t item = begin; item < end; ++item) {
    const int64_t t = item / Hkv, hk = item % Hkv;
    const int32_t s = a.seq_of[t];
    if (a.skip[s]) continue;
    const int64_t ql = a.qsl[s + 1] - a.qsl[s];
    const int64_t n_keys = a.sl[s] - ql + (t - a.qsl[s]) + 1;  // causal
    for (int64_t g = 0; g < G; ++g) {
      const scalar_t* qrow = a.q + (t * a.H + hk * G + g) * D;
      for (int64_t d = 0; d < D; ++d) {
        qf[g][d] = (float)qrow[d] * a.scale;
        acc[g][d] = 0.f;
      }
      m[g] = -INFINITY;
      l[g] = 0.f;
    }
    const int32_t* table = a.bt + s * a.MB;
    for (int64_t start = 0; start < n_keys; start += BS) {
      const int64_t blk = table[start / BS];
      const int64_t nb = std::min<int64_t>(BS, n_keys - start);
      const scalar_t* kb = a.k + blk * a.kv_block + hk * D;
      const scalar_t* vb = a.v + blk * a.kv_block + hk * D;
      // NOTE(kv-load): rows are converted to float scratch first; a quantized cache
      // dequantizes here, block by block, in place of this copy.
      for (int64_t j = 0; j < nb; ++j)
        for (int64_t d = 0; d < D; ++d) {
          kf[j][d] = (float)kb[j * a.kv_row + d];
          vf[j][d] = (float)vb[j * a.kv_row + d];
        }
      for (int64_t g = 0; g < G; ++g) {
        float bm = -INFINITY;
        for (int64_t j = 0; j < nb; ++j) {
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qf[g][d] * kf[j][d];
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
        float* ag = acc[g];
        for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
        for (int64_t j = 0; j < nb; ++j) {
          const float p = sc[g][j];
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[j][d];
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      scalar_t* orow = a.out + (t * a.H + hk * G + g) * D;
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      for (int64_t d = 0; d < D; ++d) orow[d] = (scalar_t)(acc[g][d] * inv);
    }
  }
}

// NOTE(isa): one clone per ISA, chosen by the loader at start-up; the lambda
// that OpenMP runs only calls these (a lambda would not inherit the target).
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void attend_f32(const Args<float>& a, int64_t begin, int64_t end) { attend_items(a, begin, end); }

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
void attend_bf16(const Args<c10::BFloat16>& a, int64_t begin, int64_t end) { attend_items(a, begin, end); }

void attend(const Args<float>& a, int64_t b, int64_t e) { attend_f32(a, b, e); }
void attend(const Args<c10::BFloat16>& a, int64_t b, int64_t e) { attend_bf16(a, b, e); }

template <typename scalar_t>
void run(const torch::Tensor& q, const torch::Tensor& kc, const torch::Tensor& vc, const torch::Tensor& bt,
         const torch::Tensor& qsl, const torch::Tensor& sl, const torch::Tensor& skip, double scale,
         torch::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t BS = kc.size(1), Hkv = kc.size(2), S = sl.size(0);
  const int32_t* qslp = qsl.data_ptr<int32_t>();
  std::vector<int32_t> seq_of(T);
  for (int64_t s = 0; s < S; ++s)
    for (int32_t t = qslp[s]; t < qslp[s + 1]; ++t) seq_of[t] = (int32_t)s;
  Args<scalar_t> a{q.data_ptr<scalar_t>(), kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(),
                   bt.data_ptr<int32_t>(), qslp, sl.data_ptr<int32_t>(), skip.data_ptr<uint8_t>(),
                   seq_of.data(), out.data_ptr<scalar_t>(), H, D, BS, bt.size(1), H / Hkv, Hkv * D,
                   BS * Hkv * D, (float)scale};
  at::parallel_for(0, T * Hkv, 1, [&](int64_t begin, int64_t end) { attend(a, begin, end); });
}

}  // namespace

torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor query_start_loc,
                              torch::Tensor seq_lens, torch::Tensor skip, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(block_tables.dtype() == torch::kInt32 && seq_lens.dtype() == torch::kInt32, "int32 tables");
  TORCH_CHECK(skip.dtype() == torch::kUInt8 && skip.numel() == seq_lens.numel(), "skip: uint8, one per sequence");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(1) / k_cache.size(2) <= kMaxGroup, "query heads per KV head <= 16");
  TORCH_CHECK(q.size(2) <= kMaxDim && k_cache.size(1) <= kMaxBlock, "head_dim <= 256, block_size <= 64");
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat)
    run<float>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, skip, scale, out);
  else if (q.scalar_type() == torch::kBFloat16)
    run<c10::BFloat16>(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, skip, scale, out);
  else
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16 only");
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over the block tables (CPU)");
}
