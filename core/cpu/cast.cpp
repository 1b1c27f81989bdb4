// cpu/cast.cpp - CPU reference of quantize / dequantize: row-parallel float32 loops.
#include "cast.h"

#include <vector>

#include "parallel.h"
#include "rows.h"

namespace nvte::cpu {

void quantize(const Tensor &in, Tensor &out) {
  const InputRows src = input_rows(in, "input");
  OutputRows dst(out, "output", src.rows, src.cols);
  parallel_for(src.rows, 64, [&](size_t r0, size_t r1) {
    std::vector<float> row(src.cols);
    for (size_t r = r0; r < r1; ++r) {
      src.load(r, row.data());
      dst.store(r, row.data());
    }
  });
  dst.finish();
}

void dequantize(const Tensor &in, Tensor &out) {
  const InputRows src = input_rows(in, "input");
  NVTE_CHECK(is_high_precision(logical_dtype(out)), "output must be float32, float16 or bfloat16, got ",
             dtype_name(logical_dtype(out)));
  OutputRows dst(out, "output", src.rows, src.cols);
  parallel_for(src.rows, 64, [&](size_t r0, size_t r1) {
    std::vector<float> row(src.cols);
    for (size_t r = r0; r < r1; ++r) {
      src.load(r, row.data());
      dst.store(r, row.data());
    }
  });
  dst.finish();
}

}  // namespace nvte::cpu
