// The torch headers of the extension's C++ files: the tensor class, at::parallel_for, the
// dtype dispatch macros, the few ATen ops the host code calls (not <ATen/ATen.h>, every op's
// header) and TORCH_LIBRARY's <torch/library.h>. Parsing them is most of a small file's
// compile time, so on GCC setup.py precompiles this header once and has every file include
// it first (-include); elsewhere, or when the precompiled copy does not match the flags, the
// files' own #include of it parses it as usual. An include guard, not #pragma once: the
// precompiled copy is included under another path.
#ifndef RLX_CPU_TORCH_HEADERS_H
#define RLX_CPU_TORCH_HEADERS_H

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#endif  // RLX_CPU_TORCH_HEADERS_H
