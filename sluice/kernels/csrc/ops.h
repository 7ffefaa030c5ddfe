// Fused small ops of the decoder layer (norms, activation, rotary), CPU, float32.
#pragma once

#include <torch/extension.h>

namespace sluice {
// y = w * (x * 1/sqrt(mean(x^2) + eps)) per row of x (T, H), float32
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
// silu(gu[:, :I]) * gu[:, I:] for gu (T, 2I), float32
torch::Tensor silu_mul(const torch::Tensor& gu);
// the first index of each row's maximum (a NaN counts as the maximum), float32 (N, V) -> int64 (N,)
torch::Tensor argmax_rows(const torch::Tensor& x);

void register_ops(pybind11::module& m);
void register_qlinear(pybind11::module& m);
void register_moe(pybind11::module& m);
}  // namespace sluice
