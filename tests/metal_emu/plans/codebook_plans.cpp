// extern "C" wrappers of rlx/mps_codebook_plan.h for the emulator tests.
// Shape arguments (11): rows, in_features, out_features, groups, num_codebooks, num_entries,
// entry_dim, has_scales, has_bias, dtype (0 f32, 1 f16, 2 bf16), index_bytes (1 or 2); some
// functions take more.
// Each takes one more, optional, last argument: the pipelines' maxTotalThreadsPerThreadgroup.
#include "rlx/mps_codebook_plan.h"
#include "rlx_emu_plan.h"

using namespace rlx::mps;

namespace {
// n may be want + 1: the last argument is then max_threads.
bool read_shape(const int64_t* a, int n, int want, CodebookShape* s, uint32_t* max_threads) {
  if ((n != want && n != want + 1) || a[9] < 0 || a[9] > 2 || (a[10] != 1 && a[10] != 2))
    return false;
  *max_threads = n == want + 1 ? uint32_t(a[want]) : kMaxThreadsPerThreadgroup;
  s->rows = a[0];
  s->in_features = a[1];
  s->out_features = a[2];
  s->groups = a[3];
  s->num_codebooks = a[4];
  s->num_entries = a[5];
  s->entry_dim = a[6];
  s->has_scales = a[7] != 0;
  s->has_bias = a[8] != 0;
  s->dtype = CodebookDtype(a[9]);
  s->index_bytes = a[10];
  return codebook_shape_fits(*s);
}
}  // namespace

extern "C" int plan_codebook_forward(const int64_t* a, int n, rlx_emu_plan* out) {
  CodebookShape s;
  uint32_t mt;
  if (!read_shape(a, n, 12, &s, &mt)) return 1;
  const CodebookPlan p = plan_codebook_forward(s, a[11] != 0, mt);
  rlx_emu_fill(out, p.launch, p.params);
  return 0;
}

extern "C" int plan_codebook_dx(const int64_t* a, int n, rlx_emu_plan* out) {
  CodebookShape s;
  uint32_t mt;
  if (!read_shape(a, n, 11, &s, &mt)) return 1;
  const CodebookPlan p = plan_codebook_dx(s, mt);
  rlx_emu_fill(out, p.launch, p.params);
  return 0;
}

extern "C" int plan_codebook_dcodebook_partial(const int64_t* a, int n, rlx_emu_plan* out) {
  CodebookShape s;
  uint32_t mt;
  if (!read_shape(a, n, 11, &s, &mt)) return 1;
  const CodebookPlan p = plan_codebook_dcodebook_partial(s);
  rlx_emu_fill(out, p.launch, p.params);
  return 0;
}

extern "C" int64_t codebook_partials(const int64_t* a, int n) {
  CodebookShape s;
  uint32_t mt;
  if (!read_shape(a, n, 11, &s, &mt)) return -1;
  return int64_t(codebook_partials_count(plan_codebook_dcodebook_partial(s)));
}

extern "C" int plan_codebook_dcodebook_reduce(const int64_t* a, int n, rlx_emu_plan* out) {
  CodebookShape s;
  uint32_t mt;
  if (!read_shape(a, n, 11, &s, &mt)) return 1;
  const CodebookPlan p =
      plan_codebook_dcodebook_reduce(plan_codebook_dcodebook_partial(s), s.dtype, mt);
  rlx_emu_fill(out, p.launch, p.params);
  return 0;
}

extern "C" int plan_codebook_dscale_dbias(const int64_t* a, int n, rlx_emu_plan* out) {
  CodebookShape s;
  uint32_t mt;
  if (!read_shape(a, n, 13, &s, &mt)) return 1;
  const CodebookPlan p = plan_codebook_dscale_dbias(s, a[11] != 0, a[12] != 0, mt);
  rlx_emu_fill(out, p.launch, p.params);
  return 0;
}

extern "C" int plan_codebook_dcodebook_sorted(const int64_t* a, int n, rlx_emu_plan* out) {
  CodebookShape s;
  uint32_t mt;
  if (!read_shape(a, n, 11, &s, &mt)) return 1;
  const CodebookSortedPlan p = plan_codebook_dcodebook_sorted(s, mt);
  rlx_emu_fill(out, p.launch, p.params);
  return 0;
}
