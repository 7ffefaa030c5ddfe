// MoEOp: a mixture-of-experts MLP layer in one C++ call (sluice/models/moe.py).
//
// NOTE(grouped-op): for the T rows of x (T, H), k experts a row, E experts of
// gate_up (2I, H) and down (H, I), all quantized:
//
//   logits = x @ Wr^T                 float32 router on the batch-invariant tile (fp32_tile.h)
//   p = softmax(logits); top-k        per row, ties to the lower expert; renormalised if the model says so
//   slots (t, j) sorted by expert     counting sort, stable:  expert 0 rows | expert 1 rows | ...
//   xq = int8(x)                      each token quantized once, its rows gathered per slot
//   gu = xq[slots] @ Wgu_e^T          the tiles of EVERY routed expert in one parallel loop
//   a  = silu(gu[:, :I]) * gu[:, I:]  ops.cpp's silu_mul, the op a dense layer uses
//   y  = int8(a) @ Wd_e^T             every routed expert's down tiles in one parallel loop
//   out[t] = res[t] + sum_j w[t, j] * y[slot(t, j)]      j = 0 .. k-1, in slot order
//
// It replaces a Python loop of one gate_up and one down call per routed expert (each its own
// pool loop), a gather, a scatter and k adds per layer: with the router, 27% of a batch-1 step
// of the issue-56 MoE benchmark (docs/benchmarks.md).  Batch invariance holds as for one linear:
// the tiles are the qgemm kernels' own (tile_fn), one thread reduces an output element's K in
// a fixed order, and a tile's rows do not change each other's bits, so a token's output is the
// same whatever other tokens share its experts, and equals running its experts one by one
// (tests/kernel_tests/test_moe_grouped.py).  Each expert's path is its own plan's choice for its
// row count (every path gives the same bits); an expert on the AMX path runs its own run_gemm.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "fp32_tile.h"
#include "ops.h"
#include "qgemm.h"
#include "work_pool.h"

namespace sluice {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// One expert's linear: a packed quantized matrix and its kernel path per row count.
struct ExpertLinear {
  at::Tensor data, scale, mins;  // held: w points into them
  WPack w{};
  std::vector<int64_t> tops, paths;  // path for row counts <= tops[i]
  int64_t nbytes = 0;

  int path_for(int64_t m) const {
    for (size_t i = 0; i < tops.size(); ++i)
      if (m <= tops[i]) return (int)paths[i];
    return (int)paths.back();
  }
  bool is_set() const { return data.defined(); }
};

// Quantized activations of M rows (the ActQ arrays), owning their storage; allocated
// uninitialized (NOTE(uninit-act) in qlinear_op.cpp): quantize or copy_row writes each row.
struct QRows {
  int64_t M, K, KB;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> f;    // dx | dxs | dxs16
  std::unique_ptr<int32_t[]> i;  // xs | xs16
  float *dx, *dxs, *dxs16;
  int32_t *xs, *xs16;

  QRows(int64_t M_, int64_t K_)
      : M(M_), K(K_), KB(K_ / kBlock), q(new int8_t[M_ * K_]), f(new float[M_ * KB * 4]), i(new int32_t[M_ * KB * 3]),
        dx(f.get()), dxs(dx + M * KB), dxs16(dxs + M * KB), xs(i.get()), xs16(xs + M * KB) {}

  void quantize(const float* x, int64_t ldx, int isa) {
    quantize_rows_parallel(x, M, K, ldx, q.get(), dx, dxs, dxs16, xs, xs16, isa);
  }
  // row `to` of these = row `from` of src (the same K)
  void copy_row(int64_t to, const QRows& src, int64_t from) {
    std::memcpy(q.get() + to * K, src.q.get() + from * K, K);
    std::memcpy(dx + to * KB, src.dx + from * KB, KB * sizeof(float));
    std::memcpy(dxs + to * KB, src.dxs + from * KB, KB * sizeof(float));
    std::memcpy(dxs16 + 2 * to * KB, src.dxs16 + 2 * from * KB, 2 * KB * sizeof(float));
    std::memcpy(xs + to * KB, src.xs + from * KB, KB * sizeof(int32_t));
    std::memcpy(xs16 + 2 * to * KB, src.xs16 + 2 * from * KB, 2 * KB * sizeof(int32_t));
  }
  // the activations of rows row0, row0 + 1, ...
  ActQ from(int64_t row0) const {
    return ActQ{q.get() + row0 * K, dx + row0 * KB, dxs + row0 * KB, dxs16 + 2 * row0 * KB,
                xs + row0 * KB,     xs16 + 2 * row0 * KB, K};
  }
};

// A range of one expert's output tiles: the unit the grouped loop hands out.
struct Item {
  int32_t e;
  int32_t t0, t1;
};

// The routing of one row: softmax over E logits, the top k (probability down, ties to the lower
// expert; a NaN ranks last), renormalised to sum to 1 when `normalize`.  p, idx: E scratch.
void route_row(const float* l, int64_t E, int64_t k, bool normalize, float* p, int32_t* idx, float* w,
               int64_t* ids) {
  float m = l[0];
  for (int64_t i = 1; i < E; ++i) m = std::max(m, l[i]);
  float s = 0.f;
  for (int64_t i = 0; i < E; ++i) {
    p[i] = std::exp(l[i] - m);
    s = s + p[i];
  }
  for (int64_t i = 0; i < E; ++i) p[i] = p[i] / s;
  std::iota(idx, idx + E, 0);
  auto key = [&](int32_t a) { return p[a] == p[a] ? p[a] : -1.f; };
  std::partial_sort(idx, idx + k, idx + E,
                    [&](int32_t a, int32_t b) { return key(a) > key(b) || (key(a) == key(b) && a < b); });
  float ws = 0.f;
  for (int64_t j = 0; j < k; ++j) ws = ws + p[idx[j]];
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = idx[j];
    w[j] = normalize ? p[idx[j]] / ws : p[idx[j]];
  }
}

}  // namespace

class MoEOp {
 public:
  MoEOp(int64_t hidden, int64_t inter, int64_t num_experts, int64_t top_k, bool normalize)
      : H_(hidden), I_(inter), E_(num_experts), k_(top_k), normalize_(normalize), gu_(num_experts), dn_(num_experts) {
    TORCH_CHECK(hidden > 0 && hidden % kBlock == 0 && inter > 0 && inter % kBlock == 0,
                "MoEOp: hidden and intermediate sizes must be positive multiples of 32, got ", hidden, ", ", inter);
    TORCH_CHECK(num_experts > 0 && top_k > 0 && top_k <= num_experts, "MoEOp: top_k ", top_k, " of ", num_experts,
                " experts");
  }

  // The router's float32 weight, packed (ceil(E/16), H, 16) (linear.pack_fp32), and the path whose float ISA
  // runs it (every one gives the same bits: fp32_tile.h).  Without it, forward takes the logits.
  void set_router(const at::Tensor& packed, int64_t path) {
    TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.dim() == 3 &&
                    packed.size(0) == (E_ + kTile - 1) / kTile && packed.size(1) == H_ && packed.size(2) == kTile,
                "MoEOp router: packed float32 (ceil(E/16), H, 16)");
    TORCH_CHECK(path_supported((int)path), "kernel path ", path, " is not supported by this CPU");
    router_ = packed;
    router_isa_ = path == kScalar ? 0 : (path == kAvx512Vnni || path == kAmx ? 2 : 1);
  }

  // Expert e's gate_up (which 0: (2I, H), gate rows first) or down (which 1: (H, I)): packed quantized
  // data, scales, mins (qlinear.PackedWeight), group size, mode, and its kernel path per row count.
  void set_expert(int64_t e, int64_t which, const at::Tensor& data, const at::Tensor& scale, const at::Tensor& mins,
                  int64_t G, int64_t mode, std::vector<int64_t> tops, std::vector<int64_t> paths) {
    TORCH_CHECK(e >= 0 && e < E_ && (which == 0 || which == 1), "MoEOp.set_expert: expert ", e, " of ", E_,
                ", which ", which, " (0 gate_up, 1 down)");
    const int64_t n = which == 0 ? 2 * I_ : H_, K = which == 0 ? H_ : I_;
    TORCH_CHECK(mode == kW4 || mode == kW8 || mode == kW8Small, "MoEOp: mode ", mode);
    TORCH_CHECK(G == 16 || (G % kBlock == 0 && K % G == 0), "MoEOp: group size ", G, " for K=", K);
    const int64_t NT = (n + kTile - 1) / kTile, KB = K / kBlock, NG = K / G;
    TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.numel() == NT * KB * block_bytes((int)mode),
                "MoEOp: expert ", e, " packed data does not match n=", n, " k=", K, " mode=", mode);
    TORCH_CHECK(scale.is_contiguous() && mins.is_contiguous() && scale.numel() == NT * NG * kTile &&
                    mins.numel() == scale.numel() && scale.scalar_type() == mins.scalar_type() &&
                    (scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat),
                "MoEOp: expert ", e, " packed scales do not match");
    TORCH_CHECK(!tops.empty() && tops.size() == paths.size(), "MoEOp: one path per batch bucket");
    for (auto p : paths) TORCH_CHECK(path_supported((int)p), "kernel path ", p, " is not supported by this CPU");
    ExpertLinear& L = (which == 0 ? gu_ : dn_)[e];
    L.data = data;
    L.scale = scale;
    L.mins = mins;
    L.w = WPack{data.data_ptr<uint8_t>(), scale.data_ptr(), mins.data_ptr(), n, K, NT, KB, NG, (int)G, (int)mode,
                scale.scalar_type() == at::kHalf};
    L.tops = std::move(tops);
    L.paths = std::move(paths);
    L.nbytes = data.numel() + scale.numel() * scale.element_size() + mins.numel() * mins.element_size();
  }

  // (w (T, k) float32, ids (T, k) int64): the routing forward uses.
  std::vector<at::Tensor> route(const at::Tensor& x, const c10::optional<at::Tensor>& logits) const {
    check_x(x);
    const float* lp = check_logits(x, logits);
    const int64_t T = x.size(0);
    auto w = at::empty({T, k_}, x.options());
    auto ids = at::empty({T, k_}, x.options().dtype(at::kLong));
    route_rows(x.data_ptr<float>(), x.stride(0), T, lp, w.data_ptr<float>(), ids.data_ptr<int64_t>());
    return {w, ids};
  }

  // out (T, H) = residual + moe(x), written into residual when given (NOTE(grouped-op)); logits (T, E) when the
  // op has no router weight.
  at::Tensor forward(const at::Tensor& x, const c10::optional<at::Tensor>& logits,
                     const c10::optional<at::Tensor>& residual) const {
    check_x(x);
    const float* lp = check_logits(x, logits);
    const int64_t T = x.size(0);
    at::Tensor out;
    if (residual.has_value()) {
      const at::Tensor& r = *residual;
      TORCH_CHECK(r.dim() == 2 && r.size(0) == T && r.size(1) == H_ && r.scalar_type() == at::kFloat && r.stride(1) == 1,
                  "MoEOp: residual (T, H) float32 with contiguous rows");
      out = r;
    } else {
      out = at::zeros({T, H_}, x.options());
    }
    for (int64_t e = 0; e < E_; ++e)
      TORCH_CHECK(gu_[e].is_set() && dn_[e].is_set(), "MoEOp: expert ", e, " has no weights (set_expert)");
    // NOTE(token-blocks): a long prefill runs in blocks of 512 tokens, so the pass's buffers stay bounded
    // (~22 KB a routed slot at Qwen3-30B-A3B's shape, 8 a token: ~90 MB a block); rows are independent, so
    // blocks change no bit, and 512 x 8 slots still give each of 128 experts ~32 rows (the AMX path's size).
    constexpr int64_t kTokenBlock = 512;
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t t0 = 0; t0 < T; t0 += kTokenBlock)
      run_rows(xp + t0 * x.stride(0), x.stride(0), std::min(kTokenBlock, T - t0), lp ? lp + t0 * E_ : nullptr,
               op + t0 * out.stride(0), out.stride(0));
    return out;
  }

  // (calls, route ns, expert GEMM ns, total ns, routed experts, expert bytes read) since the last reset
  std::vector<int64_t> stats() const { return std::vector<int64_t>(stats_, stats_ + 6); }
  void reset_stats() { std::fill(stats_, stats_ + 6, 0); }

 private:
  void check_x(const at::Tensor& x) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == H_ && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
                "MoEOp: x (T, ", H_, ") float32 on the CPU with contiguous rows");
  }

  const float* check_logits(const at::Tensor& x, const c10::optional<at::Tensor>& logits) const {
    if (!logits.has_value()) {
      TORCH_CHECK(router_.defined(), "MoEOp: no router weight (set_router) and no logits");
      return nullptr;
    }
    const at::Tensor& l = *logits;
    TORCH_CHECK(l.dim() == 2 && l.size(0) == x.size(0) && l.size(1) == E_ && l.scalar_type() == at::kFloat &&
                    l.is_contiguous(),
                "MoEOp: logits (T, ", E_, ") float32 contiguous");
    return l.data_ptr<float>();
  }

  // w, ids (T, k) of rows x (T, H): from `logits` (T, E), else from the router weight
  void route_rows(const float* x, int64_t ldx, int64_t T, const float* logits, float* w, int64_t* ids) const {
    std::unique_ptr<float[]> own;
    if (!logits) {
      own.reset(new float[T * E_]);
      router_logits(x, ldx, T, own.get());
      logits = own.get();
    }
    sluice::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
      std::vector<float> p(E_);
      std::vector<int32_t> idx(E_);
      for (int64_t t = b; t < e; ++t)
        route_row(logits + t * E_, E_, k_, normalize_, p.data(), idx.data(), w + t * k_, ids + t * k_);
    });
  }

  // out (T, H) += the MoE of rows x (T, H): the pass of NOTE(grouped-op)
  void run_rows(const float* x, int64_t ldx, int64_t T, const float* logits, float* out, int64_t ldo) const {
    const int64_t P = T * k_;
    const int64_t t_start = now_ns();
    std::vector<float> w(P);
    std::vector<int64_t> ids(P);
    route_rows(x, ldx, T, logits, w.data(), ids.data());
    const int64_t t_routed = now_ns();
    // slots by expert, stable: pos[s] is slot s's row in the sorted order, tok[p] the token of row p
    std::vector<int64_t> cnt(E_, 0), off(E_ + 1, 0), pos(P), tok(P);
    for (int64_t s = 0; s < P; ++s) ++cnt[ids[s]];
    for (int64_t e = 0; e < E_; ++e) off[e + 1] = off[e] + cnt[e];
    {
      std::vector<int64_t> next(off.begin(), off.end() - 1);
      for (int64_t s = 0; s < P; ++s) {
        const int64_t p = next[ids[s]]++;
        pos[s] = p;
        tok[p] = s / k_;
      }
    }
    const int isa = act_quant_isa((int)gu_[0].paths.front());  // every ISA quantizes to the same bits
    // gate_up over the gathered rows, then SiLU x up
    QRows xq(T, H_), gq(P, H_);
    xq.quantize(x, ldx, isa);
    sluice::parallel_for(0, P, 64, [&](int64_t b, int64_t e) {
      for (int64_t p = b; p < e; ++p) gq.copy_row(p, xq, tok[p]);
    });
    auto gu = at::empty({P, 2 * I_}, at::TensorOptions().dtype(at::kFloat));
    int64_t gemm_ns = grouped_gemm(gq, cnt, off, gu_, gu.data_ptr<float>(), 2 * I_);
    const at::Tensor a = silu_mul(gu);
    // down over the activations' rows
    QRows aq(P, I_);
    aq.quantize(a.data_ptr<float>(), I_, isa);
    std::unique_ptr<float[]> y(new float[P * H_]);
    gemm_ns += grouped_gemm(aq, cnt, off, dn_, y.get(), H_);
    // out[t] += sum_j w[t, j] * y[pos(t, j)], j in slot order: the bits of the loop in models/moe.py
    sluice::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        float* o = out + t * ldo;
        for (int64_t j = 0; j < k_; ++j) {
          const float* yr = y.get() + pos[t * k_ + j] * H_;
          const float wj = w[t * k_ + j];
          for (int64_t h = 0; h < H_; ++h) o[h] = o[h] + yr[h] * wj;
        }
      }
    });
    // NOTE(moe-stats): what benchmarks/serving_moe_step.py reads (one caller at a time, as the engine's step)
    int64_t experts = 0, bytes = 0;
    for (int64_t e = 0; e < E_; ++e)
      if (cnt[e]) {
        ++experts;
        bytes += gu_[e].nbytes + dn_[e].nbytes;
      }
    stats_[0] += 1;
    stats_[1] += t_routed - t_start;
    stats_[2] += gemm_ns;
    stats_[3] += now_ns() - t_start;
    stats_[4] += experts;
    stats_[5] += bytes;
  }

  // logits (T, E) = x @ Wr^T, the tiles of run_dense_gemm (so the bits of the router Linear), one tile a chunk:
  // its grain keeps a batch-1 router (8 tiles of 2048 x 16) on one thread
  void router_logits(const float* x, int64_t ldx, int64_t T, float* out) const {
    const int64_t NT = router_.size(0);
    const float* wp = router_.data_ptr<float>();
    sluice::parallel_for(0, NT, 1, [&](int64_t t0, int64_t t1) {
      alignas(64) float res[4 * kTile];
      for (int64_t tile = t0; tile < t1; ++tile) {
        const int64_t n0 = tile * kTile, nn = std::min<int64_t>(kTile, E_ - n0);
        for (int64_t m0 = 0; m0 < T; m0 += 4) {
          const int r = (int)std::min<int64_t>(4, T - m0);
          fp32_tile::kTiles[router_isa_][r - 1](x + m0 * ldx, ldx, wp + tile * H_ * kTile, H_, res);
          for (int i = 0; i < r; ++i) std::memcpy(out + (m0 + i) * E_ + n0, res + i * kTile, nn * sizeof(float));
        }
      }
    });
  }

  // out rows [off[e], off[e] + cnt[e]) = rows of `a` there @ W_e^T, for every expert with rows: the tiles of the
  // experts on the vector paths in one parallel loop (items of gemm_grain tiles, NOTE(gemm-grain)); an expert on
  // the AMX path runs its own.  Returns the nanoseconds it took.
  //
  // NOTE(claimed-items): the loop's threads claim items one at a time from a shared counter instead of taking
  // the pool's fixed chunks: one pool chunk is an eighth of the loop, here a whole layer's experts, and a worker
  // the OS takes off its core mid-chunk (NOTE(pool-waits)) would hold that eighth; now it holds one item (one
  // expert's few tiles), and the caller claims the rest.  Each item is one thread's, so no bit depends on it.
  int64_t grouped_gemm(const QRows& a, const std::vector<int64_t>& cnt, const std::vector<int64_t>& off,
                       const std::vector<ExpertLinear>& lin, float* out, int64_t ldo) const {
    const int64_t t0 = now_ns();
    std::vector<Item> items;
    std::vector<int64_t> amx;
    for (int64_t e = 0; e < E_; ++e) {
      if (!cnt[e]) continue;
      const ExpertLinear& L = lin[e];
      if (L.path_for(cnt[e]) == kAmx) {
        amx.push_back(e);
        continue;
      }
      const int64_t grain = gemm_grain(L.w.KB, cnt[e]);
      for (int64_t t = 0; t < L.w.NT; t += grain)
        items.push_back(Item{(int32_t)e, (int32_t)t, (int32_t)std::min<int64_t>(L.w.NT, t + grain)});
    }
    constexpr int64_t kRowBlock = 64, kTileGroup = 8;  // as run_gemm: NOTE(m-blocking), NOTE(tile-groups)
    const int64_t num_items = (int64_t)items.size();
    std::atomic<int64_t> next{0};
    sluice::parallel_for(0, std::min<int64_t>(num_items, 16), 1, [&](int64_t, int64_t) {
      alignas(64) float res[kMaxTileRows * kTile];
      for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
        const Item& it = items[i];
        const ExpertLinear& L = lin[it.e];
        const int64_t n = cnt[it.e], row0 = off[it.e];
        const int path = L.path_for(n), rmax = tile_rows(path);
        const ActQ ae = a.from(row0);
        for (int64_t mb = 0; mb < n; mb += kRowBlock) {
          const int64_t me = std::min<int64_t>(n, mb + kRowBlock);
          for (int64_t tg = it.t0; tg < it.t1; tg += kTileGroup) {
            const int64_t te = std::min<int64_t>(it.t1, tg + kTileGroup);
            for (int64_t m0 = mb; m0 < me; m0 += rmax) {
              const int r = (int)std::min<int64_t>(rmax, me - m0);
              const TileFn fn = tile_fn(path, r);
              for (int64_t tile = tg; tile < te; ++tile) {
                fn(ae, m0, L.w, tile, res);
                const int64_t n0 = tile * kTile, nn = std::min<int64_t>(kTile, L.w.N - n0);
                for (int q = 0; q < r; ++q)
                  std::memcpy(out + (row0 + m0 + q) * ldo + n0, res + q * kTile, nn * sizeof(float));
              }
            }
          }
        }
      }
    });
    for (int64_t e : amx)
      run_gemm(a.from(off[e]), cnt[e], lin[e].w, out + off[e] * ldo, ldo, 0, nullptr, nullptr, 0, kAmx);
    return now_ns() - t0;
  }

  int64_t H_, I_, E_, k_;
  bool normalize_;
  std::vector<ExpertLinear> gu_, dn_;
  at::Tensor router_;
  int router_isa_ = 0;
  mutable int64_t stats_[6] = {0, 0, 0, 0, 0, 0};
};

void register_moe(pybind11::module& m) {
  pybind11::class_<MoEOp>(m, "MoEOp")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, bool>(), pybind11::arg("hidden"),
           pybind11::arg("inter"), pybind11::arg("num_experts"), pybind11::arg("top_k"), pybind11::arg("normalize"))
      .def("set_router", &MoEOp::set_router)
      .def("set_expert", &MoEOp::set_expert)
      .def("route", &MoEOp::route, pybind11::arg("x"), pybind11::arg("logits") = pybind11::none())
      .def("forward", &MoEOp::forward, pybind11::arg("x"), pybind11::arg("logits") = pybind11::none(),
           pybind11::arg("residual") = pybind11::none())
      .def("stats", &MoEOp::stats)
      .def("reset_stats", &MoEOp::reset_stats);
}

}  // namespace sluice
