// cuda/copy_to_kv_cache.cu - the K/V-cache write of one generation step on the GPU.
//
// Design: one block per row of new_k / new_v (one token: h x d_k and h x d_v elements). Each
// thread of it finds the token's sequence itself (THD: thd_rows.h's binary search of cu_new_lens;
// no shared memory, no barrier), maps the position to its cache row with
// core/common/kv_cache.h's rule, shared with the CPU reference, and the block copies the K row and
// the V row in 16-byte units where both rows and all four buffers allow (else 4, 2 or 1 bytes).
// One launch writes K and V for every sequence: the PyTorch adapter's decode step used two
// index_copy_ calls and an index upload for this before. Padding rows of BSHD/SBHD inputs (past a
// sequence's new tokens) exit at once.
#include "common.cuh"
#include "copy_to_kv_cache.h"

#include "../common/thd_rows.h"

namespace nvte::cuda {
namespace {

constexpr int kThreads = 128;

template <class U>
__global__ void __launch_bounds__(kThreads)
    copy_kernel(kv_cache::CopyParams p, const char *__restrict__ nk, const char *__restrict__ nv,
                char *__restrict__ kc, char *__restrict__ vc, const int32_t *__restrict__ table,
                const int32_t *__restrict__ cn, const int32_t *__restrict__ cc) {
  const int64_t r = blockIdx.x;
  int64_t seq, j;
  if (p.format == kv_cache::Format::THD) {
    seq = thd_sequence_of_row(cn, p.b, r);
    if (seq < 0) return;  // a row of no sequence
    j = r - cn[seq];
  } else {
    kv_cache::dense_token(p, r, seq, j);
  }
  const int64_t n = (int64_t)cn[seq + 1] - cn[seq], c = (int64_t)cc[seq + 1] - cc[seq];
  if (j < 0 || j >= n || c < n) return;  // a padding row, a THD row of no sequence, or bad lengths
  if (p.format != kv_cache::Format::THD && n > p.max_ctx_len) return;
  const int64_t row = kv_cache::cache_row(p, table, seq, c - n + j);
  if (row < 0) return;
  const int64_t ku = p.k_row_bytes / (int64_t)sizeof(U), vu = p.v_row_bytes / (int64_t)sizeof(U);
  const U *ks = reinterpret_cast<const U *>(nk) + r * ku, *vs = reinterpret_cast<const U *>(nv) + r * vu;
  U *kd = reinterpret_cast<U *>(kc) + row * ku, *vd = reinterpret_cast<U *>(vc) + row * vu;
  for (int64_t i = threadIdx.x; i < ku; i += kThreads) kd[i] = ks[i];
  for (int64_t i = threadIdx.x; i < vu; i += kThreads) vd[i] = vs[i];
}

// The widest unit (16, 4, 2 or 1 bytes) that divides both row sizes and aligns all four buffers.
int unit_bytes(const kv_cache::CopyParams &p, std::initializer_list<const void *> ptrs) {
  for (int u : {16, 4, 2}) {
    bool ok = p.k_row_bytes % u == 0 && p.v_row_bytes % u == 0;
    for (const void *ptr : ptrs) ok = ok && reinterpret_cast<uintptr_t>(ptr) % u == 0;
    if (ok) return u;
  }
  return 1;
}

}  // namespace

void copy_to_kv_cache(const kv_cache::CopyParams &p, const Tensor &new_k, const Tensor &new_v, Tensor &k_cache,
                      Tensor &v_cache, const Tensor *page_table, const Tensor &cu_new_lens,
                      const Tensor &cu_cached_lens, cudaStream_t stream) {
  const auto ptr = [](const Tensor &t) { return t.params[kNVTERowwiseData].data_ptr; };
  const char *nk = static_cast<const char *>(ptr(new_k)), *nv = static_cast<const char *>(ptr(new_v));
  char *kc = static_cast<char *>(ptr(k_cache)), *vc = static_cast<char *>(ptr(v_cache));
  const int32_t *table = page_table ? static_cast<const int32_t *>(ptr(*page_table)) : nullptr;
  const int32_t *cn = static_cast<const int32_t *>(ptr(cu_new_lens));
  const int32_t *cc = static_cast<const int32_t *>(ptr(cu_cached_lens));
  NVTE_CHECK(p.rows_in <= 0x7fffffff, "new_k has ", p.rows_in, " rows; at most 2^31 - 1 per call on the GPU");
  const dim3 grid((unsigned)p.rows_in);
  switch (unit_bytes(p, {nk, nv, kc, vc})) {
    case 16: copy_kernel<uint4><<<grid, kThreads, 0, stream>>>(p, nk, nv, kc, vc, table, cn, cc); break;
    case 4: copy_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(p, nk, nv, kc, vc, table, cn, cc); break;
    case 2: copy_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(p, nk, nv, kc, vc, table, cn, cc); break;
    default: copy_kernel<char><<<grid, kThreads, 0, stream>>>(p, nk, nv, kc, vc, table, cn, cc); break;
  }
  NVTE_CHECK_LAUNCH();
}

}  // namespace nvte::cuda
