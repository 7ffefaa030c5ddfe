// Python bindings and drivers of the quantized kernels (layout and arithmetic: qgemm.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ops.h"
#include "qgemm.h"
#include "build_info.h"
#include "work_pool.h"

namespace {

using sluice::ActQ;
using sluice::WPack;

std::vector<std::string> cpu_features() {
  std::vector<std::string> f;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f.push_back("avx2");
  if (__builtin_cpu_supports("avxvnni")) f.push_back("avxvnni");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    f.push_back("avx512");
  if (__builtin_cpu_supports("avx512vnni")) f.push_back("avx512vnni");
  if (__builtin_cpu_supports("avx512bf16")) f.push_back("avx512bf16");
  if (sluice::amx_ready()) f.push_back("amx");  // AMX-INT8 with the tile state granted
  return f;
}

void check_path(int64_t path) {
  TORCH_CHECK(sluice::path_supported((int)path), "kernel path ", path, " is not supported by this CPU");
}

// (q int8 (M,K), dx (M,K/32), dxs (M,K/32), dxs16 (M,K/16), xs int32 (M,K/32), xs16 int32 (M,K/16))
// path: the kernel path whose instructions quantize (act_quant_isa: scalar, AVX2 for the ymm
// paths, AVX-512 for the zmm and AMX ones, capped by this CPU; every one gives the same bits)
std::vector<torch::Tensor> quantize_act(const torch::Tensor& x, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "x: (M, K) float32, rows contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % sluice::kBlock == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(path >= sluice::kScalar && path <= sluice::kAmx, "kernel path ", path, " does not exist");
  const int64_t KB = K / sluice::kBlock;
  auto fopt = torch::TensorOptions().dtype(torch::kFloat);
  auto iopt = torch::TensorOptions().dtype(torch::kInt);
  auto q = torch::empty({M, K}, torch::TensorOptions().dtype(torch::kChar));
  auto dx = torch::empty({M, KB}, fopt), dxs = torch::empty({M, KB}, fopt), dxs16 = torch::empty({M, 2 * KB}, fopt);
  auto xs = torch::empty({M, KB}, iopt), xs16 = torch::empty({M, 2 * KB}, iopt);
  sluice::quantize_rows_parallel(x.data_ptr<float>(), M, K, x.stride(0), q.data_ptr<int8_t>(), dx.data_ptr<float>(),
                                 dxs.data_ptr<float>(), dxs16.data_ptr<float>(), xs.data_ptr<int32_t>(),
                                 xs16.data_ptr<int32_t>(), sluice::act_quant_isa((int)path));
  return {q, dx, dxs, dxs16, xs, xs16};
}

// out[m, col0 + n] = (residual[m, col0 + n] +) (bias[n] +) sum_k x[m, k] w[n, k]
// act: the 6 tensors of quantize_act; weight: (data, scale, mins).
void qgemm(const std::vector<torch::Tensor>& act, const std::vector<torch::Tensor>& weight, int64_t N, int64_t G,
           int64_t mode, torch::Tensor& out, int64_t col0, const c10::optional<torch::Tensor>& bias,
           const c10::optional<torch::Tensor>& residual, int64_t path) {
  TORCH_CHECK(act.size() == 6 && weight.size() == 3, "qgemm: act has 6 tensors, weight 3");
  check_path(path);
  const auto& q = act[0];
  const int64_t M = q.size(0), K = q.size(1);
  const int64_t NT = (N + sluice::kTile - 1) / sluice::kTile, KB = K / sluice::kBlock, NG = K / G;
  const auto& data = weight[0];
  TORCH_CHECK(data.scalar_type() == torch::kByte && data.numel() == NT * KB * sluice::block_bytes((int)mode),
              "qgemm: packed data does not match N=", N, " K=", K, " mode=", mode);
  TORCH_CHECK(weight[1].numel() == NT * NG * sluice::kTile && weight[2].numel() == weight[1].numel(), "qgemm: scales");
  const bool f16 = weight[1].scalar_type() == torch::kHalf;
  TORCH_CHECK(f16 || weight[1].scalar_type() == torch::kFloat, "qgemm: scales are float16 or float32");
  TORCH_CHECK(out.scalar_type() == torch::kFloat && out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 &&
                  out.size(1) >= col0 + N,
              "qgemm: out must be float32 (M, >= col0 + N) with contiguous rows");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N && bias->is_contiguous(), "qgemm: bias");
    bp = bias->data_ptr<float>();
  }
  const float* rp = nullptr;
  int64_t ldr = 0;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == torch::kFloat && residual->size(0) == M && residual->stride(1) == 1 &&
                    residual->size(1) >= col0 + N,
                "qgemm: residual");
    rp = residual->data_ptr<float>();
    ldr = residual->stride(0);
  }
  ActQ a{q.data_ptr<int8_t>(),       act[1].data_ptr<float>(),   act[2].data_ptr<float>(), act[3].data_ptr<float>(),
         act[4].data_ptr<int32_t>(), act[5].data_ptr<int32_t>(), K};
  WPack w{data.data_ptr<uint8_t>(), weight[1].data_ptr(), weight[2].data_ptr(), N, K, NT, KB, NG, (int)G, (int)mode,
          f16};
  sluice::run_gemm(a, M, w, out.data_ptr<float>(), out.stride(0), col0, bp, rp, ldr, (int)path);
}

// rows `ids` of the packed weight, dequantized: d * (q - z) + m, exactly as the canonical form
torch::Tensor dequant_rows(const std::vector<torch::Tensor>& weight, int64_t N, int64_t K, int64_t G, int64_t mode,
                           int64_t z, const torch::Tensor& ids) {
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "ids: int64 vector");
  const int64_t NT = (N + 15) / 16, KB = K / 32, NG = K / G, bb = sluice::block_bytes((int)mode);
  const bool f16 = weight[1].scalar_type() == torch::kHalf;
  WPack w{weight[0].data_ptr<uint8_t>(), weight[1].data_ptr(), weight[2].data_ptr(), N, K, NT, KB, NG, (int)G,
          (int)mode, f16};
  auto out = torch::empty({ids.size(0), K}, torch::TensorOptions().dtype(torch::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < ids.size(0); ++i) {
    const int64_t n = ip[i];
    TORCH_CHECK(n >= 0 && n < N, "row id ", n, " out of range [0, ", N, ")");
    const int64_t tile = n / 16, l = n % 16;
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* wp = w.data + (tile * KB + kb) * bb;
      for (int k = 0; k < 32; ++k) {
        int32_t u;
        if (mode == sluice::kW4) {
          const int c = k / 8, j = k % 8;
          const uint8_t b = wp[c * 64 + l * 4 + (j & 3)];
          u = j < 4 ? (b & 0x0f) : (b >> 4);
        } else {
          u = wp[(k / 4) * 64 + l * 4 + (k % 4)];
        }
        const int64_t g = (kb * 32 + k) / G, si = (tile * NG + g) * 16 + l;
        const float d = f16 ? (float)static_cast<const c10::Half*>(w.scale)[si] : static_cast<const float*>(w.scale)[si];
        const float mn = f16 ? (float)static_cast<const c10::Half*>(w.mins)[si] : static_cast<const float*>(w.mins)[si];
        // z != 0: the canonical m is 0 and mins hold -d*z; z == 0: mins hold m
        op[i * K + kb * 32 + k] = z ? d * (float)(u - z) : d * (float)u + mn;
      }
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  SLUICE_BIND_WORK_POOL(m);
  SLUICE_BIND_SOURCE_HASH(m);
  m.def("cpu_features", &cpu_features, "ISA features this build can use on this CPU");
  m.def("quantize_act", &quantize_act, "int8 per-32 activation quantization (6 tensors)");
  m.def("qgemm", &qgemm, "quantized GEMM into out[:, col0:col0+N]");
  m.def("dequant_rows", &dequant_rows, "dequantize rows of a packed weight (embedding lookup)");
  sluice::register_ops(m);
  sluice::register_qlinear(m);
  sluice::register_moe(m);
}
