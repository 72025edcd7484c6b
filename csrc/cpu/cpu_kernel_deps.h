// Every header from outside csrc/cpu (torch, the standard library, rlx/) and every csrc/cpu
// header with code for all copies alike (huge_pages.h, scratch.h) that a kernel file uses:
// a kernel file includes this before its ISA region (cpu_isa.h), so that none of their
// inline functions is compiled with the region's target. (The op family's header of entry
// points and host helpers, *_kernels.h, follows it in each kernel file, also before the
// region: a change to one family's header then rebuilds only that family's files.)
#pragma once

// The tensor class, at::parallel_for, the dispatch macros, the ATen ops the host code calls
// and <torch/library.h> (precompiled on GCC: setup.py).
#include "torch_headers.h"

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
