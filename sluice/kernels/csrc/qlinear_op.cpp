// QLinearOp: one linear layer (quantized and/or dense row blocks) behind one
// C++ call, and the fused halves of a decoder layer built on it.
//
// NOTE(overhead): at batch 1 a Python-level layer spends more time in
// dispatch (module calls, argument conversion, small allocations) than in its
// GEMMs.  A decoder layer here is three calls into C++:
//
//   qkv = attn_in(x, ...)      rmsnorm -> quantize -> qkv GEMM -> rope(q, k)
//   o   = attention(...)       (the attention backend, in Python)
//   x  += o_proj(o)            quantize -> GEMM with the residual add in its epilogue
//   mlp(x, ...)                rmsnorm -> gate_up GEMM -> silu*up -> down GEMM (+= x)
//
// Every step is row-local and reduced in a fixed order: batch invariant.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <memory>
#include <vector>

#include "ops.h"
#include "qgemm.h"
#include "work_pool.h"

namespace sluice {
namespace {

// Quantized activations of M rows, owning their storage.
// NOTE(uninit-act): the buffers are allocated uninitialized (new T[n], not std::vector<T>(n)):
// quantize_rows writes every element, and a vector's zero-fill ran on the calling thread
// alone before the parallel quantization (~2% of a full-batch step's samples, perf, a Zen 4).
struct ActBuf {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> f;    // dx | dxs | dxs16
  std::unique_ptr<int32_t[]> i;  // xs | xs16
  ActQ a{};

  ActBuf(const float* x, int64_t M, int64_t K, int64_t ldx, int path)
      : q(new int8_t[M * K]), f(new float[M * (K / kBlock) * 4]), i(new int32_t[M * (K / kBlock) * 3]) {
    const int64_t KB = K / kBlock;
    float* dx = f.get();
    float* dxs = dx + M * KB;
    float* dxs16 = dxs + M * KB;
    int32_t* xs = i.get();
    int32_t* xs16 = xs + M * KB;
    quantize_rows_parallel(x, M, K, ldx, q.get(), dx, dxs, dxs16, xs, xs16, act_quant_isa(path));
    a = ActQ{q.get(), dx, dxs, dxs16, xs, xs16, K};
  }
};

struct Part {
  bool dense = false;
  bool packed = false;  // dense weights in the batch-invariant [N/16][K][16] layout
  at::Tensor data, scale, mins;  // quantized
  at::Tensor w;                  // dense (n, K) float32
  int64_t n = 0, G = 32, mode = 0, col0 = 0;
  std::vector<int64_t> tops{INT64_MAX}, paths{kScalar};  // path for batch sizes <= tops[i]

  int path_for(int64_t m) const {
    for (size_t i = 0; i < tops.size(); ++i)
      if (m <= tops[i]) return (int)paths[i];
    return (int)paths.back();
  }
};

}  // namespace

class QLinearOp {
 public:
  QLinearOp(int64_t in_features, int64_t out_features) : in_(in_features), out_(out_features) {}

  void add_quant(const at::Tensor& data, const at::Tensor& scale, const at::Tensor& mins, int64_t n, int64_t G,
                 int64_t mode) {
    TORCH_CHECK(in_ % kBlock == 0, "quantized linear: in_features must be a multiple of 32");
    const int64_t NT = (n + kTile - 1) / kTile, KB = in_ / kBlock, NG = in_ / G;
    TORCH_CHECK(data.scalar_type() == at::kByte && data.is_contiguous() && data.numel() == NT * KB * block_bytes((int)mode),
                "packed data does not match n=", n, " k=", in_, " mode=", mode);
    TORCH_CHECK(scale.is_contiguous() && mins.is_contiguous() && scale.numel() == NT * NG * kTile &&
                    mins.numel() == scale.numel() && scale.scalar_type() == mins.scalar_type() &&
                    (scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kFloat),
                "packed scales do not match");
    Part p;
    p.data = data;
    p.scale = scale;
    p.mins = mins;
    p.n = n;
    p.G = G;
    p.mode = mode;
    p.col0 = next_col();
    parts_.push_back(std::move(p));
  }

  // w: float32, either (n, in) (BLAS; fastest, not batch invariant) or packed (ceil(n/16), in, 16)
  void add_dense(const at::Tensor& w, int64_t n) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous(), "dense part: contiguous float32");
    Part p;
    p.dense = true;
    p.packed = w.dim() == 3;
    TORCH_CHECK((p.packed && w.size(0) == (n + kTile - 1) / kTile && w.size(1) == in_ && w.size(2) == kTile) ||
                    (!p.packed && w.dim() == 2 && w.size(0) == n && w.size(1) == in_),
                "dense part: (n, in) or packed (ceil(n/16), in, 16)");
    p.w = w;
    p.n = n;
    p.col0 = next_col();
    parts_.push_back(std::move(p));
  }

  void set_bias(const c10::optional<at::Tensor>& b) {
    if (b.has_value()) {
      TORCH_CHECK(b->numel() == out_ && b->scalar_type() == at::kFloat, "bias: (out,) float32");
      bias_ = b->contiguous();
    } else {
      bias_.reset();
    }
  }

  void set_paths(int64_t part, std::vector<int64_t> tops, std::vector<int64_t> paths) {
    TORCH_CHECK(part >= 0 && part < (int64_t)parts_.size() && tops.size() == paths.size() && !tops.empty(), "set_paths");
    for (auto p : paths) TORCH_CHECK(path_supported((int)p), "kernel path ", p, " is not supported by this CPU");
    parts_[part].tops = std::move(tops);
    parts_[part].paths = std::move(paths);
  }

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }

  // out (M, >= out_) rows, written at columns [0, out_); resid may alias out.
  void run(const float* x, int64_t M, int64_t ldx, float* out, int64_t ldo, const float* resid, int64_t ldr) const {
    TORCH_CHECK(next_col() == out_, "linear parts cover ", next_col(), " of ", out_, " outputs");
    std::unique_ptr<ActBuf> act;
    const float* bias = bias_.has_value() ? bias_->data_ptr<float>() : nullptr;
    for (const Part& p : parts_) {
      const float* pb = bias ? bias + p.col0 : nullptr;
      if (p.dense) {
        run_dense(p, x, M, ldx, out, ldo, pb, resid, ldr);
        continue;
      }
      if (!act) act = std::make_unique<ActBuf>(x, M, in_, ldx, p.path_for(M));
      const int64_t NT = (p.n + kTile - 1) / kTile;
      WPack w{p.data.data_ptr<uint8_t>(), p.scale.data_ptr(), p.mins.data_ptr(), p.n, in_, NT, in_ / kBlock,
              in_ / p.G, (int)p.G, (int)p.mode, p.scale.scalar_type() == at::kHalf};
      // run_gemm writes columns [col0, col0 + n) of out; bias is indexed from the part's first column
      run_gemm(act->a, M, w, out, ldo, p.col0, pb, resid, ldr, p.path_for(M));
    }
  }

  at::Tensor forward(const at::Tensor& x, const c10::optional<at::Tensor>& residual) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == in_ && x.scalar_type() == at::kFloat && x.stride(1) == 1,
                "x: (T, in) float32 with contiguous rows");
    const int64_t M = x.size(0);
    if (residual.has_value()) {
      const at::Tensor& r = *residual;
      TORCH_CHECK(r.dim() == 2 && r.size(0) == M && r.size(1) == out_ && r.scalar_type() == at::kFloat && r.stride(1) == 1,
                  "residual: (T, out) float32 with contiguous rows");
      run(x.data_ptr<float>(), M, x.stride(0), r.data_ptr<float>(), r.stride(0), r.data_ptr<float>(), r.stride(0));
      return r;
    }
    auto out = at::empty({M, out_}, x.options());
    run(x.data_ptr<float>(), M, x.stride(0), out.data_ptr<float>(), out_, nullptr, 0);
    return out;
  }

 private:
  int64_t next_col() const { return parts_.empty() ? 0 : parts_.back().col0 + parts_.back().n; }

  void run_dense(const Part& p, const float* x, int64_t M, int64_t ldx, float* out, int64_t ldo, const float* bias,
                 const float* resid, int64_t ldr) const {
    if (p.packed) {
      run_dense_gemm(x, ldx, M, p.w.data_ptr<float>(), p.n, in_, out, ldo, p.col0, bias, resid, ldr, p.path_for(M));
      return;
    }
    auto xt = at::from_blob(const_cast<float*>(x), {M, in_}, {ldx, 1}, at::kFloat);
    at::Tensor y = at::matmul(xt, p.w.t());  // (M, n)
    const float* yp = y.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < p.n; ++j) {
        float v = yp[m * p.n + j];
        if (bias) v = v + bias[j];
        if (resid) v = resid[m * ldr + p.col0 + j] + v;
        out[m * ldo + p.col0 + j] = v;
      }
  }

  int64_t in_, out_;
  std::vector<Part> parts_;
  c10::optional<at::Tensor> bias_;
};

namespace {

// HF "rotate half" rope, in place on `nheads` heads of one token row:
//   x[d] = x[d]*cos[d] - x[d+h]*sin[d];  x[d+h] = x[d+h]*cos[d+h] + x[d]*sin[d+h]
// (the same float operations as models/llama.py apply_rope)
inline void rope_row(float* x, int64_t nheads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < nheads; ++h) {
    float* v = x + h * D;
    for (int64_t d = 0; d < half; ++d) {
      const float a = v[d], b = v[d + half];
      v[d] = a * cos[d] + (-b) * sin[d];
      v[d + half] = b * cos[d + half] + a * sin[d + half];
    }
  }
}

// rope on the q and k heads of each row of qkv (T, (H + 2 Hkv) * D), in place
void rope_qk_rows(float* op, int64_t T, int64_t ld, const int64_t* pos, const float* cp, const float* sp,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  auto body = [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* c = cp + pos[t] * head_dim;
      const float* s = sp + pos[t] * head_dim;
      rope_row(op + t * ld, num_heads, head_dim, c, s);                            // q
      rope_row(op + t * ld + num_heads * head_dim, num_kv_heads, head_dim, c, s);  // k
    }
  };
  // NOTE(small-grains): the row-local steps between two GEMMs (rmsnorm, rope, SiLU, the
  // activations' quantization) run on the pool from two rows on.  Each reads what the
  // GEMM before it wrote from both cores; one thread alone waits on the other core's
  // cache, and the other thread spins meanwhile (a 12-token prefill step spent ~30% of
  // its time with one thread idle, perf, a 2-core Zen 4; the step gained 3-5% with
  // these and the quantization on the pool, docs/kernels.md).
  sluice::parallel_for(0, T, 2, body);
}

void check_rope_args(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1, "qkv: (T, n) float32 rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == qkv.size(0),
              "positions: (T,) int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.size(1) == head_dim && sin.sizes() == cos.sizes() &&
                  sin.is_contiguous(),
              "rope tables: (max_pos, head_dim) float32");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < qkv.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position ", pos[t], " out of range");
}

// rope(q), rope(k) in place on qkv (T, (H + 2 Hkv) * D); returns qkv
at::Tensor rope_qk(at::Tensor qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  check_rope_args(qkv, positions, cos, sin, head_dim);
  TORCH_CHECK(qkv.size(1) >= (num_heads + num_kv_heads) * head_dim, "qkv too narrow for the heads");
  rope_qk_rows(qkv.data_ptr<float>(), qkv.size(0), qkv.stride(0), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
               sin.data_ptr<float>(), num_heads, num_kv_heads, head_dim);
  return qkv;
}

// qkv = rope(qkv_op(rmsnorm(x)))
at::Tensor attn_in(const at::Tensor& x, const at::Tensor& norm_w, double eps, const QLinearOp& qkv,
                   const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: (T, H) float32 contiguous");
  const int64_t T = x.size(0), H = x.size(1);
  auto hs = rms_norm(x, norm_w, eps);
  auto out = at::empty({T, qkv.out_features()}, x.options());
  qkv.run(hs.data_ptr<float>(), T, H, out.data_ptr<float>(), qkv.out_features(), nullptr, 0);
  check_rope_args(out, positions, cos, sin, head_dim);
  rope_qk_rows(out.data_ptr<float>(), T, qkv.out_features(), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
               sin.data_ptr<float>(), num_heads, num_kv_heads, head_dim);
  return out;
}

// x += down(silu(gate) * up), gate|up = gate_up(rmsnorm(x)); in place on x
at::Tensor mlp(at::Tensor x, const at::Tensor& norm_w, double eps, const QLinearOp& gate_up, const QLinearOp& down) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: (T, H) float32 contiguous");
  const int64_t T = x.size(0), H = x.size(1);
  auto hs = rms_norm(x, norm_w, eps);
  auto gu = at::empty({T, gate_up.out_features()}, x.options());
  gate_up.run(hs.data_ptr<float>(), T, H, gu.data_ptr<float>(), gate_up.out_features(), nullptr, 0);
  auto a = silu_mul(gu);
  down.run(a.data_ptr<float>(), T, a.size(1), x.data_ptr<float>(), H, x.data_ptr<float>(), H);
  return x;
}

}  // namespace

void register_qlinear(pybind11::module& m) {
  pybind11::class_<QLinearOp>(m, "QLinearOp")
      .def(pybind11::init<int64_t, int64_t>())
      .def("add_quant", &QLinearOp::add_quant)
      .def("add_dense", &QLinearOp::add_dense)
      .def("set_bias", &QLinearOp::set_bias)
      .def("set_paths", &QLinearOp::set_paths)
      .def("forward", &QLinearOp::forward, pybind11::arg("x"), pybind11::arg("residual") = pybind11::none())
      .def_property_readonly("in_features", &QLinearOp::in_features)
      .def_property_readonly("out_features", &QLinearOp::out_features);
  m.def("attn_in", &attn_in, "rmsnorm -> qkv linear -> rope(q, k), float32");
  m.def("rope_qk", &rope_qk, "rope on the q and k heads of qkv rows, in place, float32");
  m.def("mlp", &mlp, "x += down(silu(gate) * up) of rmsnorm(x), in place, float32");
}

}  // namespace sluice
