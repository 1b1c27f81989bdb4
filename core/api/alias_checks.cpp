// api/alias_checks.cpp - output / input memory overlap checks shared by the entry points.
#include "alias_checks.h"

#include <utility>

namespace nvte::api {
namespace {

// [begin, end) of one buffer's bytes; begin == end when it has no memory or no elements.
std::pair<const char *, const char *> byte_range(const NVTEBasicTensor &x) {
  const auto *p = static_cast<const char *>(x.data_ptr);
  if (p == nullptr) return {p, p};
  const size_t n = numel(x.shape);
  const size_t bytes = x.dtype == kNVTEFloat4E2M1 ? (n + 1) / 2 : n * dtype_size(x.dtype);
  return {p, p + bytes};
}

bool ranges_meet(const NVTEBasicTensor &a, const NVTEBasicTensor &b) {
  const auto [a0, a1] = byte_range(a);
  const auto [b0, b1] = byte_range(b);
  return a0 != a1 && b0 != b1 && a0 < b1 && b0 < a1;
}

const char *layout_name(int p) { return p == kNVTERowwiseData ? "rowwise data" : "columnwise data"; }

constexpr int kLayouts[2] = {kNVTERowwiseData, kNVTEColumnwiseData};

}  // namespace

bool same_buffer(const Tensor &a, const Tensor &b) {
  const NVTEBasicTensor &x = a.params[kNVTERowwiseData], &y = b.params[kNVTERowwiseData];
  return x.data_ptr != nullptr && x.data_ptr == y.data_ptr && numel(x.shape) != 0;
}

bool bytes_overlap(const Tensor &a, const Tensor &b) {
  return ranges_meet(a.params[kNVTERowwiseData], b.params[kNVTERowwiseData]);
}

void check_alias(const Tensor &out, const char *out_name, const Tensor &in, const char *in_name) {
  const NVTEBasicTensor &o = out.params[kNVTERowwiseData], &i = in.params[kNVTERowwiseData];
  if (same_buffer(out, in)) {
    NVTE_CHECK(o.dtype == i.dtype, out_name, " shares its buffer with ", in_name, " but has dtype ",
               dtype_name(o.dtype), " instead of ", dtype_name(i.dtype));
    NVTE_CHECK(numel(o.shape) == numel(i.shape), out_name, " shares its buffer with ", in_name, " but holds ",
               numel(o.shape), " elements instead of ", numel(i.shape),
               ": rows would be read after another row's result overwrote them");
  } else {
    // (in place: row by row, each row read before it is written)
    NVTE_CHECK(!ranges_meet(o, i), out_name, " overlaps ", in_name,
               " without being the same buffer: rows would be read after another row's result overwrote them");
  }
  // A transposed layout never lines up with the other tensor's elements.
  for (int po : kLayouts)
    for (int pi : kLayouts)
      if (po != kNVTERowwiseData || pi != kNVTERowwiseData)
        NVTE_CHECK(!ranges_meet(out.params[po], in.params[pi]), out_name, " ", layout_name(po), " overlaps ", in_name,
                   " ", layout_name(pi), ": a transposed layout cannot be written over its source");
}

bool any_overlap(const Tensor &a, const Tensor &b) {
  for (int pa : kLayouts)
    for (int pb : kLayouts)
      if (ranges_meet(a.params[pa], b.params[pb])) return true;
  return false;
}

void check_disjoint(const Tensor &out, const char *out_name, const Tensor &other, const char *other_name,
                    const char *why) {
  for (int po : kLayouts)
    for (int pi : kLayouts)
      NVTE_CHECK(!ranges_meet(out.params[po], other.params[pi]), out_name, " ", layout_name(po), " overlaps ",
                 other_name, " ", layout_name(pi), ": ",
                 why ? why : "this operation cannot write that output over memory it also uses");
}

}  // namespace nvte::api
