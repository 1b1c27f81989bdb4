/* A C caller sees failures as statuses with messages, never as a crash. */
#include <stdio.h>
#include <string.h>

#include <transformer_engine/cast.h>
#include <transformer_engine/transformer_engine.h>

static int failures = 0;

static void expect(int cond, const char *what) {
  printf("%s %s\n", cond ? "ok  " : "FAIL", what);
  if (!cond) ++failures;
}

int main(void) {
  float x[6] = {1, 2, 3, 4, 5, 6};
  unsigned char q[6];
  float scale = 1.0f, amax = 0.0f, scale_inv = 0.0f;
  size_t dims[2] = {2, 3};
  NVTETensor in = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  NVTETensor out = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  NVTEBasicTensor b;

  expect(nvte_get_version() == NVTE_VERSION, "library version matches the header");

  /* Null data pointer with a non-empty shape. */
  b.data_ptr = NULL; b.dtype = kNVTEFloat32; b.shape = nvte_make_shape(dims, 2);
  nvte_set_tensor_param(&in, kNVTERowwiseData, &b);
  b.data_ptr = q; b.dtype = kNVTEFloat8E4M3;
  nvte_set_tensor_param(&out, kNVTERowwiseData, &b);
  {
    NVTEStatus s = nvte_quantize(in, out, NULL);
    expect(s == NVTE_ERROR_INVALID_ARGUMENT, "null input data -> NVTE_ERROR_INVALID_ARGUMENT");
    expect(strstr(nvte_get_last_error(), "nvte_quantize") != NULL, "message names the op");
    expect(strstr(nvte_get_last_error(), "NULL") != NULL, "message names the null pointer");
  }

  /* FP8 output without a scale. */
  b.data_ptr = x; b.dtype = kNVTEFloat32;
  nvte_set_tensor_param(&in, kNVTERowwiseData, &b);
  expect(nvte_quantize(in, out, NULL) == NVTE_ERROR_INVALID_ARGUMENT, "FP8 output without scale is rejected");
  expect(strstr(nvte_get_last_error(), "scale") != NULL, "message mentions the scale");

  /* A correct call succeeds after the failures. */
  b.data_ptr = &scale; b.dtype = kNVTEFloat32; b.shape = nvte_make_shape(dims, 1); b.shape.data[0] = 1;
  nvte_set_tensor_param(&out, kNVTEScale, &b);
  b.data_ptr = &amax; nvte_set_tensor_param(&out, kNVTEAmax, &b);
  b.data_ptr = &scale_inv; nvte_set_tensor_param(&out, kNVTERowwiseScaleInv, &b);
  expect(nvte_quantize(in, out, NULL) == NVTE_SUCCESS, "valid quantize succeeds");
  expect(amax == 6.0f && scale_inv == 1.0f && q[0] == 0x38 /* 1.0 in E4M3 */, "results are written");

  /* NULL handles. */
  expect(nvte_quantize(NULL, out, NULL) == NVTE_ERROR_INVALID_ARGUMENT, "NULL input handle is rejected");

  nvte_destroy_tensor(in);
  nvte_destroy_tensor(out);
  printf("%d passed, %d failed\n", 9 - failures, failures);
  return failures != 0;
}
