// attn_layout.h - how the fused attention layouts (fused_attn.h) place Q, K, V in memory.
//
// One place parses an NVTE_QKV_Layout into the format of Q and of K/V and the strides of each
// tensor inside its (possibly packed) buffer, so the CPU and CUDA backends and the API checks
// agree on every offset. Addressing works on "token rows": token s of sequence b is row
//   BSHD: b * S + s      SBHD: s * B + b      THD: seq_offset[b] + s
// and element (row, head, d) sits at row * row_stride + head * head_stride + d, counted from
// the tensor's own data pointer (packed tensors point at their first element in the buffer).
#pragma once

#include <cstddef>
#include <cstdint>

#include "numeric.h"  // NVTE_HD
#include "transformer_engine/fused_attn.h"

namespace nvte::attn {

// Q, K and V (and their gradients) in argument order; also names packed slots.
enum Role : int { kQ = 0, kK = 1, kV = 2 };

struct LayoutInfo {
  NVTE_QKV_Layout layout;
  NVTE_QKV_Layout_Group group;
  NVTE_QKV_Format q_format;   // SBHD, BSHD or THD
  NVTE_QKV_Format kv_format;  // SBHD, BSHD or THD
  bool paged;
  const char *name;           // "bs3hd", ... for messages
};

// Parses a layout; valid == false for values outside the enum.
struct ParsedLayout {
  bool valid;
  LayoutInfo info;
};
ParsedLayout parse_layout(NVTE_QKV_Layout layout);

// The combined format value TE reports for (q_format, kv_format).
NVTE_QKV_Format combined_format(NVTE_QKV_Format q, NVTE_QKV_Format kv);

const char *format_name(NVTE_QKV_Format f);
const char *mask_name(NVTE_Mask_Type m);
const char *bias_name(NVTE_Bias_Type b);
const char *softmax_name(NVTE_Softmax_Type s);

// Placement of one tensor: strides in elements, and for packed layouts where it sits relative
// to the first tensor of its pack (pack_base: the role whose pointer starts the buffer).
struct TensorPlacement {
  NVTE_QKV_Format format;
  size_t row_stride;
  size_t head_stride;
  int pack_base;         // role starting the shared buffer (== own role when not packed)
  size_t pack_offset;    // elements from pack_base's pointer to this tensor's pointer
};

// Placements of Q, K, V (and equally of dQ, dK, dV) for the given head counts and sizes.
// Packed groups need equal sizes where they share a buffer (checked by the API layer).
struct QKVPlacement {
  TensorPlacement t[3];
};
QKVPlacement place_qkv(const LayoutInfo &info, size_t h_q, size_t h_kv, size_t d_qk, size_t d_v);

// Placement of O / dO: a plain tensor in Q's format.
TensorPlacement place_out(const LayoutInfo &info, size_t h_q, size_t d_v);

// Token row of (b, s) in a tensor of the given format; batch and seq are the tensor's B and S
// (BSHD/SBHD) and seq_offset the start of sequence b (THD).
NVTE_HD size_t token_row(NVTE_QKV_Format f, size_t b, size_t s, size_t batch, size_t seq,
                         size_t seq_offset) {
  return f == NVTE_BSHD ? b * seq + s : (f == NVTE_SBHD ? s * batch + b : seq_offset + s);
}

NVTE_HD size_t element_offset(const TensorPlacement &p, size_t row, size_t head) {
  return row * p.row_stride + head * p.head_stride;
}

}  // namespace nvte::attn
