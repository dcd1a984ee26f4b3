// The part of ATen the kernel files use (tensors, their factories and the few ops called),
// without <torch/extension.h>: that header parses the whole C++ frontend and pybind11, about
// four fifths of a kernel file's compile time. Only decode_attention.cpp (the Python bindings)
// includes it. `torch::` names the same functions here as there (torch/types.h does the same
// `using namespace at`).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/topk.h>

namespace torch {
using namespace at;  // NOLINT: torch::Tensor, torch::empty, torch::kFloat, as in torch/types.h
// torch/types.h's dtype names.
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
}  // namespace torch
