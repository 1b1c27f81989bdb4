// cpu/attn_merge.cpp - CPU reference of the softmax-statistics merge: for each (token, head) the
// two terms' weights in double precision (attn_merge::merge_weights), then the row of out.
#include "attn_merge.h"

#include <cmath>

#include "../common/dtype_switch.h"

namespace nvte::cpu {

void attn_merge(const attn_merge::Geometry &g, Tensor &out, Tensor &lse, const Tensor *out_part,
                const Tensor &lse_part) {
  float *o = static_cast<float *>(out.params[kNVTERowwiseData].data_ptr);
  float *l = static_cast<float *>(lse.params[kNVTERowwiseData].data_ptr);
  const float *pl = static_cast<const float *>(lse_part.params[kNVTERowwiseData].data_ptr);
  const NVTEDType pd = out_part ? logical_dtype(*out_part) : kNVTEFloat32;
  with_float_dtype(pd, "out_part", [&](auto tag) {
    using P = typename decltype(tag)::type;
    const P *p = out_part ? static_cast<const P *>(out_part->params[kNVTERowwiseData].data_ptr) : nullptr;
    const int64_t hd = g.heads * g.dim;
    for (int64_t n = 0; n < g.batch; ++n)
      for (int64_t j = 0; j < g.part_rows; ++j) {
        const int64_t s = g.row_offset + j;
        float *orow = o + (n * g.out_tok_n + s * g.out_tok_s) * hd;
        const P *prow = p ? p + (n * g.part_tok_n + j * g.part_tok_s) * hd : nullptr;
        for (int64_t h = 0; h < g.heads; ++h) {
          float &a = l[n * g.lse_n + s * g.lse_s + h * g.lse_h];
          const double b = pl[n * g.plse_n + j * g.plse_s + h * g.plse_h];
          double wa, wb, nl;
          if (!attn_merge::merge_weights<double>(a, b, wa, wb, nl)) continue;
          float *oh = orow + h * g.dim;
          for (int64_t d = 0; d < g.dim; ++d) {
            const double v = g.part_is_zero ? 0.0 : (double)to_f32(prow[h * g.dim + d]);
            oh[d] = (float)(wa * oh[d] + wb * v);
          }
          a = (float)nl;
        }
      }
  });
}

void attn_merge_sink_grad(const attn_merge::Geometry &g, const Tensor &dout, const Tensor &out, const Tensor &lse,
                          const Tensor &sink, Tensor &dsink) {
  const float *l = static_cast<const float *>(lse.params[kNVTERowwiseData].data_ptr);
  const float *sk = static_cast<const float *>(sink.params[kNVTERowwiseData].data_ptr);
  float *ds = static_cast<float *>(dsink.params[kNVTERowwiseData].data_ptr);
  with_float_dtype(logical_dtype(out), "out", [&](auto tag) {
    using O = typename decltype(tag)::type;
    const O *o = static_cast<const O *>(out.params[kNVTERowwiseData].data_ptr);
    const O *d = static_cast<const O *>(dout.params[kNVTERowwiseData].data_ptr);
    const int64_t hd = g.heads * g.dim;
    for (int64_t h = 0; h < g.heads; ++h) {
      double acc = 0.0;
      for (int64_t n = 0; n < g.batch; ++n)
        for (int64_t s = 0; s < g.rows; ++s) {
          const float a = l[n * g.lse_n + s * g.lse_s + h * g.lse_h];
          if (a == -INFINITY) continue;  // a row without keys or sink share
          const int64_t off = (n * g.out_tok_n + s * g.out_tok_s) * hd + h * g.dim;
          double dot = 0.0;
          for (int64_t k = 0; k < g.dim; ++k) dot += (double)to_f32(o[off + k]) * (double)to_f32(d[off + k]);
          acc += std::exp((double)sk[h] - (double)a) * dot;
        }
      ds[h] = (float)-acc;
    }
  });
}

}  // namespace nvte::cpu
