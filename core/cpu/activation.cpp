// cpu/activation.cpp - CPU reference of the activations: row-parallel float32 loops that
// evaluate the shared formulas of activation_math.h and store through OutputRows (so FP8
// outputs get the fused quantize of cast.h).
#include "activation.h"

#include <type_traits>
#include <vector>

#include "parallel.h"
#include "rows.h"

namespace nvte::cpu {
namespace {

// Rows per parallel chunk: roughly 16K elements of work each.
size_t grain_rows(size_t cols) { return cols ? (16384 + cols - 1) / cols : 1024; }

}  // namespace

void activation(Act a, const Tensor *grad, const Tensor &in, Tensor &out) {
  const InputRows x = input_rows(in, "input");
  InputRows g;
  if (grad) g = input_rows(*grad, "grad");
  OutputRows dst(out, "output", x.rows, x.cols);
  const size_t cols = x.cols;
  with_act(a, [&](auto kAct) {
    parallel_for(cols ? x.rows : 0, grain_rows(cols), [&](size_t r0, size_t r1) {  // ([rows, 0]: no work)
      std::vector<float> xv(cols), gv(grad ? cols : 0);
      for (size_t r = r0; r < r1; ++r) {
        x.load(r, xv.data());
        if (grad) {
          g.load(r, gv.data());
          for (size_t j = 0; j < cols; ++j) xv[j] = gv[j] * dact_f(kAct, xv[j]);
        } else {
          for (size_t j = 0; j < cols; ++j) xv[j] = act_f(kAct, xv[j]);
        }
        dst.store(r, xv.data());
      }
    });
  });
  dst.finish();
}

void gated_activation(Act a, const Tensor *grad, const Tensor &in, Tensor &out) {
  const InputRows x = input_rows(in, "input");
  const size_t h = x.cols / 2;
  InputRows g;
  if (grad) g = input_rows(*grad, "grad");
  // Forward writes [rows, H]; backward writes the gradient of both halves, [rows, 2H].
  OutputRows dst(out, "output", x.rows, grad ? 2 * h : h);
  with_act(a, [&](auto kAct) {
    parallel_for(h ? x.rows : 0, grain_rows(x.cols), [&](size_t r0, size_t r1) {  // ([rows, 0]: no work)
      std::vector<float> xv(2 * h), gv(grad ? h : 0), ov(grad ? 2 * h : h);
      for (size_t r = r0; r < r1; ++r) {
        x.load(r, xv.data());
        const float *act_in = xv.data(), *gate = xv.data() + h;
        if (grad) {
          g.load(r, gv.data());
          for (size_t j = 0; j < h; ++j) {
            ov[j] = gv[j] * gate[j] * dact_f(kAct, act_in[j]);
            ov[h + j] = gv[j] * act_f(kAct, act_in[j]);
          }
        } else {
          for (size_t j = 0; j < h; ++j) ov[j] = act_f(kAct, act_in[j]) * gate[j];
        }
        dst.store(r, ov.data());
      }
    });
  });
  dst.finish();
}

}  // namespace nvte::cpu
