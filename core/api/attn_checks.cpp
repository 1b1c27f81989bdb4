// attn_checks.cpp - shape, dtype and configuration checks of fused attention (attn_checks.h).
#include "attn_checks.h"

#include <cmath>
#include <cstddef>

namespace nvte::api {

using attn::AttnParams;
using attn::LayoutInfo;
using attn::TensorPlacement;

namespace {

// A side tensor was passed and has data.
bool given(const Tensor *t) { return t != nullptr && present(const_cast<Tensor *>(t)); }

bool is_causal(NVTE_Mask_Type m) {
  return m == NVTE_CAUSAL_MASK || m == NVTE_PADDING_CAUSAL_MASK ||
         m == NVTE_CAUSAL_BOTTOM_RIGHT_MASK || m == NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK;
}

// Token dims of one Q/K/V-like tensor in a given format.
struct TokenDims {
  size_t b = 0, s = 0;  // BSHD/SBHD batch and sequence; THD: b unknown (0), s = t
  size_t h = 0, d = 0;
  size_t rows = 0;      // token rows: b * s or t
};

const char *dims_hint(NVTE_QKV_Format f) {
  return f == NVTE_BSHD ? "4D [b, s, h, d]" : (f == NVTE_SBHD ? "4D [s, b, h, d]" : "3D [t, h, d]");
}

TokenDims token_dims(const Tensor &t, const char *name, NVTE_QKV_Format f, const LayoutInfo &l) {
  NVTE_CHECK(buffer_set(t.params[kNVTERowwiseData]), name,
             " needs rowwise data (fused attention reads the row-major layout)");
  const NVTEShape s = t.params[kNVTERowwiseData].shape;
  TokenDims r;
  if (f == NVTE_THD) {
    NVTE_CHECK(s.ndim == 3, name, " has shape ", shape_str(s), "; layout ", l.name, " needs ",
               dims_hint(f));
    r.s = r.rows = s.data[0];
    r.h = s.data[1];
    r.d = s.data[2];
    return r;
  }
  NVTE_CHECK(s.ndim == 4, name, " has shape ", shape_str(s), "; layout ", l.name, " needs ",
             dims_hint(f));
  r.b = f == NVTE_BSHD ? s.data[0] : s.data[1];
  r.s = f == NVTE_BSHD ? s.data[1] : s.data[0];
  r.h = s.data[2];
  r.d = s.data[3];
  r.rows = r.b * r.s;
  return r;
}

// cu_seqlens-like tensor: int32 [b + 1].
void check_cu(const Tensor *t, const char *name, size_t batch, const char *why) {
  NVTE_CHECK(given(t), name, " is required (", why, "): int32 [batch + 1]");
  const NVTEShape s = logical_shape(*t);
  NVTE_CHECK(logical_dtype(*t) == kNVTEInt32, name, " must be int32, got ",
             dtype_name(logical_dtype(*t)));
  NVTE_CHECK(buffer_set(t->params[kNVTERowwiseData]), name, " needs rowwise data");
  NVTE_CHECK(s.ndim == 1 && s.data[0] == batch + 1, name, " has shape ", shape_str(s),
             "; expected [", batch + 1, "] (batch ", batch, " + 1)");
}

size_t cu_batch(const Tensor *t, const char *name) {
  NVTE_CHECK(given(t), name,
             " is required: the THD format takes the batch size and sequence bounds from it");
  const NVTEShape s = logical_shape(*t);
  NVTE_CHECK(s.ndim == 1 && s.data[0] >= 1, name, " has shape ", shape_str(s),
             "; expected int32 [batch + 1]");
  return s.data[0] - 1;
}

// Packed layouts: a tensor that does not start its buffer must sit at its offset from the one
// that does, else the layout's strides would read another tensor's memory.
void check_packing(const Tensor *const t[3], const char *const names[3], const AttnParams &p) {
  for (int r = 0; r < 3; ++r) {
    const TensorPlacement &pl = p.qkv.t[r];
    if (pl.pack_base == r) continue;
    const Tensor &base = *t[pl.pack_base];
    const NVTEBasicTensor &bb = base.params[kNVTERowwiseData], &rb = t[r]->params[kNVTERowwiseData];
    if (numel(bb.shape) == 0 || numel(rb.shape) == 0) continue;
    const std::ptrdiff_t got = static_cast<const char *>(rb.data_ptr) -
                               static_cast<const char *>(bb.data_ptr);
    const std::ptrdiff_t want = static_cast<std::ptrdiff_t>(pl.pack_offset * dtype_size(bb.dtype));
    NVTE_CHECK(got == want, names[r], " must be a view ", want, " bytes (", pl.pack_offset,
               " elements) past ", names[pl.pack_base], " in the packed ", p.layout.name,
               " buffer, but it starts ", got, " bytes away; pass Q/K/V as views into one buffer or "
               "use a *_hd_hd_hd layout for separate buffers");
  }
}

// Paged layouts: K and V are page caches (token dims: pages and page size) read through the
// page tables, int32 [b, pages_per_seq] each; the K/V lengths come from cu_seqlens_kv.
void describe_pages(attn::AttnParams &p, const AttnScalars &s, const TokenDims &tk,
                    const AttnSideTensors &side, bool with_cu) {
  const LayoutInfo &l = p.layout;
  p.num_pages = tk.b;
  p.page_size = tk.s;
  NVTE_CHECK(p.page_size >= 1, "K has shape ", p.num_pages, " pages of ", p.page_size,
             " tokens; paged layout ", l.name, " needs pages of at least one token");
  if (!with_cu) {  // workspace queries: the tables' width is not known, the lengths bound it
    p.pages_per_seq = (s.max_skv + p.page_size - 1) / p.page_size;
    return;
  }
  const Tensor *tables[2] = {side.page_k, side.page_v};
  const char *names[2] = {"page_table_k", "page_table_v"};
  for (int i = 0; i < 2; ++i) {
    NVTE_CHECK(given(tables[i]), "paged layout ", l.name, " needs ", names[i],
               ": int32 [batch, pages per sequence]");
    NVTE_CHECK(logical_dtype(*tables[i]) == kNVTEInt32, names[i], " must be int32, got ",
               dtype_name(logical_dtype(*tables[i])));
    NVTE_CHECK(buffer_set(tables[i]->params[kNVTERowwiseData]), names[i], " needs rowwise data");
    const NVTEShape ts = logical_shape(*tables[i]);
    NVTE_CHECK(ts.ndim == 2 && ts.data[0] == p.batch, names[i], " has shape ", shape_str(ts),
               "; expected [", p.batch, " (batch), pages per sequence]");
    NVTE_CHECK(i == 0 || ts.data[1] == p.pages_per_seq, "page_table_v has ", ts.data[1],
               " pages per sequence but page_table_k ", p.pages_per_seq, "; they must be equal");
    p.pages_per_seq = ts.data[1];
  }
  NVTE_CHECK(p.pages_per_seq * p.page_size >= s.max_skv, "max_seqlen_kv ", s.max_skv, " exceeds what ",
             p.pages_per_seq, " pages of ", p.page_size, " tokens per sequence hold (",
             p.pages_per_seq * p.page_size, ")");
}

}  // namespace

bool is_padding(NVTE_Mask_Type m) {
  return m == NVTE_PADDING_MASK || m == NVTE_PADDING_CAUSAL_MASK ||
         m == NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK;
}

attn::MaskRule mask_rule(const AttnScalars &s) {
  const bool causal = is_causal(s.mask_type);
  // The bottom-right causal types fix the alignment; the others take bottom_right_diagonal.
  const bool bottom_right = s.mask_type == NVTE_CAUSAL_BOTTOM_RIGHT_MASK ||
                            s.mask_type == NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK ||
                            (!causal && s.bottom_right_diagonal);
  return attn::MaskRule{causal, bottom_right, s.window_left, s.window_right};
}

NVTEShape make_shape(std::initializer_list<size_t> dims) {
  NVTEShape s{};
  for (size_t d : dims) s.data[s.ndim++] = d;
  return s;
}

NVTEShape stats_shape(const AttnParams &p) { return make_shape({p.batch, p.h_q, p.max_sq, 1}); }

void check_exact(const Tensor &t, const char *name, NVTEDType dtype, const NVTEShape &shape,
                 bool need_data) {
  const NVTEBasicTensor &b = t.params[kNVTERowwiseData];
  NVTE_CHECK(b.dtype == dtype, name, " must be ", dtype_name(dtype), ", got ", dtype_name(b.dtype));
  bool same = b.shape.ndim == shape.ndim;
  for (size_t i = 0; same && i < shape.ndim; ++i) same = b.shape.data[i] == shape.data[i];
  NVTE_CHECK(same, name, " has shape ", shape_str(b.shape), "; expected ", shape_str(shape));
  NVTE_CHECK(!need_data || b.data_ptr != nullptr || numel(shape) == 0, name,
             " has no data buffer (allocate it with the described shape)");
}

LayoutInfo check_config(const AttnScalars &s, const AttnDims &d) {
  const attn::ParsedLayout pl = attn::parse_layout(s.layout);
  NVTE_CHECK(pl.valid, "qkv_layout ", static_cast<int>(s.layout),
             " is not an NVTE_QKV_Layout value (0..24)");
  const LayoutInfo &l = pl.info;
  NVTE_CHECK(s.mask_type >= NVTE_NO_MASK && s.mask_type <= NVTE_ARBITRARY_MASK, "attn_mask_type ",
             static_cast<int>(s.mask_type), " is not an NVTE_Mask_Type value");
  NVTE_CHECK_SUPPORTED(s.mask_type != NVTE_ARBITRARY_MASK,
                       "attn_mask_type arbitrary is not part of fused attention (TE sends arbitrary "
                       "masks to unfused attention); pass the mask as a post_scale_bias holding 0 "
                       "where keys are visible and -inf where they are masked");
  NVTE_CHECK(s.bias_type >= NVTE_NO_BIAS && s.bias_type <= NVTE_ALIBI, "bias_type ",
             static_cast<int>(s.bias_type), " is not an NVTE_Bias_Type value");
  NVTE_CHECK(s.softmax_type >= NVTE_VANILLA_SOFTMAX && s.softmax_type <= NVTE_LEARNABLE_SOFTMAX,
             "softmax_type ", static_cast<int>(s.softmax_type), " is not an NVTE_Softmax_Type value");
  if (l.paged) {
    NVTE_CHECK(is_padding(s.mask_type), "paged layout ", l.name, " takes each sequence's K/V length from "
               "cu_seqlens_kv: use a padding mask type (padding, padding_causal, "
               "padding_causal_bottom_right), got ", attn::mask_name(s.mask_type));
    NVTE_CHECK_SUPPORTED(!is_fp8(d.q_dtype), "FP8 attention with paged K/V caches (", l.name,
                         ") is not supported");
  }
  NVTE_CHECK(d.q_dtype == d.kv_dtype, "Q has dtype ", dtype_name(d.q_dtype), " but K/V have ",
             dtype_name(d.kv_dtype), "; fused attention takes one dtype for Q, K and V");
  if (is_fp8(d.q_dtype)) {
    NVTE_CHECK_SUPPORTED(d.q_dtype == kNVTEFloat8E4M3, "FP8 fused attention takes float8_e4m3 Q, K "
                         "and V (TE's forward FP8 format), got ", dtype_name(d.q_dtype));
    NVTE_CHECK_SUPPORTED(s.bias_type == NVTE_NO_BIAS, "FP8 fused attention has no bias (as in TE); "
                         "got bias_type ", attn::bias_name(s.bias_type));
    NVTE_CHECK_SUPPORTED(!s.return_max_logit, "FP8 fused attention does not return the max logit "
                         "(as in TE)");
  } else {
    NVTE_CHECK(is_high_precision(d.q_dtype), "Q/K/V have dtype ", dtype_name(d.q_dtype),
               "; expected float32, float16 or bfloat16 (or float8_e4m3 for FP8 attention)");
  }
  NVTE_CHECK(d.h_q >= 1 && d.h_kv >= 1 && d.h_q % d.h_kv == 0, "Q has ", d.h_q, " heads and K/V ",
             d.h_kv, "; the K/V head count must be >= 1 and divide the Q head count (GQA/MQA)");
  NVTE_CHECK(d.d_qk >= 1 && d.d_v >= 1, "head sizes must be >= 1, got head_dim_qk ", d.d_qk,
             " and head_dim_v ", d.d_v);
  if (l.group == NVTE_3HD || l.group == NVTE_H3D) {
    NVTE_CHECK(d.h_q == d.h_kv && d.d_qk == d.d_v && s.max_sq == s.max_skv, "packed layout ", l.name,
               " holds Q, K and V in one buffer, so they need equal heads (", d.h_q, " vs ", d.h_kv,
               "), head sizes (", d.d_qk, " vs ", d.d_v, ") and sequence lengths (", s.max_sq,
               " vs ", s.max_skv, ")");
  } else if (l.group == NVTE_HD_2HD || l.group == NVTE_HD_H2D) {
    NVTE_CHECK(d.d_qk == d.d_v, "packed layout ", l.name,
               " holds K and V in one buffer, so head_dim_qk (", d.d_qk, ") must equal head_dim_v (",
               d.d_v, ")");
  }
  NVTE_CHECK(std::isfinite(s.dropout) && s.dropout >= 0.0f && s.dropout < 1.0f,
             "dropout probability must be in [0, 1), got ", s.dropout);
  NVTE_CHECK(std::isfinite(s.scale), "attn_scale must be finite, got ", s.scale);
  NVTE_CHECK(s.window_left >= -1 && s.window_right >= -1, "window sizes must be >= -1 (-1 = "
             "unbounded), got (", s.window_left, ", ", s.window_right, ")");
  return l;
}

AttnDims qkv_dims(const AttnScalars &s, const Tensor &q, const Tensor &k, const Tensor &v) {
  const attn::ParsedLayout parsed = attn::parse_layout(s.layout);
  NVTE_CHECK(parsed.valid, "qkv_layout ", static_cast<int>(s.layout),
             " is not an NVTE_QKV_Layout value (0..24)");
  const LayoutInfo &l = parsed.info;
  const TokenDims tq = token_dims(q, "Q", l.q_format, l);
  const TokenDims tk = token_dims(k, "K", l.kv_format, l);
  const TokenDims tv = token_dims(v, "V", l.kv_format, l);
  NVTE_CHECK(logical_dtype(k) == logical_dtype(v), "K has dtype ", dtype_name(logical_dtype(k)),
             " but V has ", dtype_name(logical_dtype(v)));
  NVTE_CHECK(tk.b == tv.b && tk.s == tv.s && tk.h == tv.h, "K has shape ",
             shape_str(logical_shape(k)), " and V ", shape_str(logical_shape(v)),
             "; they need the same batch, tokens and heads");
  NVTE_CHECK(tk.d == tq.d, "Q has head size ", tq.d, " but K has ", tk.d,
             "; Q and K need the same head_dim_qk");
  return AttnDims{logical_dtype(q), logical_dtype(k), tq.h, tk.h, tq.d, tv.d};
}

AttnParams describe(const AttnScalars &s, const Tensor &q, const Tensor &k, const Tensor &v,
                    const AttnSideTensors &side, bool with_cu) {
  const AttnDims dims = qkv_dims(s, q, k, v);
  const LayoutInfo l = check_config(s, dims);
  const TokenDims tq = token_dims(q, "Q", l.q_format, l);
  const TokenDims tk = token_dims(k, "K", l.kv_format, l);

  AttnParams p;
  p.layout = l;
  p.h_q = dims.h_q;
  p.h_kv = dims.h_kv;
  p.d_qk = dims.d_qk;
  p.d_v = dims.d_v;
  p.max_sq = s.max_sq;
  p.max_skv = s.max_skv;
  p.rows_q = tq.rows;
  p.rows_kv = tk.rows;
  p.dtype = dims.q_dtype;
  p.bias_type = s.bias_type;
  p.mask_type = s.mask_type;
  p.softmax_type = s.softmax_type;
  p.scale = s.scale;
  p.is_training = s.is_training;
  p.dropout = s.is_training ? s.dropout : 0.0f;
  p.return_max_logit = s.return_max_logit;
  p.deterministic = s.deterministic;
  const bool q_thd = l.q_format == NVTE_THD, kv_thd = l.kv_format == NVTE_THD;
  p.padding = is_padding(s.mask_type);
  p.rule = mask_rule(s);

  if (l.group == NVTE_3HD || l.group == NVTE_H3D) {
    NVTE_CHECK(tq.rows == tk.rows, "packed layout ", l.name, " shares token rows between Q (",
               tq.rows, ") and K/V (", tk.rows, "); they must be equal");
  }
  // Batch: from a BSHD/SBHD tensor when there is one, else from cu_seqlens_q (a paged K/V
  // cache's first dimension counts pages, not sequences).
  const bool kv_batch = !kv_thd && !l.paged;
  const bool batch_known = with_cu || !q_thd || kv_batch;
  p.batch = !q_thd ? tq.b : (kv_batch ? tk.b : (with_cu ? cu_batch(side.cu_q, "cu_seqlens_q") : 0));
  if (!q_thd) {
    NVTE_CHECK(tq.s == s.max_sq, "Q has shape ", shape_str(logical_shape(q)), ": its sequence dim ",
               tq.s, " must equal max_seqlen_q = ", s.max_sq);
  }
  if (l.paged) {
    describe_pages(p, s, tk, side, with_cu);
  } else if (!kv_thd) {
    NVTE_CHECK(tk.b == p.batch, "K has batch ", tk.b, " but Q has batch ", p.batch);
    NVTE_CHECK(tk.s == s.max_skv, "K has shape ", shape_str(logical_shape(k)),
               ": its sequence dim ", tk.s, " must equal max_seqlen_kv = ", s.max_skv);
  }
  const char *why_q = q_thd ? "THD format" : "padding mask";
  const char *why_kv = kv_thd ? "THD format" : "padding mask";
  if (with_cu) {
    if (is_padding(s.mask_type) || q_thd) check_cu(side.cu_q, "cu_seqlens_q", p.batch, why_q);
    if (is_padding(s.mask_type) || kv_thd) check_cu(side.cu_kv, "cu_seqlens_kv", p.batch, why_kv);
    if (q_thd && given(side.cu_q_padded))
      check_cu(side.cu_q_padded, "cu_seqlens_q_padded", p.batch, "THD offsets");
    if (kv_thd && given(side.cu_kv_padded))
      check_cu(side.cu_kv_padded, "cu_seqlens_kv_padded", p.batch, "THD offsets");
  }

  if (s.bias_type == NVTE_PRE_SCALE_BIAS || s.bias_type == NVTE_POST_SCALE_BIAS) {
    NVTE_CHECK(given(side.bias), "bias_type ", attn::bias_name(s.bias_type),
               " needs a Bias tensor [1 or b, 1 or h, max_seqlen_q, max_seqlen_kv]");
    const NVTEShape bs = logical_shape(*side.bias);
    NVTE_CHECK(bs.ndim == 4 && (bs.data[0] == 1 || bs.data[0] == p.batch || !batch_known) &&
                   (bs.data[1] == 1 || bs.data[1] == p.h_q) && bs.data[2] == s.max_sq &&
                   bs.data[3] == s.max_skv,
               "Bias has shape ", shape_str(bs), "; expected [1 or ", p.batch, ", 1 or ", p.h_q, ", ",
               s.max_sq, ", ", s.max_skv, "]");
    NVTE_CHECK(is_high_precision(logical_dtype(*side.bias)), "Bias must be float32, float16 or "
               "bfloat16, got ", dtype_name(logical_dtype(*side.bias)));
    NVTE_CHECK(buffer_set(side.bias->params[kNVTERowwiseData]), "Bias needs rowwise data");
    p.bias_b = bs.data[0];
    p.bias_h = bs.data[1];
  } else if (s.bias_type == NVTE_ALIBI && given(side.bias)) {
    const NVTEShape bs = logical_shape(*side.bias);
    NVTE_CHECK(logical_dtype(*side.bias) == kNVTEFloat32, "ALiBi slopes (Bias) must be float32, got ",
               dtype_name(logical_dtype(*side.bias)));
    NVTE_CHECK((bs.ndim == 1 && bs.data[0] == p.h_q) ||
                   (bs.ndim == 2 && (bs.data[0] == p.batch || !batch_known) && bs.data[1] == p.h_q),
               "ALiBi slopes (Bias) have shape ", shape_str(bs), "; expected [", p.h_q, "] or [",
               p.batch, ", ", p.h_q, "], or no Bias for the default slopes");
    NVTE_CHECK(buffer_set(side.bias->params[kNVTERowwiseData]), "ALiBi slopes need rowwise data");
    p.slopes_b = bs.ndim == 1 ? 1 : bs.data[0];
  }
  if (s.softmax_type == NVTE_LEARNABLE_SOFTMAX && (with_cu || given(side.softmax_offset))) {
    NVTE_CHECK(given(side.softmax_offset),
               "softmax_type learnable needs SoftmaxOffset, float32 [1, ", p.h_q, ", 1, 1]");
    check_exact(*side.softmax_offset, "SoftmaxOffset", kNVTEFloat32, make_shape({1, p.h_q, 1, 1}),
                true);
  }

  p.qkv = attn::place_qkv(l, p.h_q, p.h_kv, p.d_qk, p.d_v);
  p.out = attn::place_out(l, p.h_q, p.d_v);
  const Tensor *t[3] = {&q, &k, &v};
  const char *const names[3] = {"Q", "K", "V"};
  check_packing(t, names, p);
  return p;
}

void check_out_like(const Tensor &t, const char *name, const AttnParams &p, NVTEDType dtype) {
  NVTEShape want;
  switch (p.layout.q_format) {
    case NVTE_BSHD: want = make_shape({p.batch, p.max_sq, p.h_q, p.d_v}); break;
    case NVTE_SBHD: want = make_shape({p.max_sq, p.batch, p.h_q, p.d_v}); break;
    default: want = make_shape({p.rows_q, p.h_q, p.d_v}); break;
  }
  check_exact(t, name, dtype, want, true);
}

void check_out_like(const Tensor &t, const char *name, const AttnParams &p) {
  check_out_like(t, name, p, p.dtype);
}

void check_qkv_grads(const Tensor &dq, const Tensor &dk, const Tensor &dv, const Tensor &q,
                     const Tensor &k, const Tensor &v, const AttnParams &p, NVTEDType dtype) {
  const Tensor *in[3] = {&q, &k, &v};
  const Tensor *out[3] = {&dq, &dk, &dv};
  const char *const names[3] = {"dQ", "dK", "dV"};
  for (int r = 0; r < 3; ++r)
    check_exact(*out[r], names[r], dtype, in[r]->params[kNVTERowwiseData].shape, true);
  check_packing(out, names, p);
}

// ------------------------------------------------------------------ FP8 scaling metadata

namespace {

void need_param(const Tensor &t, NVTETensorParam param, const char *name, const char *what,
                const char *why) {
  NVTE_CHECK(scalar_param(t, param, name) != nullptr, name, " needs its ", what,
             " (float32 [1]): ", why);
}

void need_scale_inv(const Tensor &t, const char *name) {
  need_param(t, kNVTERowwiseScaleInv, name, "scale_inv", "FP8 inputs are decoded as value * scale_inv");
}

// An output of FP8 attention: FP8 (E4M3 or E5M2) with a scale, or float16/bfloat16.
void check_scaled_out_dtype(const Tensor &t, const char *name) {
  const NVTEDType dt = t.params[kNVTERowwiseData].dtype;
  NVTE_CHECK(is_fp8(dt) || dt == kNVTEFloat16 || dt == kNVTEBFloat16, name, " of FP8 attention "
             "must be float8_e4m3, float8_e5m2, float16 or bfloat16, got ", dtype_name(dt));
  if (is_fp8(dt)) need_param(t, kNVTEScale, name, "scale", "FP8 outputs are stored as value * scale");
  scalar_param(t, kNVTEAmax, name);            // dtype checks of the optional buffers
  scalar_param(t, kNVTERowwiseScaleInv, name);
}

void check_meta(const Tensor *t, const char *name, const char *what) {
  NVTE_CHECK(t != nullptr, name, " is NULL; FP8 attention needs it for ", what);
  need_param(*t, kNVTEScale, name, "scale", what);
  scalar_param(*t, kNVTEAmax, name);
  scalar_param(*t, kNVTERowwiseScaleInv, name);
}

}  // namespace

void check_fp8_fwd(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor *s,
                   const Tensor &o, const AttnParams &p) {
  need_scale_inv(q, "Q");
  need_scale_inv(k, "K");
  need_scale_inv(v, "V");
  check_meta(s, "S", "the quantization of the softmax output (scale; amax and scale_inv are written)");
  check_scaled_out_dtype(o, "O");
  check_out_like(o, "O", p, o.params[kNVTERowwiseData].dtype);
}

void check_fp8_bwd(const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &o,
                   const Tensor &d_o, const Tensor *s, const Tensor *dp, const Tensor &dq,
                   const Tensor &dk, const Tensor &dv, const AttnParams &p) {
  need_scale_inv(q, "Q");
  need_scale_inv(k, "K");
  need_scale_inv(v, "V");
  const NVTEDType o_dt = o.params[kNVTERowwiseData].dtype, do_dt = d_o.params[kNVTERowwiseData].dtype;
  NVTE_CHECK(is_fp8(o_dt) || o_dt == kNVTEFloat16 || o_dt == kNVTEBFloat16, "O of FP8 attention "
             "must be float8_e4m3, float8_e5m2, float16 or bfloat16 (as the forward wrote it), got ",
             dtype_name(o_dt));
  if (is_fp8(o_dt)) need_scale_inv(o, "O");
  check_out_like(o, "O", p, o_dt);
  NVTE_CHECK(is_fp8(do_dt), "dO of FP8 attention must be float8_e4m3 or float8_e5m2 (E5M2 under "
             "TE's HYBRID recipe), got ", dtype_name(do_dt));
  need_scale_inv(d_o, "dO");
  check_out_like(d_o, "dO", p, do_dt);
  check_meta(s, "S", "the quantization of the softmax output (scale)");
  check_meta(dp, "dP", "the quantization of dS (scale; amax and scale_inv are written)");
  const NVTEDType g = dq.params[kNVTERowwiseData].dtype;
  check_scaled_out_dtype(dq, "dQ");
  check_scaled_out_dtype(dk, "dK");
  check_scaled_out_dtype(dv, "dV");
  check_qkv_grads(dq, dk, dv, q, k, v, p, g);
}

}  // namespace nvte::api
