// cpu/fused_rope.cpp - CPU reference of RoPE: one output row (h x d elements) at a time, pair by
// pair (core/common/rope.h's rule), angles and products in float64, rounded once to the output
// dtype; rows run in parallel.
#include "fused_rope.h"

#include <cmath>
#include <cstdint>

#include "../common/dtype_switch.h"
#include "parallel.h"

namespace nvte::cpu {

void fused_rope(const rope::RopeParams &p, const Tensor &x, const Tensor *cu_seqlens, const Tensor &freqs,
                const Tensor *start, Tensor &y) {
  const float *f = static_cast<const float *>(freqs.params[kNVTERowwiseData].data_ptr);
  const int32_t *st = start ? static_cast<const int32_t *>(start->params[kNVTERowwiseData].data_ptr) : nullptr;
  const int32_t *cu = p.thd ? static_cast<const int32_t *>(cu_seqlens->params[kNVTERowwiseData].data_ptr) : nullptr;
  if (p.thd) {  // cu_seqlens: the whole sequences' offsets (context parallelism: this rank holds 1 / cp_size)
    NVTE_CHECK(cu[0] >= 0, "cu_seqlens[0] = ", cu[0], " is negative");
    for (int64_t i = 0; i < p.b; ++i) {
      NVTE_CHECK(cu[i + 1] >= cu[i] && cu[i + 1] <= p.rows * p.cp_size, "cu_seqlens must be non-decreasing within "
                 "[0, t * cp_size = ", p.rows * p.cp_size, "]; cu_seqlens[", i, "] = ", cu[i], ", cu_seqlens[", i + 1,
                 "] = ", cu[i + 1]);
      NVTE_CHECK(p.cp_size == 1 || (cu[i] % p.cp_size == 0 && (cu[i + 1] - cu[i]) % (2 * p.cp_size) == 0),
                 "with context parallelism (cp_size ", p.cp_size, ") cu_seqlens must be multiples of cp_size and "
                 "every length a multiple of 2 cp_size (pad the sequences); sequence ", i, " spans [", cu[i], ", ",
                 cu[i + 1], ")");
    }
  }
  auto position = [&](int64_t r, int64_t &seq) {  // -1: a THD row of no sequence
    int64_t pos;
    rope::row_position(p, cu, r, seq, pos);  // (cu_seqlens checked above: always splittable)
    if (seq < 0) return (int64_t)-1;
    return pos + (st ? st[seq] : 0);
  };
  for (int64_t r = 0; r < p.rows; ++r) {  // (positions checked first: errors before any write)
    int64_t seq;
    const int64_t pos = position(r, seq);
    NVTE_CHECK(seq < 0 || (pos >= 0 && pos < p.freq_rows), "row ", r, " is at position ", pos,
               " but freqs has ", p.freq_rows, " rows (positions 0..", p.freq_rows - 1, ")");
  }
  with_float_dtype(logical_dtype(x), "input", [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T *src = static_cast<const T *>(x.params[kNVTERowwiseData].data_ptr);
    T *dst = static_cast<T *>(y.params[kNVTERowwiseData].data_ptr);
    parallel_for((size_t)p.rows, 16, [&](size_t r0, size_t r1) {
      for (int64_t r = (int64_t)r0; r < (int64_t)r1; ++r) {
        int64_t seq;
        const int64_t pos = position(r, seq);
        const float *a = seq < 0 ? nullptr : f + pos * p.d2;
        for (int64_t hh = 0; hh < p.h; ++hh) {
          T *out = dst + (r * p.h + hh) * p.d;
          auto in = [&](int64_t k) { return (double)to_f32(src[rope::src_offset(p, r, hh, k)]); };
          for (int64_t k = a ? p.d2 : 0; k < p.d; ++k) out[k] = from_f32<T>((float)in(k));  // copied channels
          if (!a) continue;
          for (int64_t j = 0; j < p.d2 / 2; ++j) {  // the pairs (k, q)
            const int64_t k = p.interleaved ? 2 * j : j, q = rope::pair_of(p, k);
            double ok, oq;
            rope::rotate_pair<double>(p.backward, in(k), in(q), std::cos((double)a[k]), std::sin((double)a[k]),
                                      std::cos((double)a[q]), std::sin((double)a[q]), ok, oq);
            out[k] = from_f32<T>((float)ok);
            out[q] = from_f32<T>((float)oq);
          }
        }
      }
    });
  });
}

}  // namespace nvte::cpu
