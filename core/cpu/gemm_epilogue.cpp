// cpu/gemm_epilogue.cpp - cpu::gemm: the float32 product (gemm.cpp) followed by one
// row pass applying alpha/beta, bias, GELU / dGELU and the output rule (cpu::OutputRows).
#include <algorithm>
#include <memory>
#include <vector>

#include "../common/activation_math.h"
#include "gemm.h"
#include "parallel.h"
#include "rows.h"

namespace nvte::cpu {
namespace {

// Rows per epilogue block. Fixed (not tied to the thread count) so the column sums of
// the dGELU bias gradient add up in the same order on every machine.
constexpr size_t kRowBlock = 32;

std::vector<float> read_vector(const Tensor &t, const char *name, size_t len) {
  std::vector<float> v(len);
  const InputRows in = input_rows(t, name);
  NVTE_CHECK(in.rows * in.cols == len, name, " has ", in.rows * in.cols, " elements; expected ", len);
  if (len) load_row(in.data, in.dtype, 0, len, v.data());
  if (in.scale_inv != 1.0f)
    for (float &x : v) x *= in.scale_inv;
  return v;
}

void write_vector(Tensor &t, const char *name, const std::vector<float> &v) {
  OutputRows out(t, name, 1, v.size());
  if (!v.empty()) out.store(0, v.data());
  out.finish();
}

}  // namespace

void gemm(const GemmProblem &p) {
  const size_t n = p.x.rows, m = p.y.cols;
  OutputRows out(*p.d, "D", n, m);
  std::unique_ptr<OutputRows> aux_out;
  std::unique_ptr<InputRows> aux_in, c_in;
  if (p.gelu) aux_out = std::make_unique<OutputRows>(*p.aux, "pre_gelu_out", n, m);
  if (p.dgelu) aux_in = std::make_unique<InputRows>(input_rows(*p.aux, "pre_gelu_out"));
  if (p.beta != 0.0f) c_in = std::make_unique<InputRows>(input_rows(*p.c, "C"));
  std::vector<float> bias;
  if (p.bias) bias = read_vector(*p.bias, "bias", m);

  // The product goes straight into a float32 D unless D's old values are still needed.
  const NVTEBasicTensor &drow = p.d->params[kNVTERowwiseData];
  const bool direct = drow.data_ptr != nullptr && drow.dtype == kNVTEFloat32 &&
                      p.d->params[kNVTEColumnwiseData].data_ptr == nullptr && p.beta == 0.0f;
  static thread_local AlignedBuf scratch;
  float *acc = direct ? static_cast<float *>(drow.data_ptr) : scratch.get(n * m);
  matmul_f32(p.x, p.y, acc, m);

  const bool dbias_cols = p.dbias && p.dgelu;
  const bool trivial = direct && p.alpha == 1.0f && !p.bias && !p.gelu && !p.dgelu &&
                       p.d->params[kNVTEAmax].data_ptr == nullptr;
  const size_t blocks = (n + kRowBlock - 1) / kRowBlock;
  std::vector<float> colsum(dbias_cols ? blocks * m : 0, 0.0f);
  if (!trivial) {
    const size_t grain = n * m < (size_t(1) << 15) ? std::max<size_t>(blocks, 1) : 1;
    parallel_for(blocks, grain, [&](size_t b0, size_t b1) {
      std::vector<float> tmp(m);
      for (size_t b = b0; b < b1; ++b) {
        float *sums = dbias_cols ? colsum.data() + b * m : nullptr;
        for (size_t i = b * kRowBlock; i < std::min(n, (b + 1) * kRowBlock); ++i) {
          float *v = acc + i * m;
          if (p.alpha != 1.0f)
            for (size_t j = 0; j < m; ++j) v[j] *= p.alpha;
          if (c_in) {
            c_in->load(i, tmp.data());
            for (size_t j = 0; j < m; ++j) v[j] += p.beta * tmp[j];
          }
          if (!bias.empty())
            for (size_t j = 0; j < m; ++j) v[j] += bias[j];
          if (aux_out) {
            aux_out->store(i, v);  // pre-activation in the aux dtype; D uses the float32 value
            for (size_t j = 0; j < m; ++j) v[j] = gelu_f(v[j]);
          }
          if (aux_in) {
            aux_in->load(i, tmp.data());
            for (size_t j = 0; j < m; ++j) v[j] *= dgelu_f(tmp[j]);
          }
          if (sums)
            for (size_t j = 0; j < m; ++j) sums[j] += v[j];
          out.store(i, v);
        }
      }
    });
  }
  out.finish();
  if (aux_out) aux_out->finish();
  scratch.trim();

  if (dbias_cols) {
    std::vector<float> db(m, 0.0f);
    for (size_t b = 0; b < blocks; ++b)
      for (size_t j = 0; j < m; ++j) db[j] += colsum[b * m + j];
    write_vector(*p.dbias, "bias", db);
  } else if (p.dbias) {
    std::vector<float> db(n);
    row_sums(p.x, db.data());
    write_vector(*p.dbias, "bias", db);
  }
}

}  // namespace nvte::cpu
