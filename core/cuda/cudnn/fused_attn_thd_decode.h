// cuda/cudnn/fused_attn_thd_decode.h - the decode step of THD queries over BSHD/SBHD K/V or a
// paged cache (TE's inference layouts thd_*, paged_kv_thd_*; thd_decode in
// fused_attn_cudnn_rules.h says which calls).
#pragma once

#include "fused_attn_cudnn_rules.h"

namespace nvte::cuda::cudnn_attn {

// Workspace bytes of thd_decode_fwd: the BSHD call's, the Q and O scratch, and (paged caches) a
// run's inputs.
size_t thd_decode_fwd_workspace_bytes(const AttnParams &p);

// The forward of a thd_decode(p) call: each sequence's query row is copied into a [n, 1, h, d]
// scratch, the call runs as BSHD queries (decode_view) into an O scratch, and the rows go back
// into the THD O (whose other rows are zeroed). Statistics [b, h, 1] are the BSHD call's.
void thd_decode_fwd(const AttnParams &p, const attn::AttnFwdTensors &t, Tensor *workspace, cudaStream_t stream);

}  // namespace nvte::cuda::cudnn_attn
