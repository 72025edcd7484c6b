// Every header from outside csrc/cpu (torch, the standard library, rlx/) and every csrc/cpu
// header with code for all copies alike (huge_pages.h, scratch.h) that a kernel file uses:
// a kernel file includes this before its ISA region (cpu_isa.h), so that none of their
// inline functions is compiled with the region's target.
#pragma once

// The tensor class and the few ATen ops the kernels call, not <ATen/ATen.h> (every op's
// header: most of a kernel file's compile time). TORCH_LIBRARY_IMPL's <torch/library.h>:
// in the baseline copy only (cpu_isa.h), which registers the ops.
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
#if !defined(RLX_ISA_AVX2_COPY)
#include <torch/library.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "rlx/acc_type.h"
#include "rlx/codebook.h"
#include "rlx/gdn_backward_layout.h"
#include "rlx/gdn_checks.h"

#include "cpu_isa.h"
#include "huge_pages.h"
#include "scratch.h"
