/*
 * A C program linking libtransformer_engine.so: quantize two float32 matrices to FP8
 * (E4M3), multiply them with nvte_cublas_gemm (TN, float32 output), then LayerNorm the
 * result, all on host (CPU) data. Checks the result against a float64 computation on the
 * FP8-decoded inputs and exits non-zero on any failure.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <transformer_engine/cast.h>
#include <transformer_engine/gemm.h>
#include <transformer_engine/normalization.h>
#include <transformer_engine/transformer_engine.h>

#define M 33 /* tokens */
#define K 64 /* in features */
#define N 48 /* out features */

#define CHECK(call)                                                                       \
  do {                                                                                    \
    NVTEStatus s_ = (call);                                                               \
    if (s_ != NVTE_SUCCESS) {                                                             \
      fprintf(stderr, "%s failed (status %d): %s\n", #call, (int)s_, nvte_get_last_error()); \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

/* Wraps one buffer in a new handle. */
static NVTETensor make(void *data, NVTEDType dtype, size_t d0, size_t d1) {
  size_t dims[2] = {d0, d1};
  NVTETensor t = nvte_create_tensor(NVTE_DELAYED_TENSOR_SCALING);
  NVTEBasicTensor b;
  b.data_ptr = data;
  b.dtype = dtype;
  b.shape = nvte_make_shape(dims, d1 ? 2 : 1);
  nvte_set_tensor_param(&t, kNVTERowwiseData, &b);
  return t;
}

static void set_scalar(NVTETensor t, NVTETensorParam p, float *v) {
  size_t one = 1;
  NVTEBasicTensor b;
  b.data_ptr = v;
  b.dtype = kNVTEFloat32;
  b.shape = nvte_make_shape(&one, 1);
  nvte_set_tensor_param(&t, p, &b);
}

/* Decodes E4M3 bits (sign, 4-bit exponent with bias 7, 3-bit mantissa). */
static double e4m3(unsigned char v) {
  int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
  double mag = e ? ldexp(1.0 + m / 8.0, e - 7) : ldexp(m / 8.0, -6);
  return s ? -mag : mag;
}

int main(void) {
  static float x[M * K], w[N * K], y[M * N], z[M * N], gamma[N], beta[N], mu[M], rsigma[M];
  static unsigned char xq[M * K], wq[N * K];
  float x_scale = 4.0f, w_scale = 64.0f, x_amax = 0, w_amax = 0, x_sinv = 0, w_sinv = 0;
  int i, j, k, failures = 0;
  double max_err = 0;

  srand(1234);
  for (i = 0; i < M * K; ++i) x[i] = (float)rand() / RAND_MAX * 4.0f - 2.0f;
  for (i = 0; i < N * K; ++i) w[i] = ((float)rand() / RAND_MAX - 0.5f) / 8.0f;
  for (i = 0; i < N; ++i) {
    gamma[i] = 1.0f + 0.01f * (float)i;
    beta[i] = 0.1f;
  }

  printf("transformer_engine %d, CUDA backend available: %d\n", nvte_get_version(), nvte_cuda_backend_available());
  {
    NVTETensor tx = make(x, kNVTEFloat32, M, K), tw = make(w, kNVTEFloat32, N, K);
    NVTETensor qx = make(xq, kNVTEFloat8E4M3, M, K), qw = make(wq, kNVTEFloat8E4M3, N, K);
    NVTETensor ty = make(y, kNVTEFloat32, M, N), tz = make(z, kNVTEFloat32, M, N);
    NVTETensor tg = make(gamma, kNVTEFloat32, N, 0), tb = make(beta, kNVTEFloat32, N, 0);
    NVTETensor tmu = make(mu, kNVTEFloat32, M, 0), trs = make(rsigma, kNVTEFloat32, M, 0);
    set_scalar(qx, kNVTEScale, &x_scale);
    set_scalar(qx, kNVTEAmax, &x_amax);
    set_scalar(qx, kNVTERowwiseScaleInv, &x_sinv);
    set_scalar(qw, kNVTEScale, &w_scale);
    set_scalar(qw, kNVTEAmax, &w_amax);
    set_scalar(qw, kNVTERowwiseScaleInv, &w_sinv);

    /* 1. quantize input and weight to FP8 */
    CHECK(nvte_quantize(tx, qx, NULL));
    CHECK(nvte_quantize(tw, qw, NULL));
    /* 2. y = xq @ wq^T (TN: A = weight [N, K], B = input [M, K]) */
    CHECK(nvte_cublas_gemm(qw, qx, ty, NULL, NULL, true, false, false, NULL, false, false, 0, NULL));
    /* 3. z = LayerNorm(y) */
    CHECK(nvte_layernorm_fwd(ty, tg, tb, 1e-5f, tz, tmu, trs, NULL, 0, false, NULL));

    /* Reference in float64 from the decoded FP8 values. */
    for (i = 0; i < M; ++i) {
      double row[N], mean = 0, var = 0;
      for (j = 0; j < N; ++j) {
        double acc = 0;
        for (k = 0; k < K; ++k) acc += e4m3(xq[i * K + k]) * x_sinv * e4m3(wq[j * K + k]) * w_sinv;
        row[j] = acc;
        if (fabs(acc - y[i * N + j]) > 1e-4 * (1 + fabs(acc))) ++failures;
        mean += acc / N;
      }
      for (j = 0; j < N; ++j) var += (row[j] - mean) * (row[j] - mean) / N;
      for (j = 0; j < N; ++j) {
        double ref = (row[j] - mean) / sqrt(var + 1e-5) * gamma[j] + beta[j];
        double err = fabs(ref - z[i * N + j]);
        if (err > max_err) max_err = err;
        if (err > 1e-3) ++failures;
      }
    }
    printf("x: amax %.4f scale_inv %.5f | w: amax %.4f scale_inv %.6f\n", x_amax, x_sinv, w_amax, w_sinv);
    printf("FP8 GEMM + LayerNorm on %dx%dx%d: max |error| vs float64 %.2e, %d mismatches\n", M, N, K, max_err,
           failures);
    nvte_destroy_tensor(tx); nvte_destroy_tensor(tw); nvte_destroy_tensor(qx); nvte_destroy_tensor(qw);
    nvte_destroy_tensor(ty); nvte_destroy_tensor(tz); nvte_destroy_tensor(tg); nvte_destroy_tensor(tb);
    nvte_destroy_tensor(tmu); nvte_destroy_tensor(trs);
  }
  if (x_sinv != 0.25f || w_sinv != 1.0f / 64.0f) {
    fprintf(stderr, "scale_inv not written\n");
    return 1;
  }
  return failures ? 1 : 0;
}
