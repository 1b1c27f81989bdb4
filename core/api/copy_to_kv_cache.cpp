// api/copy_to_kv_cache.cpp - nvte_copy_to_kv_cache (fused_attn.h): validate the shapes once
// (kv_cache::CopyParams), pick the backend, place the rows by the shared rule.
#include "transformer_engine/fused_attn.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "../common/backend.h"
#include "../common/kv_cache.h"
#include "alias_checks.h"
#include "../cpu/copy_to_kv_cache.h"
#ifdef NVTE_WITH_CUDA
#include "../cuda/copy_to_kv_cache.h"
#endif

using namespace nvte;
using kv_cache::CopyParams;
using kv_cache::Format;

namespace {

// A 1-D int32 tensor of at least n elements.
void check_int32_vector(const Tensor &t, const char *name, size_t n) {
  const NVTEShape s = logical_shape(t);
  NVTE_CHECK(logical_dtype(t) == kNVTEInt32 && s.ndim == 1 && s.data[0] >= n, name, " must be int32 [>= ", n,
             "], got ", dtype_name(logical_dtype(t)), " ", shape_str(s));
}

CopyParams validate(const Tensor &nk, const Tensor &nv, const Tensor &kc, const Tensor &vc, const Tensor *table,
                    const Tensor &cu_new, const Tensor &cu_cached, NVTE_QKV_Format fmt, int b, int max_ctx_len,
                    int max_seq_len, int max_pages_per_seq, bool paged) {
  NVTE_CHECK(fmt == NVTE_BSHD || fmt == NVTE_SBHD || fmt == NVTE_THD,
             "qkv_format must be NVTE_BSHD, NVTE_SBHD or NVTE_THD, got ", (int)fmt);
  NVTE_CHECK(b >= 0 && max_ctx_len >= 0 && max_seq_len >= 1, "need b >= 0, max_ctx_len >= 0, max_seq_len >= 1; got ",
             b, ", ", max_ctx_len, ", ", max_seq_len);
  const NVTEDType dt = logical_dtype(kc);
  for (const auto &[t, name] : {std::pair{&nk, "new_k"}, std::pair{&nv, "new_v"}, std::pair{&vc, "v_cache"}})
    NVTE_CHECK(logical_dtype(*t) == dt, name, " has dtype ", dtype_name(logical_dtype(*t)), "; k_cache has ",
               dtype_name(dt), " (rows are copied byte for byte)");
  const NVTEShape ks = logical_shape(kc), vs = logical_shape(vc);
  NVTE_CHECK(ks.ndim == 4 && vs.ndim == 4 && ks.data[0] == vs.data[0] && ks.data[1] == vs.data[1] &&
                 ks.data[2] == vs.data[2],
             "k_cache / v_cache must be [pages or slots, page_size or max_seq_len, h, d] with the same first three "
             "dims, got ", shape_str(ks), " and ", shape_str(vs));
  const size_t h = ks.data[2], dk = ks.data[3], dv = vs.data[3];
  CopyParams p;
  p.format = fmt == NVTE_BSHD ? Format::BSHD : (fmt == NVTE_SBHD ? Format::SBHD : Format::THD);
  p.paged = paged;
  p.b = b;
  p.max_ctx_len = max_ctx_len;
  p.pages = (int64_t)ks.data[0];
  p.page_size = (int64_t)ks.data[1];
  for (const auto &[t, name, d] : {std::tuple{&nk, "new_k", dk}, std::tuple{&nv, "new_v", dv}}) {
    const NVTEShape s = logical_shape(*t);
    if (p.format == Format::THD) {
      NVTE_CHECK(s.ndim == 3 && s.data[1] == h && s.data[2] == d, name, " has shape ", shape_str(s),
                 "; expected [t, ", h, ", ", d, "] (THD, the cache's heads and head dim)");
    } else {
      const size_t b0 = p.format == Format::BSHD ? (size_t)b : (size_t)max_ctx_len;
      const size_t b1 = p.format == Format::BSHD ? (size_t)max_ctx_len : (size_t)b;
      NVTE_CHECK(s.ndim == 4 && s.data[0] == b0 && s.data[1] == b1 && s.data[2] == h && s.data[3] == d, name,
                 " has shape ", shape_str(s), "; expected [", b0, ", ", b1, ", ", h, ", ", d, "] (",
                 p.format == Format::BSHD ? "BSHD [b, max_ctx_len" : "SBHD [max_ctx_len, b",
                 ", h, d] with the cache's heads and head dim)");
    }
  }
  p.rows_in = p.format == Format::THD ? (int64_t)logical_shape(nk).data[0] : (int64_t)b * max_ctx_len;
  NVTE_CHECK(p.format != Format::THD || logical_shape(nv).data[0] == (size_t)p.rows_in, "new_k has ", p.rows_in,
             " rows but new_v ", logical_shape(nv).data[0]);
  const size_t es = dtype_size(dt);
  p.k_row_bytes = (int64_t)(h * dk * es);
  p.v_row_bytes = (int64_t)(h * dv * es);
  check_int32_vector(cu_new, "cu_new_lens", (size_t)b + 1);
  check_int32_vector(cu_cached, "cu_cached_lens", (size_t)b + 1);
  if (paged) {
    NVTE_CHECK(table != nullptr, "a paged cache (is_non_paged 0) needs page_table");
    NVTE_CHECK(max_pages_per_seq >= 1, "max_pages_per_seq must be >= 1, got ", max_pages_per_seq);
    p.pages_per_seq = max_pages_per_seq;
    p.capacity = std::min<int64_t>(max_seq_len, (int64_t)max_pages_per_seq * p.page_size);
  } else {
    NVTE_CHECK(max_seq_len <= p.page_size, "max_seq_len (", max_seq_len, ") exceeds the non-paged caches' ",
               p.page_size, " rows per slot");
    p.capacity = max_seq_len;
  }
  // the caches are written: they must share no memory with each other or with what is read
  const std::pair<const Tensor *, const char *> others[] = {{&vc, "v_cache"}, {&nk, "new_k"}, {&nv, "new_v"},
                                                            {table, "page_table"}, {&cu_new, "cu_new_lens"},
                                                            {&cu_cached, "cu_cached_lens"}};
  for (const auto &[w, wn] : {std::pair{&kc, "k_cache"}, std::pair{&vc, "v_cache"}})
    for (const auto &[o, on] : others)
      NVTE_CHECK(o == nullptr || o == w || !api::bytes_overlap(*w, *o), wn, " shares memory with ", on);
  if (table != nullptr) {
    const NVTEShape ts = logical_shape(*table);
    const size_t cols = paged ? (size_t)max_pages_per_seq : (ts.ndim == 2 ? std::max<size_t>(ts.data[1], 1) : 1);
    NVTE_CHECK(logical_dtype(*table) == kNVTEInt32 && ts.ndim == 2 && ts.data[0] >= (size_t)b && ts.data[1] == cols &&
                   cols >= 1,
               "page_table must be int32 [>= b, ", paged ? "max_pages_per_seq" : "slots column", "] = [>= ", b, ", ",
               cols, "], got ", dtype_name(logical_dtype(*table)), " ", shape_str(ts));
    p.has_table = true;
    p.pages_per_seq = (int64_t)cols;
  }
  return p;  // (require() has rejected handles whose shape has elements but whose data pointer is null)
}

}  // namespace

extern "C" NVTEStatus nvte_copy_to_kv_cache(NVTETensor new_k, NVTETensor new_v, NVTETensor k_cache,
                                            NVTETensor v_cache, NVTETensor page_table, NVTETensor cu_new_lens,
                                            NVTETensor cu_cached_lens, NVTE_QKV_Format qkv_format, int b,
                                            int max_ctx_len, int max_seq_len, int max_pages_per_seq,
                                            int is_non_paged, cudaStream_t stream) {
  const char *op = "nvte_copy_to_kv_cache";
  return api_call(op, [&] {
    const Tensor &nk = require(new_k, "new_k"), &nv = require(new_v, "new_v");
    Tensor &kc = require_mut(k_cache, "k_cache"), &vc = require_mut(v_cache, "v_cache");
    const Tensor &cn = require(cu_new_lens, "cu_new_lens"), &cc = require(cu_cached_lens, "cu_cached_lens");
    const Tensor *table = present(page_table) ? &require(page_table, "page_table") : nullptr;
    for (const auto &[t, name] : {std::pair{&nk, "new_k"}, std::pair{&nv, "new_v"}, std::pair{&cn, "cu_new_lens"},
                                  std::pair{&cc, "cu_cached_lens"}, std::pair{table, "page_table"},
                                  std::pair<const Tensor *, const char *>{&kc, "k_cache"}, {&vc, "v_cache"}})
      NVTE_CHECK(t == nullptr || buffer_set(t->params[kNVTERowwiseData]), name, " needs rowwise data");
    const CopyParams p = validate(nk, nv, kc, vc, table, cn, cc, qkv_format, b, max_ctx_len, max_seq_len,
                                  max_pages_per_seq, is_non_paged == 0);
    const Backend where = backend_of({{"new_k", new_k},
                                      {"new_v", new_v},
                                      {"k_cache", k_cache},
                                      {"v_cache", v_cache},
                                      {"page_table", table ? page_table : nullptr},
                                      {"cu_new_lens", cu_new_lens},
                                      {"cu_cached_lens", cu_cached_lens}});
    if (p.b == 0 || p.rows_in == 0) return;
    switch (where) {
      case Backend::CPU: return cpu::copy_to_kv_cache(p, nk, nv, kc, vc, table, cn, cc);
      case Backend::CUDA:
#ifdef NVTE_WITH_CUDA
        return cuda::copy_to_kv_cache(p, nk, nv, kc, vc, table, cn, cc, stream);
#else
        cuda_not_built(op);
#endif
    }
  });
}
