// fused_attn.cpp - Python functions for fused_attn.h: the enums (TE's names), the layout and
// backend queries, forward, backward and the workspace queries.
//
// Aux_CTX_Tensors travels as a Python list of Tensor: None passes no pack, [] asks the
// forward to describe the pack (returned as a list of (shape, DType)), and a list of handles
// is passed as the pack itself.
#include "transformer_engine/fused_attn.h"

#include <string>

#include "binding.h"

namespace nvte_py {

namespace {

// A pack built from a Python list, or created (and destroyed) for TE's describe call.
class PackArg {
 public:
  explicit PackArg(const py::object &aux) {
    if (aux.is_none()) return;
    const py::list l = aux.cast<py::list>();
    if (l.size() > NVTE_TENSOR_PACK_MAX_SIZE)
      throw py::value_error("aux holds " + std::to_string(l.size()) + " tensors; at most " +
                            std::to_string(NVTE_TENSOR_PACK_MAX_SIZE));
    used_ = true;
    if (l.size() == 0) {
      check(nvte_tensor_pack_create(&pack_));
      created_ = true;
      return;
    }
    const std::vector<NVTETensor> h = tensor_handles(l, "aux");
    for (size_t i = 0; i < h.size(); ++i) pack_.tensors[i] = h[i];
    pack_.size = h.size();
  }
  ~PackArg() {
    if (created_) nvte_tensor_pack_destroy(&pack_);
  }
  PackArg(const PackArg &) = delete;
  PackArg &operator=(const PackArg &) = delete;

  NVTETensorPack *get() { return used_ ? &pack_ : nullptr; }

  // After a describe call: [(shape, dtype), ...]; otherwise None.
  py::object result() const {
    if (!created_) return py::none();
    py::list out;
    for (size_t i = 0; i < pack_.size; ++i) {
      const NVTEBasicTensor b = nvte_get_tensor_param(pack_.tensors[i], kNVTERowwiseData);
      out.append(py::make_tuple(std::vector<size_t>(b.shape.data, b.shape.data + b.shape.ndim), b.dtype));
    }
    return out;
  }

 private:
  NVTETensorPack pack_{};
  bool used_ = false, created_ = false;
};

// The format/group queries return -1 on an unknown layout (message in the last error).
template <class R>
R checked(R r) {
  if (static_cast<int>(r) < 0) check(NVTE_ERROR_INVALID_ARGUMENT);
  return r;
}

void bind_enums(py::module_ &m) {
  py::enum_<NVTE_QKV_Layout>(m, "NVTE_QKV_Layout")
      .value("NVTE_SB3HD", NVTE_SB3HD).value("NVTE_SBH3D", NVTE_SBH3D)
      .value("NVTE_SBHD_SB2HD", NVTE_SBHD_SB2HD).value("NVTE_SBHD_SBH2D", NVTE_SBHD_SBH2D)
      .value("NVTE_SBHD_SBHD_SBHD", NVTE_SBHD_SBHD_SBHD).value("NVTE_BS3HD", NVTE_BS3HD)
      .value("NVTE_BSH3D", NVTE_BSH3D).value("NVTE_BSHD_BS2HD", NVTE_BSHD_BS2HD)
      .value("NVTE_BSHD_BSH2D", NVTE_BSHD_BSH2D).value("NVTE_BSHD_BSHD_BSHD", NVTE_BSHD_BSHD_BSHD)
      .value("NVTE_T3HD", NVTE_T3HD).value("NVTE_TH3D", NVTE_TH3D)
      .value("NVTE_THD_T2HD", NVTE_THD_T2HD).value("NVTE_THD_TH2D", NVTE_THD_TH2D)
      .value("NVTE_THD_THD_THD", NVTE_THD_THD_THD).value("NVTE_SBHD_BSHD_BSHD", NVTE_SBHD_BSHD_BSHD)
      .value("NVTE_BSHD_SBHD_SBHD", NVTE_BSHD_SBHD_SBHD).value("NVTE_THD_BSHD_BSHD", NVTE_THD_BSHD_BSHD)
      .value("NVTE_THD_SBHD_SBHD", NVTE_THD_SBHD_SBHD)
      .value("NVTE_Paged_KV_BSHD_BSHD_BSHD", NVTE_Paged_KV_BSHD_BSHD_BSHD)
      .value("NVTE_Paged_KV_BSHD_SBHD_SBHD", NVTE_Paged_KV_BSHD_SBHD_SBHD)
      .value("NVTE_Paged_KV_SBHD_BSHD_BSHD", NVTE_Paged_KV_SBHD_BSHD_BSHD)
      .value("NVTE_Paged_KV_SBHD_SBHD_SBHD", NVTE_Paged_KV_SBHD_SBHD_SBHD)
      .value("NVTE_Paged_KV_THD_BSHD_BSHD", NVTE_Paged_KV_THD_BSHD_BSHD)
      .value("NVTE_Paged_KV_THD_SBHD_SBHD", NVTE_Paged_KV_THD_SBHD_SBHD);
  py::enum_<NVTE_QKV_Layout_Group>(m, "NVTE_QKV_Layout_Group")
      .value("NVTE_3HD", NVTE_3HD).value("NVTE_H3D", NVTE_H3D).value("NVTE_HD_2HD", NVTE_HD_2HD)
      .value("NVTE_HD_H2D", NVTE_HD_H2D).value("NVTE_HD_HD_HD", NVTE_HD_HD_HD)
      .value("NVTE_Paged_KV_HD_HD_HD", NVTE_Paged_KV_HD_HD_HD);
  py::enum_<NVTE_QKV_Format>(m, "NVTE_QKV_Format")
      .value("NVTE_SBHD", NVTE_SBHD).value("NVTE_BSHD", NVTE_BSHD).value("NVTE_THD", NVTE_THD)
      .value("NVTE_BSHD_2SBHD", NVTE_BSHD_2SBHD).value("NVTE_SBHD_2BSHD", NVTE_SBHD_2BSHD)
      .value("NVTE_THD_2BSHD", NVTE_THD_2BSHD).value("NVTE_THD_2SBHD", NVTE_THD_2SBHD);
  py::enum_<NVTE_Bias_Type>(m, "NVTE_Bias_Type")
      .value("NVTE_NO_BIAS", NVTE_NO_BIAS).value("NVTE_PRE_SCALE_BIAS", NVTE_PRE_SCALE_BIAS)
      .value("NVTE_POST_SCALE_BIAS", NVTE_POST_SCALE_BIAS).value("NVTE_ALIBI", NVTE_ALIBI);
  py::enum_<NVTE_Mask_Type>(m, "NVTE_Mask_Type")
      .value("NVTE_NO_MASK", NVTE_NO_MASK).value("NVTE_PADDING_MASK", NVTE_PADDING_MASK)
      .value("NVTE_CAUSAL_MASK", NVTE_CAUSAL_MASK)
      .value("NVTE_PADDING_CAUSAL_MASK", NVTE_PADDING_CAUSAL_MASK)
      .value("NVTE_CAUSAL_BOTTOM_RIGHT_MASK", NVTE_CAUSAL_BOTTOM_RIGHT_MASK)
      .value("NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK", NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK)
      .value("NVTE_ARBITRARY_MASK", NVTE_ARBITRARY_MASK);
  py::enum_<NVTE_Softmax_Type>(m, "NVTE_Softmax_Type")
      .value("NVTE_VANILLA_SOFTMAX", NVTE_VANILLA_SOFTMAX)
      .value("NVTE_OFF_BY_ONE_SOFTMAX", NVTE_OFF_BY_ONE_SOFTMAX)
      .value("NVTE_LEARNABLE_SOFTMAX", NVTE_LEARNABLE_SOFTMAX);
  py::enum_<NVTE_Fused_Attn_Backend>(m, "NVTE_Fused_Attn_Backend")
      .value("NVTE_No_Backend", NVTE_No_Backend)
      .value("NVTE_F16_max512_seqlen", NVTE_F16_max512_seqlen)
      .value("NVTE_F16_arbitrary_seqlen", NVTE_F16_arbitrary_seqlen).value("NVTE_FP8", NVTE_FP8);
}

}  // namespace

void bind_fused_attn(py::module_ &m) {
  bind_enums(m);
  m.def("get_qkv_layout_group", [](NVTE_QKV_Layout l) { return checked(nvte_get_qkv_layout_group(l)); });
  m.def("get_qkv_format", [](NVTE_QKV_Layout l) { return checked(nvte_get_qkv_format(l)); });
  m.def("get_q_format", [](NVTE_QKV_Layout l) { return checked(nvte_get_q_format(l)); });
  m.def("get_kv_format", [](NVTE_QKV_Layout l) { return checked(nvte_get_kv_format(l)); });

  m.def("get_fused_attn_backend", &nvte_get_fused_attn_backend, py::arg("is_training"),
        py::arg("q_dtype"), py::arg("kv_dtype"), py::arg("qkv_layout"), py::arg("bias_type"),
        py::arg("attn_mask_type"), py::arg("softmax_type"), py::arg("dropout"),
        py::arg("num_attn_heads"), py::arg("num_gqa_groups"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_kv"), py::arg("head_dim_qk"), py::arg("head_dim_v"),
        py::arg("window_size_left") = -1, py::arg("window_size_right") = -1,
        py::arg("return_max_logit") = false, py::arg("cuda_graph") = false,
        py::arg("deterministic") = false,
        "NVTE_F16_arbitrary_seqlen (float inputs) or NVTE_FP8 (float8_e4m3 inputs) when supported, "
        "else NVTE_No_Backend (reason: get_last_error()).");

  m.def("fused_attn_fwd",
        [](const Tensor &q, const Tensor &k, const Tensor &v, const Tensor *bias,
           const Tensor *softmax_offset, Tensor *s, Tensor &o, py::object aux, const Tensor *cu_q,
           const Tensor *cu_kv, const Tensor *cu_q_pad, const Tensor *cu_kv_pad, const Tensor *page_k,
           const Tensor *page_v, const Tensor *rng_state, size_t max_sq, size_t max_skv,
           bool is_training, bool return_max_logit, bool cuda_graph, float scale, float dropout,
           NVTE_QKV_Layout layout, NVTE_Bias_Type bias_type, NVTE_Mask_Type mask,
           NVTE_Softmax_Type softmax, int64_t wl, int64_t wr, bool bottom_right, Tensor *workspace,
           uintptr_t stream) {
          PackArg pack(aux);
          check(nvte_fused_attn_fwd(q.handle(), k.handle(), v.handle(), handle(bias), handle(softmax_offset),
                                    handle(s), o.handle(), pack.get(), handle(cu_q), handle(cu_kv),
                                    handle(cu_q_pad), handle(cu_kv_pad), handle(page_k), handle(page_v),
                                    handle(rng_state), max_sq, max_skv, is_training, return_max_logit,
                                    cuda_graph, scale, dropout, layout, bias_type, mask, softmax, wl, wr,
                                    bottom_right, handle(workspace), to_stream(stream)));
          return pack.result();
        },
        py::arg("Q"), py::arg("K"), py::arg("V"), py::arg("Bias").none(true), py::arg("SoftmaxOffset").none(true),
        py::arg("S").none(true), py::arg("O"), py::arg("aux").none(true), py::arg("cu_seqlens_q").none(true),
        py::arg("cu_seqlens_kv").none(true), py::arg("cu_seqlens_q_padded").none(true),
        py::arg("cu_seqlens_kv_padded").none(true), py::arg("page_table_k").none(true),
        py::arg("page_table_v").none(true), py::arg("rng_state").none(true), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_kv"), py::arg("is_training"), py::arg("return_max_logit"), py::arg("cuda_graph"),
        py::arg("attn_scale"), py::arg("dropout"), py::arg("qkv_layout"), py::arg("bias_type"),
        py::arg("attn_mask_type"), py::arg("softmax_type"), py::arg("window_size_left"),
        py::arg("window_size_right"), py::arg("bottom_right_diagonal"),
        py::arg("workspace").none(true) = nullptr, py::arg("stream") = 0,
        "nvte_fused_attn_fwd. aux: None (no pack), [] (returns the described [(shape, dtype)]) or "
        "the list of allocated aux Tensors. FP8 inputs: S is a metadata Tensor (scale; amax and "
        "scale_inv written), e.g. Tensor(scale=..., amax=..., scale_inv=...).");

  m.def("fused_attn_bwd",
        [](const Tensor &q, const Tensor &k, const Tensor &v, const Tensor &o, const Tensor &d_o,
           const Tensor *s, Tensor *dp, py::object aux, Tensor &dq, Tensor &dk, Tensor &dv,
           Tensor *dbias, Tensor *dsoftmax_offset, const Tensor *cu_q, const Tensor *cu_kv,
           const Tensor *cu_q_pad, const Tensor *cu_kv_pad, size_t max_sq, size_t max_skv,
           float scale, float dropout, NVTE_QKV_Layout layout, NVTE_Bias_Type bias_type,
           NVTE_Mask_Type mask, NVTE_Softmax_Type softmax, int64_t wl, int64_t wr,
           bool bottom_right, bool deterministic, bool cuda_graph, Tensor *workspace,
           uintptr_t stream) {
          PackArg pack(aux);
          check(nvte_fused_attn_bwd(q.handle(), k.handle(), v.handle(), o.handle(), d_o.handle(), handle(s),
                                    handle(dp), pack.get(), dq.handle(), dk.handle(), dv.handle(),
                                    handle(dbias), handle(dsoftmax_offset), handle(cu_q), handle(cu_kv),
                                    handle(cu_q_pad), handle(cu_kv_pad), max_sq, max_skv, scale, dropout,
                                    layout, bias_type, mask, softmax, wl, wr, bottom_right, deterministic,
                                    cuda_graph, handle(workspace), to_stream(stream)));
        },
        py::arg("Q"), py::arg("K"), py::arg("V"), py::arg("O"), py::arg("dO"), py::arg("S").none(true),
        py::arg("dP").none(true), py::arg("aux").none(true), py::arg("dQ"), py::arg("dK"), py::arg("dV"),
        py::arg("dBias").none(true), py::arg("dSoftmaxOffset").none(true), py::arg("cu_seqlens_q").none(true),
        py::arg("cu_seqlens_kv").none(true), py::arg("cu_seqlens_q_padded").none(true),
        py::arg("cu_seqlens_kv_padded").none(true), py::arg("max_seqlen_q"), py::arg("max_seqlen_kv"),
        py::arg("attn_scale"), py::arg("dropout"), py::arg("qkv_layout"), py::arg("bias_type"),
        py::arg("attn_mask_type"), py::arg("softmax_type"), py::arg("window_size_left"),
        py::arg("window_size_right"), py::arg("bottom_right_diagonal"), py::arg("deterministic"),
        py::arg("cuda_graph"), py::arg("workspace").none(true) = nullptr, py::arg("stream") = 0,
        "nvte_fused_attn_bwd. aux: the list of aux Tensors filled by the forward. FP8 inputs: S and "
        "dP are metadata Tensors (scale; dP's amax and scale_inv written).");

  m.def("fused_attn_fwd_workspace_size",
        [](const Tensor &q, const Tensor &k, const Tensor &v, const Tensor *bias, size_t max_sq,
           size_t max_skv, bool is_training, bool return_max_logit, float dropout, NVTE_QKV_Layout layout,
           NVTE_Bias_Type bias_type, NVTE_Mask_Type mask, NVTE_Softmax_Type softmax, int64_t wl,
           int64_t wr, bool bottom_right) {
          size_t bytes = 0;
          check(nvte_fused_attn_fwd_workspace_size(q.handle(), k.handle(), v.handle(), handle(bias), max_sq,
                                                   max_skv, is_training, return_max_logit, dropout, layout,
                                                   bias_type, mask, softmax, wl, wr, bottom_right, &bytes));
          return bytes;
        },
        py::arg("Q"), py::arg("K"), py::arg("V"), py::arg("Bias").none(true), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_kv"), py::arg("is_training"), py::arg("return_max_logit"), py::arg("dropout"),
        py::arg("qkv_layout"), py::arg("bias_type"), py::arg("attn_mask_type"), py::arg("softmax_type"),
        py::arg("window_size_left") = -1, py::arg("window_size_right") = -1,
        py::arg("bottom_right_diagonal") = false);

  m.def("fused_attn_bwd_workspace_size",
        [](const Tensor &q, const Tensor &k, const Tensor &v, const Tensor *dbias, size_t max_sq,
           size_t max_skv, float dropout, NVTE_QKV_Layout layout, NVTE_Bias_Type bias_type,
           NVTE_Mask_Type mask, NVTE_Softmax_Type softmax, int64_t wl, int64_t wr, bool bottom_right,
           bool deterministic) {
          size_t bytes = 0;
          check(nvte_fused_attn_bwd_workspace_size(q.handle(), k.handle(), v.handle(), handle(dbias), max_sq,
                                                   max_skv, dropout, layout, bias_type, mask, softmax, wl, wr,
                                                   bottom_right, deterministic, &bytes));
          return bytes;
        },
        py::arg("Q"), py::arg("K"), py::arg("V"), py::arg("dBias").none(true), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_kv"), py::arg("dropout"), py::arg("qkv_layout"), py::arg("bias_type"),
        py::arg("attn_mask_type"), py::arg("softmax_type"), py::arg("window_size_left") = -1,
        py::arg("window_size_right") = -1, py::arg("bottom_right_diagonal") = false,
        py::arg("deterministic") = false);

  m.def("copy_to_kv_cache",
        [](const Tensor &new_k, const Tensor &new_v, Tensor &k_cache, Tensor &v_cache, const Tensor *page_table,
           const Tensor &cu_new_lens, const Tensor &cu_cached_lens, NVTE_QKV_Format fmt, int b, int max_ctx_len,
           int max_seq_len, int max_pages_per_seq, int is_non_paged, uintptr_t stream) {
          check(nvte_copy_to_kv_cache(new_k.handle(), new_v.handle(), k_cache.handle(), v_cache.handle(),
                                      handle(page_table), cu_new_lens.handle(), cu_cached_lens.handle(), fmt, b,
                                      max_ctx_len, max_seq_len, max_pages_per_seq, is_non_paged, to_stream(stream)));
        },
        py::arg("new_k"), py::arg("new_v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table").none(true),
        py::arg("cu_new_lens"), py::arg("cu_cached_lens"), py::arg("qkv_format"), py::arg("b"),
        py::arg("max_ctx_len"), py::arg("max_seq_len"), py::arg("max_pages_per_seq"), py::arg("is_non_paged"),
        py::arg("stream") = 0);

  m.def("attn_merge",
        [](Tensor &out, Tensor &lse, const Tensor &out_part, const Tensor &lse_part, size_t row_offset,
           NVTE_QKV_Format fmt, uintptr_t stream) {
          check(nvte_attn_merge(out.handle(), lse.handle(), out_part.handle(), lse_part.handle(), row_offset, fmt,
                                to_stream(stream)));
        },
        py::arg("out"), py::arg("lse"), py::arg("out_part"), py::arg("lse_part"), py::arg("row_offset"),
        py::arg("qkv_format"), py::arg("stream") = 0);

  m.def("attn_merge_sink",
        [](Tensor &out, Tensor &lse, const Tensor &sink, NVTE_QKV_Format fmt, uintptr_t stream) {
          check(nvte_attn_merge_sink(out.handle(), lse.handle(), sink.handle(), fmt, to_stream(stream)));
        },
        py::arg("out"), py::arg("lse"), py::arg("sink"), py::arg("qkv_format"), py::arg("stream") = 0);

  m.def("attn_merge_sink_grad",
        [](const Tensor &dout, const Tensor &out, const Tensor &lse, const Tensor &sink, Tensor &dsink,
           NVTE_QKV_Format fmt, uintptr_t stream) {
          check(nvte_attn_merge_sink_grad(dout.handle(), out.handle(), lse.handle(), sink.handle(), dsink.handle(),
                                          fmt, to_stream(stream)));
        },
        py::arg("dout"), py::arg("out"), py::arg("lse"), py::arg("sink"), py::arg("dsink"), py::arg("qkv_format"),
        py::arg("stream") = 0);
}

}  // namespace nvte_py
