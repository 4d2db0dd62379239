// The part of torch a kernel uses: tensors, the factory ops it calls, dtype dispatch, at::parallel_for and
// pybind11's tensor casters. <torch/extension.h> (every ATen op and torch's whole C++ API) took 33 s of a kernel's
// ~40 s compile to parse, these 12 (g++ -O3, AMD EPYC Zen 3): the install compiles 8 kernels on 2 cores in ~70 s.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

namespace torch {
using namespace at;  // NOLINT: torch::Tensor, torch::empty, ... as <torch/types.h> spells them
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}  // namespace torch
