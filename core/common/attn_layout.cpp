// attn_layout.cpp - the layout table of fused attention and the strides it implies.
#include "attn_layout.h"

namespace nvte::attn {
namespace {

struct Row {
  NVTE_QKV_Layout layout;
  NVTE_QKV_Layout_Group group;
  NVTE_QKV_Format q, kv;
  bool paged;
  const char *name;
};

// Indexed by the enum value (TE's numbering is dense from 0 to 24).
constexpr Row kLayouts[] = {
    {NVTE_SB3HD, NVTE_3HD, NVTE_SBHD, NVTE_SBHD, false, "sb3hd"},
    {NVTE_SBH3D, NVTE_H3D, NVTE_SBHD, NVTE_SBHD, false, "sbh3d"},
    {NVTE_SBHD_SB2HD, NVTE_HD_2HD, NVTE_SBHD, NVTE_SBHD, false, "sbhd_sb2hd"},
    {NVTE_SBHD_SBH2D, NVTE_HD_H2D, NVTE_SBHD, NVTE_SBHD, false, "sbhd_sbh2d"},
    {NVTE_SBHD_SBHD_SBHD, NVTE_HD_HD_HD, NVTE_SBHD, NVTE_SBHD, false, "sbhd_sbhd_sbhd"},
    {NVTE_BS3HD, NVTE_3HD, NVTE_BSHD, NVTE_BSHD, false, "bs3hd"},
    {NVTE_BSH3D, NVTE_H3D, NVTE_BSHD, NVTE_BSHD, false, "bsh3d"},
    {NVTE_BSHD_BS2HD, NVTE_HD_2HD, NVTE_BSHD, NVTE_BSHD, false, "bshd_bs2hd"},
    {NVTE_BSHD_BSH2D, NVTE_HD_H2D, NVTE_BSHD, NVTE_BSHD, false, "bshd_bsh2d"},
    {NVTE_BSHD_BSHD_BSHD, NVTE_HD_HD_HD, NVTE_BSHD, NVTE_BSHD, false, "bshd_bshd_bshd"},
    {NVTE_T3HD, NVTE_3HD, NVTE_THD, NVTE_THD, false, "t3hd"},
    {NVTE_TH3D, NVTE_H3D, NVTE_THD, NVTE_THD, false, "th3d"},
    {NVTE_THD_T2HD, NVTE_HD_2HD, NVTE_THD, NVTE_THD, false, "thd_t2hd"},
    {NVTE_THD_TH2D, NVTE_HD_H2D, NVTE_THD, NVTE_THD, false, "thd_th2d"},
    {NVTE_THD_THD_THD, NVTE_HD_HD_HD, NVTE_THD, NVTE_THD, false, "thd_thd_thd"},
    {NVTE_SBHD_BSHD_BSHD, NVTE_HD_HD_HD, NVTE_SBHD, NVTE_BSHD, false, "sbhd_bshd_bshd"},
    {NVTE_BSHD_SBHD_SBHD, NVTE_HD_HD_HD, NVTE_BSHD, NVTE_SBHD, false, "bshd_sbhd_sbhd"},
    {NVTE_THD_BSHD_BSHD, NVTE_HD_HD_HD, NVTE_THD, NVTE_BSHD, false, "thd_bshd_bshd"},
    {NVTE_THD_SBHD_SBHD, NVTE_HD_HD_HD, NVTE_THD, NVTE_SBHD, false, "thd_sbhd_sbhd"},
    {NVTE_Paged_KV_BSHD_BSHD_BSHD, NVTE_Paged_KV_HD_HD_HD, NVTE_BSHD, NVTE_BSHD, true,
     "paged_kv_bshd_bshd_bshd"},
    {NVTE_Paged_KV_BSHD_SBHD_SBHD, NVTE_Paged_KV_HD_HD_HD, NVTE_BSHD, NVTE_SBHD, true,
     "paged_kv_bshd_sbhd_sbhd"},
    {NVTE_Paged_KV_SBHD_BSHD_BSHD, NVTE_Paged_KV_HD_HD_HD, NVTE_SBHD, NVTE_BSHD, true,
     "paged_kv_sbhd_bshd_bshd"},
    {NVTE_Paged_KV_SBHD_SBHD_SBHD, NVTE_Paged_KV_HD_HD_HD, NVTE_SBHD, NVTE_SBHD, true,
     "paged_kv_sbhd_sbhd_sbhd"},
    {NVTE_Paged_KV_THD_BSHD_BSHD, NVTE_Paged_KV_HD_HD_HD, NVTE_THD, NVTE_BSHD, true,
     "paged_kv_thd_bshd_bshd"},
    {NVTE_Paged_KV_THD_SBHD_SBHD, NVTE_Paged_KV_HD_HD_HD, NVTE_THD, NVTE_SBHD, true,
     "paged_kv_thd_sbhd_sbhd"},
};
constexpr int kNumLayouts = sizeof(kLayouts) / sizeof(kLayouts[0]);

TensorPlacement plain(NVTE_QKV_Format f, Role self, size_t h, size_t d) {
  return {f, h * d, d, self, 0};
}

}  // namespace

ParsedLayout parse_layout(NVTE_QKV_Layout layout) {
  const int v = static_cast<int>(layout);
  if (v < 0 || v >= kNumLayouts) return {false, {}};
  const Row &r = kLayouts[v];
  return {true, {r.layout, r.group, r.q, r.kv, r.paged, r.name}};
}

NVTE_QKV_Format combined_format(NVTE_QKV_Format q, NVTE_QKV_Format kv) {
  if (q == kv) return q;
  if (q == NVTE_BSHD) return NVTE_BSHD_2SBHD;
  if (q == NVTE_SBHD) return NVTE_SBHD_2BSHD;
  return kv == NVTE_BSHD ? NVTE_THD_2BSHD : NVTE_THD_2SBHD;
}

const char *format_name(NVTE_QKV_Format f) {
  switch (f) {
    case NVTE_SBHD: return "sbhd";
    case NVTE_BSHD: return "bshd";
    case NVTE_THD: return "thd";
    case NVTE_BSHD_2SBHD: return "bshd_2sbhd";
    case NVTE_SBHD_2BSHD: return "sbhd_2bshd";
    case NVTE_THD_2BSHD: return "thd_2bshd";
    case NVTE_THD_2SBHD: return "thd_2sbhd";
  }
  return "invalid";
}

const char *mask_name(NVTE_Mask_Type m) {
  switch (m) {
    case NVTE_NO_MASK: return "no_mask";
    case NVTE_PADDING_MASK: return "padding";
    case NVTE_CAUSAL_MASK: return "causal";
    case NVTE_PADDING_CAUSAL_MASK: return "padding_causal";
    case NVTE_CAUSAL_BOTTOM_RIGHT_MASK: return "causal_bottom_right";
    case NVTE_PADDING_CAUSAL_BOTTOM_RIGHT_MASK: return "padding_causal_bottom_right";
    case NVTE_ARBITRARY_MASK: return "arbitrary";
  }
  return "invalid";
}

const char *bias_name(NVTE_Bias_Type b) {
  switch (b) {
    case NVTE_NO_BIAS: return "no_bias";
    case NVTE_PRE_SCALE_BIAS: return "pre_scale_bias";
    case NVTE_POST_SCALE_BIAS: return "post_scale_bias";
    case NVTE_ALIBI: return "alibi";
  }
  return "invalid";
}

const char *softmax_name(NVTE_Softmax_Type s) {
  switch (s) {
    case NVTE_VANILLA_SOFTMAX: return "vanilla";
    case NVTE_OFF_BY_ONE_SOFTMAX: return "off_by_one";
    case NVTE_LEARNABLE_SOFTMAX: return "learnable";
  }
  return "invalid";
}

QKVPlacement place_qkv(const LayoutInfo &info, size_t h_q, size_t h_kv, size_t d_qk, size_t d_v) {
  QKVPlacement p{};
  const NVTE_QKV_Format qf = info.q_format, kf = info.kv_format;
  switch (info.group) {
    case NVTE_3HD:  // [.., 3, h, d]: one token row holds Q, K, V heads side by side
      for (int r = 0; r < 3; ++r) p.t[r] = {qf, 3 * h_q * d_qk, d_qk, kQ, r * h_q * d_qk};
      break;
    case NVTE_H3D:  // [.., h, 3, d]: each head holds its q, k, v vectors side by side
      for (int r = 0; r < 3; ++r) p.t[r] = {qf, 3 * h_q * d_qk, 3 * d_qk, kQ, r * d_qk};
      break;
    case NVTE_HD_2HD:  // Q plain; [.., 2, h, d] for K, V
      p.t[kQ] = plain(qf, kQ, h_q, d_qk);
      p.t[kK] = {kf, 2 * h_kv * d_qk, d_qk, kK, 0};
      p.t[kV] = {kf, 2 * h_kv * d_qk, d_qk, kK, h_kv * d_qk};
      break;
    case NVTE_HD_H2D:  // Q plain; [.., h, 2, d] for K, V
      p.t[kQ] = plain(qf, kQ, h_q, d_qk);
      p.t[kK] = {kf, 2 * h_kv * d_qk, 2 * d_qk, kK, 0};
      p.t[kV] = {kf, 2 * h_kv * d_qk, 2 * d_qk, kK, d_qk};
      break;
    case NVTE_HD_HD_HD:
    case NVTE_Paged_KV_HD_HD_HD:
      p.t[kQ] = plain(qf, kQ, h_q, d_qk);
      p.t[kK] = plain(kf, kK, h_kv, d_qk);
      p.t[kV] = plain(kf, kV, h_kv, d_v);
      break;
  }
  return p;
}

TensorPlacement place_out(const LayoutInfo &info, size_t h_q, size_t d_v) {
  return plain(info.q_format, kQ, h_q, d_v);
}

}  // namespace nvte::attn
