// Fused small ops of the decoder layer (norms, activation, rotary), CPU, float32.
#pragma once

#include <torch/extension.h>

namespace sluice {
void register_ops(pybind11::module& m);
}
