// cpu/cast.h - CPU reference of the quantize / dequantize family (cast.h) and the
// fused activation-backward + quantize + dbias ops (shared with transpose.h's dbias ops).
#pragma once

#include <cstddef>
#include <functional>
#include <optional>

#include "../common/activation_math.h"
#include "../common/tensor.h"

namespace nvte::cpu {

// Produces row r of a result (cols float32 values). Called concurrently for distinct rows.
using RowFn = std::function<void(size_t r, float *row)>;

// Stores the rows made by fill into every layout out has (rule of cast.h): rowwise
// directly, columnwise as a blocked transpose of the rowwise bytes (a scratch buffer
// stands in for a missing rowwise layout), so both layouts hold identical values.
void write_output(Tensor &out, size_t rows, size_t cols, const RowFn &fill);

// out = quantize(in) into out's rowwise and/or columnwise layouts.
void quantize(const Tensor &in, Tensor &out);

// out = float(in) * in.scale_inv; in may hold only columnwise data.
void dequantize(const Tensor &in, Tensor &out);

// g = in * dact(act_in) in float32 (g = in when act is empty); out = quantize(g) in all
// of out's layouts; dbias[j] = sum over i = 0, 1, ... of g[i, j], accumulated in float32
// in that fixed row order (independent of the thread count), stored in dbias's dtype.
// Shapes and dtypes are checked by the API layer.
void quantize_dbias(const Tensor &in, const Tensor *act_in, std::optional<Act> act, Tensor &out,
                    Tensor &dbias);

}  // namespace nvte::cpu
