// cudnn_fp8_attention_plans.cu - diagnostic, not part of the library: the execution plans cuDNN's
// FP8 SDPA graphs (sdpa_fp8 forward, sdpa_fp8_backward) offer for b=4 h=32 d=128, causal or not,
// under heuristic modes A (and, with "all", B and FALLBACK), and how fast each runs (CUDA events,
// median of 15 x 4 back-to-back executions). Written to see whether a plan other than the
// heuristic's first would make the FP8 causal rows of benchmarks/gpu_attention.py faster.
// With "bf16" as the second argument: the same for the BF16 graphs (sdpa, sdpa_backward) that
// the library's BF16 path builds, to see whether a plan beats the heuristic's first there.
// Built on the CPU machine (the cuDNN frontend headers from the CI venv; cuDNN opened at run time):
//   sp=.venv/lib/python3.11/site-packages; nvcc -std=c++17 -O1 -arch=sm_90 \
//     -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING=1 -I$sp/include -I$sp/nvidia/cudnn/include \
//     -I$sp/nvidia/cu13/include benchmarks/cudnn_fp8_attention_plans.cu -o /tmp/fp8_plans -ldl
// Run on the GPU machine with torch's cuDNN first on LD_LIBRARY_PATH:
//   /tmp/fp8_plans SEQ [e4m3|e5m2 (dO and gradients)|bf16 (all BF16)] [bhsd|bshd] [all]
// DROPOUT=p in the environment adds dropout (probability p, seed/offset from device int64 tensors)
// to every graph: run under compute-sanitizer to see whether cuDNN's FP8 kernels fault with it
// (the library rejects FP8 dropout on the GPU since one did on an H100).
// KNOBS=1: after heuristic A's plans, sweep the first plan's engine knob by knob (each knob over
// its whole range, the others at the heuristic's values) and time every configuration cuDNN
// builds: does a configuration the heuristic does not rank beat its first plan? BAND=1 gives
// causal FP8 graphs the non-masking left band bound the library adds (fused_attn_cudnn_fp8.cpp).
#include <cudnn_frontend.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <string>
#include <unordered_map>
#include <dlfcn.h>
#include <cmath>
#include <cstring>
namespace cudnn_frontend { void *cudnn_dlhandle = nullptr; }
namespace fe = cudnn_frontend;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("cuda %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
__global__ void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned x = (unsigned)(i * 2654435761u) ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15;
    p[i] = (unsigned char)(0x28 + (x % 24)) | ((x >> 8) & 0x80);  // |v| in about [0.03, 0.9]
  }
}
__global__ void fill_bf16(unsigned short *p, size_t n, unsigned seed) {  // |v| in about [0.03, 0.9]
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    unsigned x = (unsigned)(i * 2654435761u) ^ seed; x ^= x >> 13; x *= 0x5bd1e995; x ^= x >> 15;
    p[i] = (unsigned short)(0x3d00 + (x % 0x260)) | (unsigned short)((x >> 16) & 0x8000);
  }
}
__global__ void fill_f(float *p, size_t n, float v) { for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v; }
int main(int argc, char **argv) {
  const int64_t b = 4, h = 32, s = argc > 1 ? atoi(argv[1]) : 2048, d = 128;
  fe::cudnn_dlhandle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
  if (!fe::cudnn_dlhandle) { printf("dlopen libcudnn.so.9: %s\n", dlerror()); return 1; }
  cudnnHandle_t hd; if (fe::detail::create_handle(&hd) != CUDNN_STATUS_SUCCESS) { printf("create_handle failed\n"); return 1; }
  printf("cudnn %ld\n", (long)fe::detail::get_backend_version());
  size_t n = b * h * s * d;
  const bool bf16 = argc > 2 && std::string(argv[2]) == "bf16";
  unsigned char *q, *k, *v, *o, *dO, *dq, *dk, *dv; float *stats, *scal; void *ws;
  for (auto pp : {&q, &k, &v, &o, &dO, &dq, &dk, &dv}) CK(cudaMalloc(pp, bf16 ? 2 * n : n));
  CK(cudaMalloc(&stats, b * h * s * 4)); CK(cudaMalloc(&scal, 64 * 4)); CK(cudaMalloc(&ws, size_t(1) << 31));
  int seed = 1;
  for (auto p : {q, k, v, o, dO}) {
    if (bf16) fill_bf16<<<1024, 256>>>((unsigned short *)p, n, seed++);
    else fill<<<1024, 256>>>(p, n, seed++);
  }
  fill_f<<<1, 64>>>(scal, 64, 1.0f); fill_f<<<1024, 256>>>(stats, b * h * s, 5.0f);
  const float dropout = getenv("DROPOUT") ? float(atof(getenv("DROPOUT"))) : 0.0f;
  int64_t *rng; CK(cudaMalloc(&rng, 2 * sizeof(int64_t))); CK(cudaMemset(rng, 0, 2 * sizeof(int64_t)));
  if (dropout > 0) printf("dropout %.3f\n", dropout);
  CK(cudaDeviceSynchronize());
  const bool e5 = argc > 2 && std::string(argv[2]) == "e5m2", bshd = argc > 3 && std::string(argv[3]) == "bshd";
  const fe::DataType_t gt = e5 ? fe::DataType_t::FP8_E5M2 : fe::DataType_t::FP8_E4M3;
  std::vector<int64_t> dim = {b, h, s, d}, str = bshd ? std::vector<int64_t>{s * h * d, d, h * d, 1} : std::vector<int64_t>{h * s * d, s * d, d, 1};
  printf("dO/grads %s, layout %s\n", bf16 ? "bf16" : e5 ? "e5m2" : "e4m3", bshd ? "bshd" : "bhsd");
  const bool band = getenv("BAND") && atoi(getenv("BAND")), knobs = getenv("KNOBS") && atoi(getenv("KNOBS"));
  const fe::DataType_t io = bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::FP8_E4M3;
  for (int causal = 0; causal < 2; ++causal)
    for (int bwd = 0; bwd < 2; ++bwd)
      for (auto mode : {fe::HeurMode_t::A, fe::HeurMode_t::B, fe::HeurMode_t::FALLBACK}) {
        fe::graph::Graph g;
        g.set_io_data_type(io).set_intermediate_data_type(fe::DataType_t::FLOAT).set_compute_data_type(fe::DataType_t::FLOAT);
        int64_t uid = 1;
        std::unordered_map<int64_t, void *> pack;
        auto T = [&](const char *nm, void *ptr, std::vector<int64_t> dm, std::vector<int64_t> st, fe::DataType_t dt) {
          pack[uid] = ptr;
          return g.tensor(fe::graph::Tensor_attributes().set_name(nm).set_uid(uid++).set_dim(dm).set_stride(st).set_data_type(dt));
        };
        auto S = [&](const char *nm, int i) { return T(nm, scal + i, {1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::FLOAT); };
        auto with_dropout = [&](auto &a) {
          if (dropout > 0)
            a.set_dropout(dropout, T("seed", rng, {1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT64),
                          T("offset", rng + 1, {1, 1, 1, 1}, {1, 1, 1, 1}, fe::DataType_t::INT64));
        };
        auto out = [&](std::shared_ptr<fe::graph::Tensor_attributes> t, void *ptr, std::vector<int64_t> dm, std::vector<int64_t> st, fe::DataType_t dt) {
          pack[uid] = ptr; t->set_output(true).set_uid(uid++).set_dim(dm).set_stride(st).set_data_type(dt);
        };
        auto Q = T("Q", q, dim, str, io), K = T("K", k, dim, str, io), V = T("V", v, dim, str, io);
        std::vector<int64_t> sd = {b, h, s, 1}, ss = {h * s, s, 1, 1}, one = {1, 1, 1, 1};
        if (bf16 && !bwd) {
          fe::graph::SDPA_attributes a; a.set_name("f").set_generate_stats(true).set_attn_scale(0.088f);
          if (causal) a.set_causal_mask(true);
          with_dropout(a);
          auto [O, st] = g.sdpa(Q, K, V, a);
          out(O, o, dim, str, io); out(st, stats, sd, ss, fe::DataType_t::FLOAT);
        } else if (bf16) {
          auto O = T("O", o, dim, str, io), dOt = T("dO", dO, dim, str, io);
          auto St = T("stats", stats, sd, ss, fe::DataType_t::FLOAT);
          fe::graph::SDPA_backward_attributes a; a.set_name("b").set_attn_scale(0.088f);
          if (causal) a.set_causal_mask(true);
          with_dropout(a);
          auto [dQ, dK, dV] = g.sdpa_backward(Q, K, V, O, dOt, St, a);
          out(dQ, dq, dim, str, io); out(dK, dk, dim, str, io); out(dV, dv, dim, str, io);
        } else if (!bwd) {
          fe::graph::SDPA_fp8_attributes a; a.set_name("f").set_generate_stats(true).set_attn_scale(0.088f);
          if (causal) a.set_causal_mask(true);
          if (causal && band) a.set_diagonal_band_left_bound((int)s + 1);
          with_dropout(a);
          auto [O, st, amax_s, amax_o] = g.sdpa_fp8(Q, K, V, S("dq", 0), S("dk", 1), S("dv", 2), S("ds", 3), S("ss", 4), S("so", 5), a);
          out(O, o, dim, str, fe::DataType_t::FP8_E4M3); out(st, stats, sd, ss, fe::DataType_t::FLOAT);
          out(amax_s, scal + 32, one, one, fe::DataType_t::FLOAT); out(amax_o, scal + 33, one, one, fe::DataType_t::FLOAT);
        } else {
          auto O = T("O", o, dim, str, io), dOt = T("dO", dO, dim, str, gt);
          auto St = T("stats", stats, sd, ss, fe::DataType_t::FLOAT);
          fe::graph::SDPA_fp8_backward_attributes a; a.set_name("b").set_attn_scale(0.088f);
          if (causal) a.set_causal_mask(true);
          if (causal && band) a.set_diagonal_band_left_bound((int)s + 1);
          with_dropout(a);
          auto [dQ, dK, dV, a1, a2, a3, a4] = g.sdpa_fp8_backward(Q, K, V, O, dOt, St, S("dq", 0), S("dk", 1), S("dv", 2), S("do", 6), S("ddo", 7), S("ds", 3), S("ddp", 8), S("ss", 4), S("sdq", 9), S("sdk", 10), S("sdv", 11), S("sdp", 12), a);
          out(dQ, dq, dim, str, gt); out(dK, dk, dim, str, gt); out(dV, dv, dim, str, gt);
          out(a1, scal + 40, one, one, fe::DataType_t::FLOAT); out(a2, scal + 41, one, one, fe::DataType_t::FLOAT);
          out(a3, scal + 42, one, one, fe::DataType_t::FLOAT); out(a4, scal + 43, one, one, fe::DataType_t::FLOAT);
        }
        if (mode != fe::HeurMode_t::A && !(argc > 4 && std::string(argv[4]) == "all")) continue;
        const char *mn = mode == fe::HeurMode_t::A ? "A" : mode == fe::HeurMode_t::B ? "B" : "FALLBACK";
        printf("== s=%ld %s %s heur %s: ", (long)s, causal ? "causal" : "no_mask", bwd ? "bwd" : "fwd", mn);
        auto st = g.validate(); if (st.is_bad()) { printf("validate: %s\n", st.get_message().c_str()); continue; }
        st = g.build_operation_graph(hd); if (st.is_bad()) { printf("opgraph: %s\n", st.get_message().c_str()); continue; }
        st = g.create_execution_plans({mode}); if (st.is_bad()) { printf("plans: %s\n", st.get_message().c_str()); continue; }
        st = g.check_support(hd); if (st.is_bad()) { printf("support: %s\n", st.get_message().c_str()); continue; }
        int64_t cnt = g.get_execution_plan_count();
        printf("%ld plans\n", (long)cnt);
        auto time_plan = [&](int64_t i, int reps) -> float {  // median ms per execution, <0: not built
          if (g.build_plan_at_index(hd, i).is_bad()) return -1.f;
          int64_t wsz = 0; g.get_workspace_size_plan_at_index(i, wsz);
          if (wsz > (int64_t(1) << 31)) return -2.f;
          for (int w = 0; w < 3; ++w) g.execute_plan_at_index(hd, pack, ws, i);
          cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
          std::vector<float> t;
          for (int r = 0; r < reps; ++r) {
            cudaEventRecord(e0);
            for (int j = 0; j < 4; ++j) g.execute_plan_at_index(hd, pack, ws, i);
            cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); t.push_back(ms / 4);
          }
          std::sort(t.begin(), t.end());
          cudaError_t ce = cudaGetLastError();
          if (ce != cudaSuccess) { printf("  plan %ld: %s\n", (long)i, cudaGetErrorString(ce)); exit(1); }
          return t[t.size() / 2];
        };
        for (int64_t i = 0; i < cnt; ++i) {
          float ms = time_plan(i, 15);
          std::string nm; g.get_plan_name_at_index(i, nm);
          printf("  plan %ld: %.4f ms %s\n", (long)i, ms, nm.c_str());
        }
        if (!knobs || cnt == 0) continue;
        int64_t eng = -1; std::unordered_map<fe::KnobType_t, int64_t> def;
        g.get_engine_and_knobs_at_index(0, eng, def);
        std::vector<fe::Knob> kl; g.get_knobs_for_engine(eng, kl);
        printf("  engine %ld knobs:", (long)eng);
        for (auto &kb : kl) printf(" [type %ld: %ld..%ld step %ld, heuristic %ld]", (long)kb.type, (long)kb.minValue,
                                   (long)kb.maxValue, (long)kb.stride, def.count(kb.type) ? (long)def[kb.type] : -1L);
        printf("\n");
        std::vector<std::pair<fe::KnobType_t, int64_t>> tried;
        for (auto &kb : kl)
          for (int64_t val = kb.minValue, nv = 0; val <= kb.maxValue && nv < 128; val += std::max<int64_t>(1, kb.stride), ++nv) {
            if (def.count(kb.type) && def[kb.type] == val) continue;
            auto kn = def; kn[kb.type] = val;
            if (g.create_execution_plan(eng, kn).is_bad()) continue;
            tried.push_back({kb.type, val});
          }
        // outputs of one execution of plan i, to compare plans (same inputs, same kernels' math?)
        std::vector<void *> outs = bwd ? std::vector<void *>{dq, dk, dv} : std::vector<void *>{o};
        const size_t ob = bf16 ? 2 * n : n;
        auto run_copy = [&](int64_t i) {
          std::vector<std::vector<unsigned char>> r;
          for (auto p : outs) CK(cudaMemset(p, 0, ob));
          g.execute_plan_at_index(hd, pack, ws, i); CK(cudaDeviceSynchronize());
          for (auto p : outs) { r.emplace_back(ob); CK(cudaMemcpy(r.back().data(), p, ob, cudaMemcpyDeviceToHost)); }
          return r;
        };
        auto bf = [](const unsigned char *p, size_t i) { unsigned u = unsigned(((const unsigned short *)p)[i]) << 16; float f; memcpy(&f, &u, 4); return f; };
        const auto ref = run_copy(0);
        int built = 0;
        for (int64_t i = cnt; i < g.get_execution_plan_count(); ++i) {
          float ms = time_plan(i, 7);
          if (ms < 0) continue;
          ++built;
          std::string nm; g.get_plan_name_at_index(i, nm);
          printf("  knob %ld=%ld: %.4f ms %s\n", (long)tried[i - cnt].first, (long)tried[i - cnt].second, ms, nm.c_str());
          // alternate with the heuristic's plan: 6 rounds of 15 medians each
          for (int round = 0; round < 6; ++round) {
            float a = time_plan(0, 15), b = time_plan(i, 15);
            printf("    round %d: heuristic %.4f ms, this %.4f ms, speedup %.4f\n", round, a, b, a / b);
          }
          const auto got = run_copy(i);
          for (size_t t = 0; t < outs.size(); ++t) {
            size_t nd = 0; double md = 0, mr = 0;
            for (size_t e = 0; e < (bf16 ? n : ob); ++e) {
              if (bf16) {
                float x = bf(ref[t].data(), e), y = bf(got[t].data(), e);
                if (x != y) ++nd;
                md = std::max(md, (double)std::fabs(x - y)); mr = std::max(mr, (double)std::fabs(x));
              } else if (ref[t][e] != got[t][e]) ++nd;
            }
            printf("    output %zu: %zu of %zu elements differ from the heuristic plan's, max |diff| %.3g (max |ref| %.3g)\n",
                   t, nd, bf16 ? n : ob, md, mr);
          }
        }
        printf("  %zu knob settings made configurations, %d built\n", tried.size(), built);
        fflush(stdout);
      }
  return 0;
}
