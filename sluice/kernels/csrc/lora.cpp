// LoRA deltas of one fused matrix ("seam") for every adapter group of a step, in one call.
//
//   lora_apply(x, out, starts, ends, seams, isa):
//     for each group g (rows [starts[g], ends[g]) of the flat batch, one adapter):
//       s            = x[rows] @ A_g^T                 shrink  (rows, R_g)
//       out[rows, p] += s[:, cols(p)] @ B_{g,p}^T      expand, one part p per target of the seam
//
// A seam's A stacks its targets' A (q|k|v for qkv); each target's B (already times its
// scaling) is its own part, writing its own output columns: no zero blocks.
//
//   A packed  [ceil(R/16)][K][16]   B_p packed [ceil(n_p/16)][r_p][16]   (pack_fp32's layout)
//
// NOTE(lora-invariance): every output element is acc = fma(x[k], w[k], acc) for k = 0..K-1
// in order, from 0, then out = out + acc, on every ISA path and whatever the rows of the
// step (the same float operations as the batch-invariant float kernel of qgemm.cpp), so a
// request's delta never depends on its batch neighbours.  Compiled without FP contraction.
//
// NOTE(lora-one-call): the point of this file.  Per adapter group and layer the Python path
// costs eight C++ calls (two per seam); with eight adapters in a step that is ~2000 calls, a
// few milliseconds of dispatch per step.  Here a seam is one call for all groups, its work
// items (group x tile x 4 rows) spread over the threads at once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "fp32_tile.h"
#include "build_info.h"
#include "work_pool.h"

namespace {

constexpr int64_t kTile = sluice::fp32_tile::kWidth;
using sluice::fp32_tile::kTiles;  // the float kernel's own tiles (fp32_tile.h): the same bits as the Linear path

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

struct Part {
  at::Tensor w;  // packed [ceil(n/16)][r][16] float32
  int64_t n, r, row0, col0;  // out columns [row0, row0 + n) from shrink columns [col0, col0 + r)
};

}  // namespace

// One adapter's delta on one seam of one layer: its packed A and the parts of its B.
class LoRASeam {
 public:
  LoRASeam(at::Tensor a, int64_t rank, int64_t in_features, int64_t out_features)
      : a_(std::move(a)), R_(rank), K_(in_features), N_(out_features) {
    TORCH_CHECK(a_.scalar_type() == at::kFloat && a_.is_contiguous() && a_.dim() == 3 &&
                    a_.size(0) == (R_ + kTile - 1) / kTile && a_.size(1) == K_ && a_.size(2) == kTile,
                "A: packed (ceil(R/16), K, 16) float32");
  }

  void add_part(at::Tensor w, int64_t n, int64_t r, int64_t row0, int64_t col0) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 3 &&
                    w.size(0) == (n + kTile - 1) / kTile && w.size(1) == r && w.size(2) == kTile,
                "B part: packed (ceil(n/16), r, 16) float32");
    TORCH_CHECK(row0 >= 0 && row0 + n <= N_ && col0 >= 0 && col0 + r <= R_, "B part outside the seam");
    parts_.push_back(Part{std::move(w), n, r, row0, col0});
  }

  int64_t rank() const { return R_; }
  int64_t in_features() const { return K_; }
  int64_t out_features() const { return N_; }
  const at::Tensor& a() const { return a_; }
  const std::vector<Part>& parts() const { return parts_; }

 private:
  at::Tensor a_;
  int64_t R_, K_, N_;
  std::vector<Part> parts_;
};

namespace {

struct Item {
  int32_t g;      // group
  int32_t part;   // -1: shrink; else the B part
  int64_t tile;   // output tile of A or of the part
  int64_t m0;     // first row (absolute), up to 4 rows
  int32_t rows;
};

void run_items(const std::vector<Item>& items, int64_t work, const std::function<void(const Item&)>& fn) {
  // NOTE(lora-grain): a step's deltas are small; below ~64k multiply-adds per thread a
  // parallel region costs more than it saves.
  const int64_t n = static_cast<int64_t>(items.size());
  if (n == 0) return;
  const int64_t per_item = std::max<int64_t>(1, work / n);
  const int64_t grain = std::max<int64_t>(1, 65536 / per_item);
  sluice::parallel_for(0, n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(items[i]);
  });
}

}  // namespace

// out[rows of g] += B_g (A_g x[rows of g]) for every group g, in place.  x: (T, K), out: (T, N)
// float32 rows (any row stride); starts/ends: the groups' rows; isa: 0 scalar, 1 avx2, 2 avx512,
// -1 the best this CPU has.
void lora_apply(const at::Tensor& x, at::Tensor out, const std::vector<int64_t>& starts,
                const std::vector<int64_t>& ends, const std::vector<LoRASeam*>& seams, int64_t isa) {
  const int64_t G = static_cast<int64_t>(seams.size());
  TORCH_CHECK(static_cast<int64_t>(starts.size()) == G && static_cast<int64_t>(ends.size()) == G, "one row range per seam");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, "x: (T, K) float32 rows");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 && out.size(0) == x.size(0),
              "out: (T, N) float32 rows");
  if (G == 0) return;
  static const int cpu_isa = best_isa();
  const int use = isa < 0 ? cpu_isa : static_cast<int>(std::min<int64_t>(isa, cpu_isa));
  const int64_t T = x.size(0), ldx = x.stride(0), ldo = out.stride(0);
  int64_t rmax = 0;
  for (int64_t g = 0; g < G; ++g) {
    const LoRASeam* s = seams[g];
    TORCH_CHECK(s != nullptr && s->in_features() == x.size(1) && s->out_features() == out.size(1), "seam shape");
    TORCH_CHECK(0 <= starts[g] && starts[g] <= ends[g] && ends[g] <= T, "group rows out of range");
    rmax = std::max(rmax, s->rank());
  }
  // shrink results, in whole tiles (the pad columns are computed and never read)
  const int64_t ldt = ((rmax + kTile - 1) / kTile) * kTile;
  auto tmp = at::empty({T, ldt}, x.options());
  float* tp = tmp.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t K = x.size(1);

  std::vector<Item> items;
  int64_t work = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t nt = (seams[g]->rank() + kTile - 1) / kTile;
    for (int64_t m0 = starts[g]; m0 < ends[g]; m0 += 4)
      for (int64_t t = 0; t < nt; ++t)
        items.push_back(Item{(int32_t)g, -1, t, m0, (int32_t)std::min<int64_t>(4, ends[g] - m0)});
    work += (ends[g] - starts[g]) * nt * kTile * K;
  }
  run_items(items, work, [&](const Item& it) {
    alignas(64) float res[4 * kTile];
    const LoRASeam* s = seams[it.g];
    kTiles[use][it.rows - 1](xp + it.m0 * ldx, ldx, s->a().data_ptr<float>() + it.tile * K * kTile, K, res);
    for (int r = 0; r < it.rows; ++r) std::copy(res + r * kTile, res + (r + 1) * kTile, tp + (it.m0 + r) * ldt + it.tile * kTile);
  });

  items.clear();
  work = 0;
  for (int64_t g = 0; g < G; ++g) {
    const auto& parts = seams[g]->parts();
    for (int32_t p = 0; p < (int32_t)parts.size(); ++p) {
      const int64_t nt = (parts[p].n + kTile - 1) / kTile;
      for (int64_t m0 = starts[g]; m0 < ends[g]; m0 += 4)
        for (int64_t t = 0; t < nt; ++t)
          items.push_back(Item{(int32_t)g, p, t, m0, (int32_t)std::min<int64_t>(4, ends[g] - m0)});
      work += (ends[g] - starts[g]) * nt * kTile * parts[p].r;
    }
  }
  run_items(items, work, [&](const Item& it) {
    alignas(64) float res[4 * kTile];
    const Part& part = seams[it.g]->parts()[it.part];
    kTiles[use][it.rows - 1](tp + it.m0 * ldt + part.col0, ldt, part.w.data_ptr<float>() + it.tile * part.r * kTile,
                             part.r, res);
    const int64_t lanes = std::min<int64_t>(kTile, part.n - it.tile * kTile);
    for (int r = 0; r < it.rows; ++r) {
      float* orow = op + (it.m0 + r) * ldo + part.row0 + it.tile * kTile;
      for (int64_t l = 0; l < lanes; ++l) orow[l] = orow[l] + res[r * kTile + l];
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LoRASeam>(m, "LoRASeam")
      .def(pybind11::init<at::Tensor, int64_t, int64_t, int64_t>())
      .def("add_part", &LoRASeam::add_part)
      .def_property_readonly("rank", &LoRASeam::rank)
      .def_property_readonly("in_features", &LoRASeam::in_features)
      .def_property_readonly("out_features", &LoRASeam::out_features);
  SLUICE_BIND_WORK_POOL(m);
  SLUICE_BIND_SOURCE_HASH(m);
  m.def("lora_apply", &lora_apply, "out[rows of g] += B_g (A_g x[rows of g]) for every adapter group, in place",
        pybind11::arg("x"), pybind11::arg("out"), pybind11::arg("starts"), pybind11::arg("ends"), pybind11::arg("seams"),
        pybind11::arg("isa") = -1);
}
