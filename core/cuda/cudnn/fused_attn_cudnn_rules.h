// cuda/cudnn/fused_attn_cudnn_rules.h - what the cuDNN attention backend accepts, and the
// parameters its graphs are built from (THD: rounded sizes, see fused_attn_cudnn.cpp). Plain C++,
// no cuDNN frontend: the rules compile apart from the heavy graph code.
#pragma once

#include <string>

#include "../fused_attn.h"

namespace nvte::cuda::cudnn_attn {
using attn::AttnParams;

// Whether Q is THD (the THD runs of fused_attn_cudnn.cpp); kv_thd: whether K/V are too (else
// they are BSHD/SBHD tensors or paged caches: TE's inference layouts thd_2bshd, thd_2sbhd).
bool thd(const AttnParams &p);
bool kv_thd(const AttnParams &p);

// Whether the call needs bottom-right alignment: without padding and with max_seqlen_q ==
// max_seqlen_kv the bottom-right diagonal is the top-left one, and the graphs use top-left
// (which cuDNN takes with windows, bias and dropout; Hopper's FP8 graphs take no bottom-right).
bool bottom_right(const AttnParams &p);
// Whether the call has a window bound beyond the causal one (cuDNN's diagonal band).
bool windowed(const AttnParams &p);

// Whether the call's bottom-right causal mask hides nothing: one query row per sequence
// (max_seqlen_q 1, the decode step) sees every key j <= len_kv - 1, i.e. all of them.
bool causal_hides_nothing(const AttnParams &p);

// Why cuDNN cannot run the call ("" when it can), FP8 or float16/bfloat16.
std::string unsupported_reason(const AttnParams &p);

// The parameters a graph is built from: p itself (sink_rescale: vanilla, with statistics; with the
// padding mask for a bottom-right causal
// mask with max_seqlen_q > max_seqlen_kv, which cuDNN takes only so), or for THD p with the padding mask,
// max_seqlen of each THD side rounded up to a power of two (THD's max_seqlen changes from batch
// to batch: this bounds the number of graphs) and the run's batch (THD Q with BSHD/SBHD K/V: the
// call's batch, one run). They depend only on what the workspace queries see.
AttnParams graph_params(const AttnParams &p);

// Off-by-one / learnable softmax where cuDNN takes no sink token (paged caches, max_seqlen_q 1;
// BSHD/SBHD queries), forward only: the call runs the vanilla graph with statistics (graph_params)
// and scales each output row by 1 / (1 + exp(offset - lse)) afterwards, the share of the row's
// softmax that the visible keys keep beside the sink (fused_attn_sink.h).
bool sink_rescale(const AttnParams &p);

// Paged K/V caches: the pages a graph reads per sequence (cuDNN's page tables are [b, 1, pages, 1]);
// 0 for other layouts.
size_t graph_pages(const AttnParams &p);

// BSHD/SBHD calls with a padding mask whose graphs describe Q, K, V, O as ragged tensors (sequence
// b's first row at b * max_seqlen * row stride in BSHD, b * row stride in SBHD, whose rows keep
// their stride of batch * row stride): cuDNN then runs the kernels it runs for THD, which were
// faster than its padded ones for the same sequences (H100, b=4 h=32 d=128,
// lengths 2048/1536/1024/512: forward 0.323 vs 0.261 ms, causal 0.236 vs 0.177). Not for FP8
// (cuDNN's FP8 backward takes no ragged tensors on Hopper), bias or ALiBi (not taken with ragged
// tensors), paged caches, max_seqlen_q 1 (the decode kernel), the off-by-one / learnable softmax
// (cuDNN's ragged backward takes no sink token before 9.26) or offsets beyond int32.
bool ragged_padding(const AttnParams &p);

// THD queries over BSHD/SBHD K/V or a paged cache with max_seqlen_q 1 (a decode step), forward,
// float16/bfloat16, without dropout or max logit: such a call runs as BSHD queries [n, 1]
// (fused_attn_thd_decode.h), the graph for which cuDNN takes its decode kernel; decode_view is
// that call's parameters (Q and O BSHD [n, 1, h, d] scratch tensors, the padding mask; n the
// batch, or with a paged cache a chunk of sequences, and the page tables' used columns).
bool thd_decode(const AttnParams &p);
AttnParams decode_view(const AttnParams &p);

}  // namespace nvte::cuda::cudnn_attn
