// api/attn_merge.cpp - nvte_attn_merge / nvte_attn_merge_sink (fused_attn.h): check the shapes
// once (attn_merge::Geometry), pick the backend, run the shared merge rule.
#include "transformer_engine/fused_attn.h"

#include <utility>

#include "../common/attn_merge.h"
#include "../common/backend.h"
#include "alias_checks.h"
#include "attn_checks.h"
#include "../cpu/attn_merge.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/attn_merge.h"
#endif

using namespace nvte;
using attn_merge::Geometry;

namespace {

// Sizes of a statistics tensor: [b, h, s] or [b, h, s, 1] (BSHD / SBHD), [t, h] (THD).
bool stats_shape(const NVTEShape &s, NVTE_QKV_Format fmt, int64_t b, int64_t h, int64_t rows) {
  if (fmt == NVTE_THD) return s.ndim == 2 && (int64_t)s.data[0] == rows && (int64_t)s.data[1] == h;
  const bool trail = s.ndim == 4 && s.data[3] == 1;
  return (s.ndim == 3 || trail) && (int64_t)s.data[0] == b && (int64_t)s.data[1] == h && (int64_t)s.data[2] == rows;
}

// The tensors are read through their rowwise data; a handle without it is an error, not a null read.
void check_rowwise(const Tensor &t, const char *name) {
  NVTE_CHECK(buffer_set(t.params[kNVTERowwiseData]), name, " needs rowwise data");
}

const char *stats_text(NVTE_QKV_Format fmt) {
  return fmt == NVTE_THD ? "[t, h] (THD)" : "[b, h, s] or [b, h, s, 1]";
}

// Token and statistics strides of a [.., h, d] tensor of `rows` rows per batch entry in fmt
// (Geometry's units: tokens of h * d elements; statistics elements).
struct Strides {
  int64_t tok_n, tok_s, lse_n, lse_s, lse_h;
};
Strides strides_of(NVTE_QKV_Format fmt, int64_t batch, int64_t heads, int64_t rows) {
  if (fmt == NVTE_THD) return {0, 1, 0, heads, 1};  // [t, h, d], statistics [t, h]
  return {fmt == NVTE_SBHD ? 1 : rows, fmt == NVTE_SBHD ? batch : 1, heads * rows, 1, rows};
}

// The running pair: out float32 [b, s, h, d] / [s, b, h, d] / [t, h, d], lse float32 statistics
// (out_f32 false: out may also be bfloat16 / float16, read only).
Geometry running(const Tensor &out, const Tensor &lse, NVTE_QKV_Format fmt, bool out_f32 = true) {
  NVTE_CHECK(fmt == NVTE_BSHD || fmt == NVTE_SBHD || fmt == NVTE_THD,
             "qkv_format must be NVTE_BSHD, NVTE_SBHD or NVTE_THD, got ", (int)fmt);
  check_rowwise(out, "out");
  check_rowwise(lse, "lse");
  NVTE_CHECK(!api::bytes_overlap(out, lse), "out and lse must not share memory");
  const NVTEShape os = logical_shape(out), ls = logical_shape(lse);
  const size_t want = fmt == NVTE_THD ? 3 : 4;
  NVTE_CHECK(os.ndim == want, "out must be ", fmt == NVTE_THD ? "[t, h, d] (THD)" : "4-D [.., h, d]", ", got ",
             shape_str(os));
  const NVTEDType od = logical_dtype(out);
  if (out_f32)
    NVTE_CHECK(od == kNVTEFloat32 && logical_dtype(lse) == kNVTEFloat32,
               "out and lse must be float32 (the running sums), got ", dtype_name(od), " and ",
               dtype_name(logical_dtype(lse)));
  else
    NVTE_CHECK((od == kNVTEFloat32 || od == kNVTEBFloat16 || od == kNVTEFloat16) &&
                   logical_dtype(lse) == kNVTEFloat32,
               "out must be float32, bfloat16 or float16 and lse float32, got ", dtype_name(od), " and ",
               dtype_name(logical_dtype(lse)));
  Geometry g;
  if (fmt == NVTE_THD) {
    g.batch = 1;
    g.rows = (int64_t)os.data[0];
  } else {
    g.batch = (int64_t)os.data[fmt == NVTE_BSHD ? 0 : 1];
    g.rows = (int64_t)os.data[fmt == NVTE_BSHD ? 1 : 0];
  }
  g.heads = (int64_t)os.data[want - 2];
  g.dim = (int64_t)os.data[want - 1];
  NVTE_CHECK(stats_shape(ls, fmt, g.batch, g.heads, g.rows), "lse must be float32 ", stats_text(fmt),
             " matching out ", shape_str(os), ", got ", shape_str(ls));
  const Strides st = strides_of(fmt, g.batch, g.heads, g.rows);
  g.out_tok_n = st.tok_n, g.out_tok_s = st.tok_s, g.lse_n = st.lse_n, g.lse_s = st.lse_s, g.lse_h = st.lse_h;
  return g;
}

void run(const char *op, const Geometry &g, Tensor &o, Tensor &l, const Tensor *part, const Tensor &pl,
         std::initializer_list<NamedTensor> named, cudaStream_t stream) {
  const Backend where = backend_of(named);
  if (g.batch == 0 || g.part_rows == 0 || g.heads == 0) return;
  switch (where) {
    case Backend::CPU: return cpu::attn_merge(g, o, l, part, pl);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::attn_merge(g, o, l, part, pl, stream);
#else
      (void)stream;
      cuda_not_built(op);
#endif
  }
}

}  // namespace

extern "C" NVTEStatus nvte_attn_merge(NVTETensor out, NVTETensor lse, const NVTETensor out_part,
                                      const NVTETensor lse_part, size_t row_offset, NVTE_QKV_Format qkv_format,
                                      cudaStream_t stream) {
  const char *op = "nvte_attn_merge";
  return api_call(op, [&] {
    Tensor &o = require_mut(out, "out"), &l = require_mut(lse, "lse");
    const Tensor &p = require(out_part, "out_part"), &pl = require(lse_part, "lse_part");
    Geometry g = running(o, l, qkv_format);
    check_rowwise(p, "out_part");
    check_rowwise(pl, "lse_part");
    for (const Tensor *t : {&p, &pl})
      NVTE_CHECK(!api::bytes_overlap(*t, o) && !api::bytes_overlap(*t, l), t == &p ? "out_part" : "lse_part",
                 " must not share memory with out or lse (they are written while it is read)");
    const NVTEShape os = logical_shape(o), ps = logical_shape(p), pls = logical_shape(pl);
    const NVTEDType pd = logical_dtype(p);
    NVTE_CHECK(pd == kNVTEFloat32 || pd == kNVTEBFloat16 || pd == kNVTEFloat16,
               "out_part must be float32, bfloat16 or float16, got ", dtype_name(pd));
    const int sdim = qkv_format == NVTE_SBHD ? 0 : (qkv_format == NVTE_BSHD ? 1 : 0);
    bool same = ps.ndim == os.ndim;
    for (size_t i = 0; same && i < os.ndim; ++i) same = (int)i == sdim || ps.data[i] == os.data[i];
    NVTE_CHECK(same, "out_part ", shape_str(ps), " must match out ", shape_str(os), " except in the ",
               qkv_format == NVTE_THD ? "token" : "sequence", " dimension (", sdim, ")");
    g.part_rows = (int64_t)ps.data[sdim];
    g.row_offset = (int64_t)row_offset;
    NVTE_CHECK(row_offset <= (size_t)g.rows && g.part_rows <= g.rows - g.row_offset, "out_part's ", g.part_rows,
               " rows from row_offset ", row_offset, " run past out's ", g.rows);
    NVTE_CHECK(logical_dtype(pl) == kNVTEFloat32 && stats_shape(pls, qkv_format, g.batch, g.heads, g.part_rows),
               "lse_part must be float32 ", stats_text(qkv_format), " matching out_part ", shape_str(ps), ", got ",
               dtype_name(logical_dtype(pl)), " ", shape_str(pls));
    const Strides st = strides_of(qkv_format, g.batch, g.heads, g.part_rows);
    g.part_tok_n = st.tok_n, g.part_tok_s = st.tok_s, g.plse_n = st.lse_n, g.plse_s = st.lse_s, g.plse_h = st.lse_h;
    run(op, g, o, l, &p, pl, {{"out", out}, {"lse", lse}, {"out_part", out_part}, {"lse_part", lse_part}}, stream);
  });
}

extern "C" NVTEStatus nvte_attn_merge_sink(NVTETensor out, NVTETensor lse, const NVTETensor sink,
                                           NVTE_QKV_Format qkv_format, cudaStream_t stream) {
  const char *op = "nvte_attn_merge_sink";
  return api_call(op, [&] {
    Tensor &o = require_mut(out, "out"), &l = require_mut(lse, "lse");
    const Tensor &sk = require(sink, "sink");
    Geometry g = running(o, l, qkv_format);
    check_rowwise(sk, "sink");
    NVTE_CHECK(!api::bytes_overlap(sk, o) && !api::bytes_overlap(sk, l), "sink must not share memory with out or lse");
    api::check_exact(sk, "sink", kNVTEFloat32, api::make_shape({(size_t)g.heads}), true);
    g.part_rows = g.rows;  // every row gets the sink's term
    g.part_is_zero = true;
    g.plse_n = 0, g.plse_s = 0, g.plse_h = 1;
    run(op, g, o, l, nullptr, sk, {{"out", out}, {"lse", lse}, {"sink", sink}}, stream);
  });
}

extern "C" NVTEStatus nvte_attn_merge_sink_grad(const NVTETensor dout, const NVTETensor out, const NVTETensor lse,
                                                const NVTETensor sink, NVTETensor dsink, NVTE_QKV_Format qkv_format,
                                                cudaStream_t stream) {
  const char *op = "nvte_attn_merge_sink_grad";
  return api_call(op, [&] {
    const Tensor &o = require(out, "out"), &l = require(lse, "lse"), &sk = require(sink, "sink");
    const Tensor &d = require(dout, "dout");
    Tensor &ds = require_mut(dsink, "dsink");
    Geometry g = running(o, l, qkv_format, false);
    check_rowwise(d, "dout");
    check_rowwise(sk, "sink");
    check_rowwise(ds, "dsink");
    api::check_exact(d, "dout", logical_dtype(o), logical_shape(o), true);  // (out's shape and dtype)
    api::check_exact(sk, "sink", kNVTEFloat32, api::make_shape({(size_t)g.heads}), true);
    api::check_exact(ds, "dsink", kNVTEFloat32, api::make_shape({(size_t)g.heads}), true);
    for (const Tensor *t : {&d, &o, &l, &sk})
      NVTE_CHECK(!api::bytes_overlap(ds, *t), "dsink must not share memory with the inputs");
    g.part_rows = g.rows;
    const Backend where = backend_of({{"dout", dout}, {"out", out}, {"lse", lse}, {"sink", sink}, {"dsink", dsink}});
    switch (where) {
      case Backend::CPU: return cpu::attn_merge_sink_grad(g, d, o, l, sk, ds);
      case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
        return cuda::attn_merge_sink_grad(g, d, o, l, sk, ds, stream);
#else
        cuda_not_built(op);
#endif
    }
  });
}
