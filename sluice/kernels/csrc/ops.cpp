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

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "rms_norm: x (T, H) float32");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "rms_norm: weight (H,)");
  const int64_t T = x.size(0), H = x.size(1);
  auto y = torch::empty({T, H}, x.options());
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
    rms_rows(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), y.data_ptr<float>(), H, b, e, H, (float)eps);
  });
  return y;
}

torch::Tensor silu_mul(const torch::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == torch::kFloat && gu.stride(1) == 1 && gu.size(1) % 2 == 0,
              "silu_mul: (T, 2I) float32");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto y = torch::empty({T, I}, gu.options());
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t e) {
    silu_mul_rows(gu.data_ptr<float>(), gu.stride(0), y.data_ptr<float>(), I, b, e, I);
  });
  return y;
}

void register_ops(pybind11::module& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32)");
  m.def("silu_mul", &silu_mul, "silu(gu[:, :I]) * gu[:, I:] (float32)");
}

}  // namespace sluice
