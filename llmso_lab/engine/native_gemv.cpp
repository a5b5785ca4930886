// The engine's optional native kernel (`engine/native.py`): y = x @ w.T for the few rows of a decode step.
//
// x [M, K] (M small: batch-1 decode, a short speculative run), w [N, K] (HF orientation), y [M, N] in x's dtype.
// Every group of 4 weight rows is loaded from memory once and, while it sits in L1, multiplied by all M rows of x:
// the weights are read once per step whatever M is, which is all a memory-bound decode step asks of a matmul.
// fp32: AVX-512 FMA, 16 products per instruction; bf16: AVX512-BF16 `dpbf16` (pairs of bf16 products summed in fp32),
// 32 per instruction, rounded to bf16 once at the end. Threads split the output rows (ATen's pool, as torch's ops).
// K must be a multiple of 16 (fp32) or 32 (bf16); native.py checks it and routes anything else to torch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#if !defined(__AVX512F__)
#error "the native GEMV needs AVX-512 (native.py falls back to torch's kernels)"
#endif

namespace {

constexpr int64_t R = 4;   // weight rows per group

void gemv_f32(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += R) {
    const int64_t r = std::min(R, n1 - n);
    for (int64_t m = 0; m < M; ++m) {
      __m512 acc[R] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const float* xm = x + m * K;
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(xm + k);
        for (int64_t i = 0; i < r; ++i) acc[i] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w + (n + i) * K + k), acc[i]);
      }
      for (int64_t i = 0; i < r; ++i) y[m * N + n + i] = _mm512_reduce_add_ps(acc[i]);
    }
  }
}

#if defined(__AVX512BF16__)
void gemv_bf16(const uint16_t* x, const uint16_t* w, at::BFloat16* y, int64_t M, int64_t N, int64_t K, int64_t n0,
               int64_t n1) {
  for (int64_t n = n0; n < n1; n += R) {
    const int64_t r = std::min(R, n1 - n);
    for (int64_t m = 0; m < M; ++m) {
      __m512 acc[R] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      const uint16_t* xm = x + m * K;
      for (int64_t k = 0; k < K; k += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + k);
        for (int64_t i = 0; i < r; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], xv, (__m512bh)_mm512_loadu_si512(w + (n + i) * K + k));
      }
      for (int64_t i = 0; i < r; ++i) y[m * N + n + i] = at::BFloat16(_mm512_reduce_add_ps(acc[i]));
    }
  }
}
#endif

}  // namespace

bool has_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [M, K] and w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "gemv: x and w must have one dtype");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemv: contiguous inputs");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const int64_t groups = (N + R - 1) / R;
  if (x.scalar_type() == torch::kFloat32) {
    TORCH_CHECK(K % 16 == 0, "gemv: fp32 K must be a multiple of 16");
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
      gemv_f32(xp, wp, yp, M, N, K, g0 * R, std::min(g1 * R, N));
    });
    return y;
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(K % 32 == 0, "gemv: bf16 K must be a multiple of 32");
    const uint16_t *xp = (const uint16_t*)x.data_ptr(), *wp = (const uint16_t*)w.data_ptr();
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
      gemv_bf16(xp, wp, yp, M, N, K, g0 * R, std::min(g1 * R, N));
    });
    return y;
  }
#endif
  TORCH_CHECK(false, "gemv: fp32, or bf16 on a CPU with AVX512-BF16");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w.T for a few rows of x; w [N, K] read once");
  m.def("has_bf16", &has_bf16);
}
