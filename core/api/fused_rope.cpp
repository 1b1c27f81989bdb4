// api/fused_rope.cpp - nvte_fused_rope_{forward,backward}: validate the geometry of fused_rope.h
// once (rope::RopeParams), pick the backend, run the shared per-element rule.
#include "transformer_engine/fused_rope.h"

#include "../common/backend.h"
#include "../common/rope.h"
#include "../cpu/fused_rope.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/fused_rope.h"
#endif

using namespace nvte;
using rope::RopeParams;

namespace {

struct RopeCall {
  NVTETensor x, cu_seqlens, freqs, start_positions, y;  // x read at strides, y written dense
  const char *x_name, *y_name;
};

RopeParams validate(const RopeCall &c, NVTE_QKV_Format fmt, bool interleaved, bool backward, int cp_size,
                    int cp_rank, int s, int b, int h, int d, int d2, int stride_t, int stride_b, int stride_h,
                    int stride_d) {
  NVTE_CHECK(fmt == NVTE_SBHD || fmt == NVTE_BSHD || fmt == NVTE_THD,
             "qkv_format must be NVTE_SBHD, NVTE_BSHD or NVTE_THD, got ", (int)fmt);
  NVTE_CHECK(cp_size >= 1 && cp_rank >= 0 && cp_rank < cp_size, "context parallelism needs cp_size >= 1 and 0 <= "
             "cp_rank < cp_size, got cp_size ", cp_size, ", cp_rank ", cp_rank);
  if (cp_size > 1 && present(c.start_positions))
    NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, "start_positions (inference) with context parallelism (cp_size ", cp_size,
              ") is not supported");
  const Tensor &x = require(c.x, c.x_name);
  Tensor &y = require_mut(c.y, c.y_name);
  const NVTEDType dt = logical_dtype(x);
  NVTE_CHECK(is_high_precision(dt), c.x_name, " must be float32, float16 or bfloat16, got ", dtype_name(dt));
  NVTE_CHECK(logical_dtype(y) == dt, c.y_name, " has dtype ", dtype_name(logical_dtype(y)), "; expected ",
             c.x_name, "'s ", dtype_name(dt));
  NVTE_CHECK(h >= 1 && d >= 1 && s >= 0 && b >= 0, "sizes must be s >= 0, b >= 0, h >= 1, d >= 1; got s ", s,
             ", b ", b, ", h ", h, ", d ", d);
  NVTE_CHECK(d2 >= 2 && d2 % 2 == 0 && d2 <= d, "d2 (freqs' last dim) must be even, >= 2 and <= d (", d,
             "), got ", d2);
  NVTE_CHECK(stride_t >= 0 && stride_b >= 0 && stride_h >= 0 && stride_d >= 0, "strides must be >= 0, got ",
             stride_t, ", ", stride_b, ", ", stride_h, ", ", stride_d);
  RopeParams p;
  p.thd = fmt == NVTE_THD;
  p.bshd = fmt == NVTE_BSHD;
  p.interleaved = interleaved;
  p.backward = backward;
  p.b = b, p.h = h, p.d = d, p.d2 = d2;
  p.cp_size = cp_size, p.cp_rank = cp_rank;
  p.stride_t = stride_t, p.stride_b = p.thd ? 0 : stride_b, p.stride_h = stride_h, p.stride_d = stride_d;
  const NVTEShape ys = logical_shape(y);
  if (p.thd) {
    NVTE_CHECK(ys.ndim == 3 && ys.data[1] == (size_t)h && ys.data[2] == (size_t)d, c.y_name, " has shape ",
               shape_str(ys), "; expected [t, ", h, ", ", d, "] (THD)");
    p.rows = (int64_t)ys.data[0];
    p.s = p.rows;
    const Tensor &cu = require(c.cu_seqlens, "cu_seqlens");
    NVTE_CHECK(buffer_set(cu.params[kNVTERowwiseData]), "cu_seqlens needs rowwise data");
    const NVTEShape cs = logical_shape(cu);
    NVTE_CHECK(logical_dtype(cu) == kNVTEInt32 && cs.ndim == 1 && cs.data[0] == (size_t)b + 1,
               "cu_seqlens must be int32 [b + 1] = [", b + 1, "] for THD, got ", dtype_name(logical_dtype(cu)), " ",
               shape_str(cs));
  } else {
    p.s = s;
    NVTE_CHECK(cp_size == 1 || s % 2 == 0, "with context parallelism (cp_size ", cp_size,
               ") each rank holds two equal chunks of every sequence, so s must be even; got s ", s);
    const size_t want[4] = {(size_t)(p.bshd ? b : s), (size_t)(p.bshd ? s : b), (size_t)h, (size_t)d};
    NVTE_CHECK(ys.ndim == 4 && ys.data[0] == want[0] && ys.data[1] == want[1] && ys.data[2] == want[2] &&
                   ys.data[3] == want[3],
               c.y_name, " has shape ", shape_str(ys), "; expected [", want[0], ", ", want[1], ", ", want[2], ", ",
               want[3], "] (", p.bshd ? "BSHD" : "SBHD", ")");
    p.rows = (int64_t)s * b;
  }
  if (p.rows > 0) {  // the strided reads stay inside x's buffer (empty tensors may have no buffer)
    NVTE_CHECK(buffer_set(x.params[kNVTERowwiseData]) && buffer_set(y.params[kNVTERowwiseData]), c.x_name,
               " and ", c.y_name, " need rowwise data");
    // (128-bit: a THD row count comes from a size_t shape, and rows x stride can pass 2^64)
    using u128 = unsigned __int128;
    const u128 last = (p.thd ? (u128)(p.rows - 1) * (u128)p.stride_t
                             : (u128)(s - 1) * (u128)p.stride_t + (u128)(b - 1) * (u128)p.stride_b) +
                      (u128)(h - 1) * (u128)stride_h + (u128)(d - 1) * (u128)stride_d;
    const size_t n = numel(logical_shape(x));
    NVTE_CHECK(last < (u128)n, c.x_name, " has ", n, " elements but its strides reach element ",
               last > (u128)UINT64_MAX ? std::string("2^64 or beyond") : std::to_string((uint64_t)last));
  }
  const Tensor &f = require(c.freqs, "freqs");
  const NVTEShape fs = logical_shape(f);
  NVTE_CHECK(logical_dtype(f) == kNVTEFloat32 && fs.ndim >= 1 && fs.data[fs.ndim - 1] == (size_t)d2,
             "freqs must be float32 with last dim d2 = ", d2, ", got ", dtype_name(logical_dtype(f)), " ",
             shape_str(fs));
  p.freq_rows = (int64_t)(numel(fs) / (size_t)d2);
  NVTE_CHECK(buffer_set(f.params[kNVTERowwiseData]), "freqs needs rowwise data");
  if (present(c.start_positions)) {
    const Tensor &sp = require(c.start_positions, "start_positions");
    NVTE_CHECK(buffer_set(sp.params[kNVTERowwiseData]), "start_positions needs rowwise data");
    const NVTEShape ss = logical_shape(sp);
    NVTE_CHECK(logical_dtype(sp) == kNVTEInt32 && ss.ndim == 1 && ss.data[0] == (size_t)b,
               "start_positions must be int32 [b] = [", b, "], got ", dtype_name(logical_dtype(sp)), " ",
               shape_str(ss));
  }
  return p;
}

void run(const char *op, const RopeCall &c, NVTE_QKV_Format fmt, bool interleaved, bool backward, int cp_size,
         int cp_rank, int s, int b, int h, int d, int d2, int st, int sb, int sh, int sd, cudaStream_t stream) {
  const RopeParams p = validate(c, fmt, interleaved, backward, cp_size, cp_rank, s, b, h, d, d2, st, sb, sh, sd);
  const Tensor &x = require(c.x, c.x_name);
  Tensor &y = require_mut(c.y, c.y_name);
  const Tensor &f = require(c.freqs, "freqs");
  const Tensor *cu = p.thd ? &require(c.cu_seqlens, "cu_seqlens") : nullptr;
  const Tensor *start = present(c.start_positions) ? &require(c.start_positions, "start_positions") : nullptr;
  switch (backend_of({{c.x_name, c.x},
                      {"cu_seqlens", p.thd ? c.cu_seqlens : nullptr},
                      {"freqs", c.freqs},
                      {"start_positions", c.start_positions},
                      {c.y_name, c.y}})) {
    case Backend::CPU: return cpu::fused_rope(p, x, cu, f, start, y);
    case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
      return cuda::fused_rope(p, x, cu, f, start, y, stream);
#else
      cuda_not_built(op);
#endif
  }
}

}  // namespace

extern "C" {

NVTEStatus nvte_fused_rope_forward(const NVTETensor input, const NVTETensor cu_seqlens, const NVTETensor freqs,
                                   const NVTETensor start_positions, NVTETensor output, NVTE_QKV_Format qkv_format,
                                   bool interleaved, int cp_size, int cp_rank, int s, int b, int h, int d, int d2,
                                   int stride_s_or_t, int stride_b, int stride_h, int stride_d, cudaStream_t stream) {
  const char *op = "nvte_fused_rope_forward";
  return api_call(op, [&] {
    run(op, {input, cu_seqlens, freqs, start_positions, output, "input", "output"}, qkv_format, interleaved, false,
        cp_size, cp_rank, s, b, h, d, d2, stride_s_or_t, stride_b, stride_h, stride_d, stream);
  });
}

NVTEStatus nvte_fused_rope_backward(const NVTETensor output_grads, const NVTETensor cu_seqlens,
                                    const NVTETensor freqs, const NVTETensor start_positions, NVTETensor input_grads,
                                    NVTE_QKV_Format qkv_format, bool interleaved, int cp_size, int cp_rank, int s,
                                    int b, int h, int d, int d2, int stride_s_or_t, int stride_b, int stride_h,
                                    int stride_d, cudaStream_t stream) {
  const char *op = "nvte_fused_rope_backward";
  return api_call(op, [&] {
    run(op, {output_grads, cu_seqlens, freqs, start_positions, input_grads, "output_grads", "input_grads"},
        qkv_format, interleaved, true, cp_size, cp_rank, s, b, h, d, d2, stride_s_or_t, stride_b, stride_h, stride_d,
        stream);
  });
}

}  // extern "C"
