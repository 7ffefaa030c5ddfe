// Fused small ops of the decoder layer, float32 on the CPU.
//
// At batch 1 a step is ~30 layers x a dozen small tensor ops; each torch op
// costs microseconds of dispatch and allocation.  These fuse the elementwise
// chains into one pass.  Each row is reduced by one thread in a fixed order,
// so results do not depend on the batch (batch invariance).
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include "work_pool.h"

namespace sluice {
namespace {

#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

// y = w * (x * rsqrt(mean(x^2) + eps)), per row
CLONES void rms_rows(const float* x, int64_t ldx, const float* w, float* y, int64_t ldy, int64_t b, int64_t e,
                     int64_t H, float eps) {
  for (int64_t t = b; t < e; ++t) {
    const float* xr = x + t * ldx;
    // 8 partial sums in a fixed order (vectorisable without reassociation)
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= H; i += 8)
      for (int j = 0; j < 8; ++j) part[j] += xr[i + j] * xr[i + j];
    for (; i < H; ++i) part[0] += xr[i] * xr[i];
    const float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    const float r = 1.f / std::sqrt(ss / (float)H + eps);
    float* yr = y + t * ldy;
    for (int64_t k = 0; k < H; ++k) yr[k] = w[k] * (xr[k] * r);
  }
}

// exp(x) for float32, |relative error| < 2e-7, written with plain IEEE operations
// (floor, mul, add, an exponent built from bits) so that GCC vectorises it in
// every clone and every lane computes exactly what the scalar tail computes.
static inline __attribute__((always_inline)) float exp_f32(float x) {
  x = std::max(x, -87.f);
  x = std::min(x, 88.f);
  const float t = x * 1.44269504088896341f;  // log2(e)
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest: adding 1.5 * 2^23 drops the fraction
  const float f = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // x - n ln2, two-part ln2
  // e^f on [-ln2/2, ln2/2]: Taylor to degree 7 (error < 1e-7 there)
  float p = 1.9841270e-4f;
  p = p * f + 1.3888889e-3f;
  p = p * f + 8.3333333e-3f;
  p = p * f + 4.1666667e-2f;
  p = p * f + 1.6666667e-1f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// out = silu(g) * u, g = gu[:, :I], u = gu[:, I:]
CLONES void silu_mul_rows(const float* gu, int64_t ld, float* y, int64_t ldy, int64_t b, int64_t e, int64_t I) {
  for (int64_t t = b; t < e; ++t) {
    const float* g = gu + t * ld;
    const float* u = g + I;
    float* yr = y + t * ldy;
    for (int64_t k = 0; k < I; ++k) yr[k] = g[k] / (1.f + exp_f32(-g[k])) * u[k];
  }
}

// NOTE(argmax-rows): the first index of each row's maximum, as torch's argmax
// gives it (a NaN counts as the maximum: its first index).  Sixteen lanes each
// keep their own running maximum and the first index that reached it (strictly
// greater replaces), then the lanes are merged by value, ties to the lower
// index, which is the row's first maximal index.  torch's max(dim) ran one
// thread over a 64-row step's 64 x 49k logits (~2.3 ms of the step).
CLONES void argmax_row_span(const float* x, int64_t ld, int64_t V, int64_t* out, int64_t b, int64_t e) {
  typedef float vf __attribute__((vector_size(64)));
  typedef int32_t vi __attribute__((vector_size(64)));
  for (int64_t t = b; t < e; ++t) {
    const float* r = x + t * ld;
    int64_t best = 0;
    float bv = r[0];
    int64_t i = 0;
    if (V >= 16) {
      vf m;
      std::memcpy(&m, r, sizeof m);
      vi idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
      vi cur = idx;
      vi nan = idx - idx;
      const vi step = nan + 16;
      for (i = 16; i + 16 <= V; i += 16) {
        vf v;
        std::memcpy(&v, r + i, sizeof v);
        cur += step;
        const vi gt = v > m;
        idx = gt ? cur : idx;
        m = gt ? v : m;
        nan |= v != v;
      }
      bool any_nan = false;
      for (int l = 0; l < 16; ++l) any_nan |= nan[l] != 0 || m[l] != m[l];
      if (any_nan) {
        for (int64_t k = 0; k < V; ++k)
          if (r[k] != r[k]) {
            best = k;
            break;
          }
        out[t] = best;
        continue;
      }
      best = idx[0];
      bv = m[0];
      for (int l = 1; l < 16; ++l)
        if (m[l] > bv || (m[l] == bv && idx[l] < best)) {
          bv = m[l];
          best = idx[l];
        }
    } else {
      i = 1;
    }
    for (; i < V; ++i) {  // the tail (after the vector part, every index here is later)
      if (r[i] != r[i]) {
        if (bv == bv) {
          best = i;
          bv = r[i];
        }
        break;
      }
      if (r[i] > bv) {
        bv = r[i];
        best = i;
      }
    }
    if (bv != bv) {  // r[0] or a tail value was NaN: the first NaN wins
      for (int64_t k = 0; k < V; ++k)
        if (r[k] != r[k]) {
          best = k;
          break;
        }
    }
    out[t] = best;
  }
}

}  // namespace

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: x (N, V) float32 with V > 0");
  const int64_t N = x.size(0), V = x.size(1);
  auto out = torch::empty({N}, x.options().dtype(torch::kLong));
  sluice::parallel_for(0, N, 1, [&](int64_t b, int64_t e) {
    argmax_row_span(x.data_ptr<float>(), x.stride(0), V, out.data_ptr<int64_t>(), b, e);
  });
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "rms_norm: x (T, H) float32");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "rms_norm: weight (H,)");
  const int64_t T = x.size(0), H = x.size(1);
  auto y = torch::empty({T, H}, x.options());
  sluice::parallel_for(0, T, 2, [&](int64_t b, int64_t e) {  // NOTE(small-grains) in qlinear_op.cpp
    rms_rows(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), y.data_ptr<float>(), H, b, e, H, (float)eps);
  });
  return y;
}

torch::Tensor silu_mul(const torch::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat && gu.stride(1) == 1 && gu.size(1) % 2 == 0,
              "silu_mul: (T, 2I) float32");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({T, I}, gu.options());
  sluice::parallel_for(0, T, 2, [&](int64_t b, int64_t e) {
    silu_mul_rows(gu.data_ptr<float>(), gu.stride(0), y.data_ptr<float>(), I, b, e, I);
  });
  return y;
}

void register_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32)");
  m.def("silu_mul", &silu_mul, "silu(gu[:, :I]) * gu[:, I:] (float32)");
  m.def("argmax_rows", &argmax_rows, "the first index of each row's maximum (float32 (N, V) -> int64 (N,))");
}

}  // namespace sluice
