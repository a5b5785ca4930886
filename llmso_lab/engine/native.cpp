// The engine's optional native path (`engine/native.py`): a register-tiled matrix product on packed weights, and a
// whole Llama-family forward step (decodes, prefill chunks, or both) in one call.
//
// Why a whole step: a step in torch is ~1,000 small ops (norms, RoPE, cache writes, attention, residual adds) of a few
// microseconds of dispatch each around ~120 matrix products, and its attention gathers each sequence's blocks first.
// `Step.run` does the same work as `ModelRunner.forward` for a varlen batch inside one OpenMP parallel region: every
// product is split over the threads by blocks of 32 outputs (statically, an equal share each: taking chunks from a
// shared counter instead, as llama.cpp does, measured 1.1-1.8x slower per step here, the threads' reads no longer two
// long streams), the threads meet at a barrier between dependent phases (6 per layer), and everything between the
// products (RMSNorm, RoPE, the paged-cache write, attention read through the block tables, SiLU, the residual adds)
// runs on vectors of 16, on data that is already in cache. This is how llama.cpp runs a token (a pre-planned graph of
// kernels and a spinning thread pool), and what CUDA-graph capture buys on a GPU. `Step.profile` says where the time
// went, phase by phase and thread by thread.
//
// Numbers follow the engine's torch path: weights, activations and the KV cache in the engine's dtype (fp32 or
// bf16), rounded to it where torch rounds (after each product, the norm, RoPE, SiLU and every residual add); the
// norm's statistics, attention's scores and softmax, and every product accumulate in fp32.
// Products: fp32 with AVX-512 FMA (16 per instruction), bf16 with AVX512-BF16 `dpbf16` (32), int4 codes unpacked in
// registers (below). head_dim must be a multiple of 16; native.py checks what the step needs.
// `paged_decode` is the step's attention on its own, for the torch path's decode rows where the step does not run.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if !defined(__AVX512F__)
#error "the native path needs AVX-512 (native.py falls back to torch's kernels)"
#endif

namespace {

using bf16 = uint16_t;

// ---- element access: fp32 storage, or bf16 storage rounded to nearest-even as torch does ------------------------
inline float to_f(float v) { return v; }
inline float to_f(bf16 v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void put(float* p, float v) { *p = v; }
inline void put(bf16* p, float v) { *p = c10::BFloat16(v).x; }
template <typename T> inline float round_to(float v) { T t; put(&t, v); return to_f(t); }

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// 16 numbers rounded to T (bf16: to nearest even, torch's rounding, in integer ops: plain AVX-512), kept in fp32.
template <typename T> inline __m512 vround(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
}
// store 16 numbers as T (rounded)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(vround<bf16>(v)), 16)));
}
// vec(c) for c = 0, 16, .. while 16 numbers remain, then scalar(c) for the rest of cnt.
template <typename V, typename S> inline void lanes16(int64_t cnt, V&& vec, S&& scalar) {
  int64_t c = 0;
  for (; c + 16 <= cnt; c += 16) vec(c);
  for (; c < cnt; ++c) scalar(c);
}
// y[0 .. cnt) = v rounded to T (a row of a product's output)
template <typename T> inline void store_row(T* y, const float* v, int64_t cnt) {
  lanes16(cnt, [&](int64_t c) { store16(y + c, _mm512_loadu_ps(v + c)); }, [&](int64_t c) { put(y + c, v[c]); });
}
// e^x for 16 numbers: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor series to r^6 (relative error ~1e-7, as
// std::exp in fp32 within an ulp or two), times 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// ---- packed weights and the register-tiled product ---------------------------------------------------------------
// A dense weight [N, K] is repacked once (`pack`) into blocks of 32 output columns, each block contiguous: fp32
// [N/32, K, 32] (element k of the block's 32 columns side by side), bf16 [N/32, K/2, 32, 2] (the pair k, k+1 of each
// column side by side: the operand layout of `dpbf16`, which multiplies pairs). N is padded with zero columns to a
// multiple of 32. The kernel computes a tile of up to MR = 12 rows of x by one block (32 columns) in 24 vector
// registers, over all of K: per step of k it loads the block's 32 weights (2 vectors) once and multiplies them by
// each of the tile's rows (one broadcast number, or pair, of x each). So every weight loaded serves 12 rows, with no
// horizontal sums: one layout for batch 1 (it streams the weights; each thread's blocks are one contiguous range) and
// for a prefill of thousands of tokens (~90-100 % of oneDNN's bf16 rate here, faster than torch's fp32).
constexpr int MR = 12;          // rows of x per tile: 2 x 12 accumulators + 2 weight vectors + 1 broadcast < 32 registers
constexpr int64_t MC = 96;      // rows of x per pass over a thread's blocks (x's chunk stays in L2)

template <int R>
inline void tile_kernel(const float* x, int64_t ldx, const float* w, int64_t K, float* out) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + k * 32), w1 = _mm512_loadu_ps(w + k * 32 + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 32, acc[r][0]), _mm512_storeu_ps(out + r * 32 + 16, acc[r][1]);
}

#if defined(__AVX512BF16__)
template <int R>
inline void tile_kernel(const bf16* x, int64_t ldx, const bf16* w, int64_t K, float* out) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 64), w1 = (__m512bh)_mm512_loadu_si512(w + kp * 64 + 32);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kp, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * 32, acc[r][0]), _mm512_storeu_ps(out + r * 32 + 16, acc[r][1]);
}
#else
template <int R> inline void tile_kernel(const bf16*, int64_t, const bf16*, int64_t, float*) {
  TORCH_CHECK(false, "bf16 needs AVX512-BF16");
}
#endif

// out [rows, 32] = x[rows, K] times one packed block, for 1 <= rows <= MR.
template <typename T> inline void tile(int64_t rows, const T* x, int64_t ldx, const T* w, int64_t K, float* out) {
  switch (rows) {
    case 1: return tile_kernel<1>(x, ldx, w, K, out);
    case 2: return tile_kernel<2>(x, ldx, w, K, out);
    case 3: return tile_kernel<3>(x, ldx, w, K, out);
    case 4: return tile_kernel<4>(x, ldx, w, K, out);
    case 5: return tile_kernel<5>(x, ldx, w, K, out);
    case 6: return tile_kernel<6>(x, ldx, w, K, out);
    case 7: return tile_kernel<7>(x, ldx, w, K, out);
    case 8: return tile_kernel<8>(x, ldx, w, K, out);
    case 9: return tile_kernel<9>(x, ldx, w, K, out);
    case 10: return tile_kernel<10>(x, ldx, w, K, out);
    case 11: return tile_kernel<11>(x, ldx, w, K, out);
    default: return tile_kernel<MR>(x, ldx, w, K, out);
  }
}

// f(m, rows, b) for every tile (rows m .. m + rows of M, up to mr) of blocks b0 <= b < b1, x's rows in chunks of MC.
template <typename F> inline void for_tiles(int64_t M, int64_t b0, int64_t b1, F&& f, int64_t mr = MR) {
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m = m0; m < m1; m += mr) f(m, std::min<int64_t>(mr, m1 - m), b);
  }
}

// This thread's share [n0, n1) of N output rows.
inline void share(int64_t N, int t, int nt, int64_t& n0, int64_t& n1) { n0 = N * t / nt; n1 = N * (t + 1) / nt; }

// ---- int4 weights (the engine's `quantization="int4"`, `quant.weight_only.WeightOnlyInt4` with groups of 32) ------
// The engine holds row n as K/2 bytes of codes (element 2i in the low nibble of byte i) and per group of 32 a bf16
// scale and zero; the weight is (q - 8) * scale + zero, as torch's int4 kernel computes it. So per output
// x . w = sum over groups g of scale_g * (x_g . q_g) + (zero_g - 8 scale_g) * sum(x_g).
// `pack_q4` repacks the codes once into the register tile's layout: per block of 32 outputs and group of 32 inputs,
// 8 vectors of 32 16-bit words whose 4 nibbles are 4 operands of `dpbf16` (nibble i of word j of vector l: output
// (i & 1) * 16 + j / 2, input 4 l + 2 (i >> 1) + j % 2, the dpbf16 pair layout). The kernel turns a nibble into its
// bf16 value by one table lookup (`vpermw`: the word's low 5 bits index a table of 0..15 written twice, exact) after a
// shift, and multiplies it by up to MR4 rows of x (bf16, as torch's int4 kernel takes its input) in fp32 sums, a
// group at a time; then the group's scales and zero terms. So one unpacking serves MR4 rows: batch 1 streams the
// codes (each thread's blocks are one contiguous range) and a prefill runs at dpbf16's rate. Scales and zeros are
// repacked too: per block and group, 32 scales then 32 zeros.
constexpr int MR4 = 4;   // 4 partial sums per row (4 independent dpbf16 chains at batch 1) + 2 totals: 24 registers

template <int R>
inline void tile_q4_kernel(const bf16* x, int64_t ldx, const float* xs, int64_t ldxs, const uint8_t* q,
                           const bf16* sz, int64_t K, float* out) {
#if defined(__AVX512BF16__)
  const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0,
                                         0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,   // 15 .. 0
                                         0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0,
                                         0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; ++g) {
    __m512 p[R][4];   // [0], [2]: outputs 0..15; [1], [3]: 16..31
    for (int r = 0; r < R; ++r) p[r][0] = p[r][1] = p[r][2] = p[r][3] = _mm512_setzero_ps();
    const uint8_t* qg = q + g * 512;
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) {
      const __m512i w = _mm512_loadu_si512(qg + l * 64);
      const __m512bh v0 = (__m512bh)_mm512_permutexvar_epi16(w, table);
      const __m512bh v1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table);
      const __m512bh v2 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table);
      const __m512bh v3 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        uint32_t pa, pb;   // x's inputs 4 l, 4 l + 1 and 4 l + 2, 4 l + 3 of the group
        std::memcpy(&pa, x + r * ldx + g * 32 + 4 * l, 4), std::memcpy(&pb, x + r * ldx + g * 32 + 4 * l + 2, 4);
        const __m512bh xa = (__m512bh)_mm512_set1_epi32(pa), xb = (__m512bh)_mm512_set1_epi32(pb);
        p[r][0] = _mm512_dpbf16_ps(p[r][0], xa, v0), p[r][1] = _mm512_dpbf16_ps(p[r][1], xa, v1);
        p[r][2] = _mm512_dpbf16_ps(p[r][2], xb, v2), p[r][3] = _mm512_dpbf16_ps(p[r][3], xb, v3);
      }
    }
    const bf16* s = sz + g * 64;
    const __m512 s0 = load16(s), s1 = load16(s + 16);
    const __m512 z0 = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s0, load16(s + 32));
    const __m512 z1 = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s1, load16(s + 48));
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_set1_ps(xs[r * ldxs + g]);
      acc[r][0] = _mm512_fmadd_ps(z0, sx, _mm512_fmadd_ps(_mm512_add_ps(p[r][0], p[r][2]), s0, acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(z1, sx, _mm512_fmadd_ps(_mm512_add_ps(p[r][1], p[r][3]), s1, acc[r][1]));
    }
  }
  // rounded to bf16, as torch's int4 kernel returns its product
  for (int r = 0; r < R; ++r)
    _mm512_storeu_ps(out + r * 32, vround<bf16>(acc[r][0])), _mm512_storeu_ps(out + r * 32 + 16, vround<bf16>(acc[r][1]));
#else
  TORCH_CHECK(false, "int4 needs AVX512-BF16");
#endif
}

// out [rows, 32] = x [rows, K] (bf16, with its group sums xs [rows, K / 32]) times one int4 block, 1 <= rows <= MR4.
inline void tile_q4(int64_t rows, const bf16* x, int64_t ldx, const float* xs, int64_t ldxs, const uint8_t* q,
                    const bf16* sz, int64_t K, float* out) {
  switch (rows) {
    case 1: return tile_q4_kernel<1>(x, ldx, xs, ldxs, q, sz, K, out);
    case 2: return tile_q4_kernel<2>(x, ldx, xs, ldxs, q, sz, K, out);
    case 3: return tile_q4_kernel<3>(x, ldx, xs, ldxs, q, sz, K, out);
    default: return tile_q4_kernel<MR4>(x, ldx, xs, ldxs, q, sz, K, out);
  }
}

// x [M, K] fp32 for an int4 product: rounded to bf16 (xp [M, K]) and each group's sum of the rounded numbers
// (xs [M, K / 32]).
inline void prep_q4(const float* x, int64_t M, int64_t K, bf16* xp, float* xs) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / 32; ++g) {
      const int64_t i = m * K + g * 32;
      const __m512 a = vround<bf16>(_mm512_loadu_ps(x + i)), b = vround<bf16>(_mm512_loadu_ps(x + i + 16));
      store16(xp + i, a), store16(xp + i + 16, b);
      xs[m * (K / 32) + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

// codes [N, K/2] and scales and zeros [N, K/32, 2] into the tile's layout (above): codes [NB, K/32, 512] bytes,
// scales and zeros [NB, K/32, 2, 32] (padding outputs: zero codes, scales and zeros).
std::pair<torch::Tensor, torch::Tensor> pack_q4(const torch::Tensor& codes, const torch::Tensor& sz, int64_t N, int64_t K) {
  const int64_t NB = (N + 31) / 32, G = K / 32;
  auto qo = torch::zeros({NB, G, 512}, codes.options());
  auto so = torch::zeros({NB, G, 2, 32}, sz.options());
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const bf16* s = (const bf16*)sz.data_ptr();
  uint8_t* q = qo.data_ptr<uint8_t>();
  bf16* t = (bf16*)so.data_ptr();
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < G; ++g) {
        uint16_t* words = (uint16_t*)(q + (b * G + g) * 512);
        for (int64_t l = 0; l < 8; ++l)
          for (int64_t j = 0; j < 32; ++j)
            for (int64_t i = 0; i < 4; ++i) {
              const int64_t n = b * 32 + (i & 1) * 16 + j / 2, k = g * 32 + 4 * l + 2 * (i >> 1) + j % 2;
              if (n >= N) continue;
              const int code = (c[n * (K / 2) + k / 2] >> (4 * (k % 2))) & 0xF;
              words[l * 32 + j] |= uint16_t(code << (4 * i));
            }
        for (int64_t o = 0; o < 32 && b * 32 + o < N; ++o)
          for (int64_t h = 0; h < 2; ++h) t[((b * G + g) * 2 + h) * 32 + o] = s[((b * 32 + o) * G + g) * 2 + h];
      }
  });
  return {qo, so};
}

// One weight matrix of the step, [N, K]: dense in the step's dtype (packed, `pack`), or int4 (packed, `pack_q4`).
struct Mat {
  torch::Tensor w, sz;   // sz empty for a dense matrix
  int64_t N = 0, K = 0;
  const void* wp = nullptr;
  const bf16* szp = nullptr;
  bool q4() const { return szp != nullptr; }
  int64_t blocks() const { return (N + 31) / 32; }
  // out [rows, 32]: rows m .. m + rows of x [M, K] times block b (int4: of x prepared by `prep_q4` into xp, xs)
  template <typename T>
  void tile(int64_t m, int64_t rows, const T* x, const bf16* xp, const float* xs, int64_t b, float* out) const {
    if (q4())
      tile_q4(rows, xp + m * K, K, xs + m * (K / 32), K / 32, (const uint8_t*)wp + b * (K / 32) * 512,
              szp + b * (K / 32) * 64, K, out);
    else
      ::tile(rows, x + m * K, K, (const T*)wp + b * K * 32, K, out);
  }
  int mr() const { return q4() ? MR4 : MR; }
};

// The packed layout's shape for a dense [N, K] weight of this dtype.
std::vector<int64_t> packed_shape(bool bf, int64_t N, int64_t K) {
  const int64_t NB = (N + 31) / 32;
  return bf ? std::vector<int64_t>{NB, K / 2, 32, 2} : std::vector<int64_t>{NB, K, 32};
}

template <typename T> void pack_typed(const T* w, int64_t N, int64_t K, T* out) {
  constexpr int64_t P = sizeof(T) == 2 ? 2 : 1;   // numbers of one column side by side
  at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < 32 && b * 32 + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) out[((b * (K / P) + k / P) * 32 + c) * P + k % P] = w[(b * 32 + c) * K + k];
  });
}

}  // namespace

bool has_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// A weight [N, K] (fp32, or bf16 with K even) in the kernel's packed layout (zeros in the padding columns).
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "pack: a contiguous weight [N, K]");
  const int64_t N = w.size(0), K = w.size(1);
  const bool bf = w.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || (bf && K % 2 == 0),
              "pack: fp32, or bf16 with an even number of inputs K");
  auto out = torch::zeros(packed_shape(bf, N, K), w.options());
  if (bf)
    pack_typed((const bf16*)w.data_ptr(), N, K, (bf16*)out.data_ptr());
  else
    pack_typed(w.data_ptr<float>(), N, K, out.data_ptr<float>());
  return out;
}

// y [M, N] = x [M, K] w^T for w packed by `pack` (N: w's real number of rows), in x's dtype (rounded once, from an
// fp32 sum, as torch's matmul rounds). Threads split the blocks of 32 columns.
torch::Tensor gemm(torch::Tensor x, torch::Tensor packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(), "gemm: a contiguous x [M, K] and a packed w");
  const int64_t M = x.size(0), K = x.size(1);
  const bool bf = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || (bf && has_bf16()), "gemm: fp32, or bf16 on a CPU with AVX512-BF16");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type() && packed.sizes().vec() == packed_shape(bf, N, K),
              "gemm: w must be `pack(w)` of a [", N, ", ", K, "] weight of x's dtype");
  auto y = torch::empty({M, N}, x.options());
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *xp = (const T*)x.data_ptr(), *wp = (const T*)packed.data_ptr();
    T* yp = (T*)y.data_ptr();
    at::parallel_for(0, (N + 31) / 32, 1, [&](int64_t b0, int64_t b1) {
      float t[MR * 32];
      for_tiles(M, b0, b1, [&](int64_t m, int64_t rows, int64_t b) {
        tile(rows, xp + m * K, K, wp + b * K * 32, K, t);
        for (int64_t r = 0; r < rows; ++r) store_row(yp + (m + r) * N + b * 32, t + r * 32, std::min<int64_t>(32, N - b * 32));
      });
    });
  };
  if (bf)
    run((bf16*)nullptr);
  else
    run((float*)nullptr);
  return y;
}

// ---- decode attention over the paged cache ------------------------------------------------------------------------
// The blocks a row reads (the first ceil(ctx / block_size) entries of its table) must be blocks of the cache: a wrong
// table is refused before any read or write, never followed out of the cache.
inline void check_table(const int32_t* row, int32_t ctx, int64_t block_size, int64_t num_blocks, const char* who) {
  for (int64_t i = 0; i < (ctx + block_size - 1) / block_size; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, who, ": block ", row[i], " of a block table is not a block of "
                "the cache (0..", num_blocks - 1, ")");
}

// The G query heads q [G, D] (RoPE applied) that share KV head g, of a token whose keys j0 <= j < ctx sit in its
// blocks `table` of the cache [num_blocks, block_size, Hkv, D]: softmax(q K^T * scale) V into out [G, D]. Read
// through the block table, nothing gathered; each key and value loaded once for all G heads (up to 16 / (D / 16) heads
// at a time in registers). Scores, softmax and the weighted sum in fp32 (`sc` holds G * (ctx - j0) scores).
template <int DVc, typename T>
inline void attend_heads(const T* q, int64_t G, const T* kc, const T* vc, const int32_t* table, int32_t j0, int32_t ctx,
                         int64_t bs, int64_t Hkv, int64_t g, int64_t D, float scale, float* sc, T* out) {
  const int64_t DV = DVc ? DVc : D / 16, HG = std::max<int64_t>(1, 16 / DV), n = ctx - j0, stride = Hkv * D;
  // f(j, pointer to key / value j's head g) for j0 <= j < ctx, block by block
  auto keys = [&](const T* cache, auto&& f) {
    for (int64_t bi = j0 / bs; bi * bs < ctx; ++bi) {
      const T* base = cache + (int64_t(table[bi]) * bs * Hkv + g) * D;
      const int64_t lo = std::max<int64_t>(j0 - bi * bs, 0), hi = std::min<int64_t>(bs, ctx - bi * bs);
      for (int64_t jj = lo; jj < hi; ++jj) f(bi * bs + jj - j0, base + jj * stride);
    }
  };
  for (int64_t h0 = 0; h0 < G; h0 += HG) {
    const int64_t hn = std::min(HG, G - h0);
    __m512 qv[32], acc[32];   // HG * DV <= 32
    for (int64_t h = 0; h < hn; ++h)
      for (int64_t d = 0; d < DV; ++d) qv[h * DV + d] = _mm512_mul_ps(load16(q + (h0 + h) * D + d * 16), _mm512_set1_ps(scale));
    keys(kc, [&](int64_t j, const T* k) {
      __m512 kv[32];
      for (int64_t d = 0; d < DV; ++d) kv[d] = load16(k + d * 16);
      for (int64_t h = 0; h < hn; ++h) {
        __m512 s = _mm512_mul_ps(qv[h * DV], kv[0]);
        for (int64_t d = 1; d < DV; ++d) s = _mm512_fmadd_ps(qv[h * DV + d], kv[d], s);
        sc[h * n + j] = _mm512_reduce_add_ps(s);
      }
    });
    float inv[16];
    for (int64_t h = 0; h < hn; ++h) {
      float* row = sc + h * n;
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
      __m512 sum = _mm512_setzero_ps();
      const __m512 m = _mm512_set1_ps(mx);
      float tail = 0.f;
      lanes16(n, [&](int64_t c) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + c), m));
        _mm512_storeu_ps(row + c, e), sum = _mm512_add_ps(sum, e);
      }, [&](int64_t c) { tail += (row[c] = std::exp(row[c] - mx)); });
      inv[h] = 1.f / (_mm512_reduce_add_ps(sum) + tail);
      for (int64_t d = 0; d < DV; ++d) acc[h * DV + d] = _mm512_setzero_ps();
    }
    keys(vc, [&](int64_t j, const T* v) {
      __m512 vv[32];
      for (int64_t d = 0; d < DV; ++d) vv[d] = load16(v + d * 16);
      for (int64_t h = 0; h < hn; ++h) {
        const __m512 p = _mm512_set1_ps(sc[h * n + j]);
        for (int64_t d = 0; d < DV; ++d) acc[h * DV + d] = _mm512_fmadd_ps(p, vv[d], acc[h * DV + d]);
      }
    });
    for (int64_t h = 0; h < hn; ++h)
      for (int64_t d = 0; d < DV; ++d)
        store16(out + (h0 + h) * D + d * 16, _mm512_mul_ps(acc[h * DV + d], _mm512_set1_ps(inv[h])));
  }
}

template <typename T>
inline void attend(const T* q, int64_t G, const T* kc, const T* vc, const int32_t* table, int32_t j0, int32_t ctx,
                   int64_t bs, int64_t Hkv, int64_t g, int64_t D, float scale, float* sc, T* out) {
  if (D == 64)
    attend_heads<4>(q, G, kc, vc, table, j0, ctx, bs, Hkv, g, D, scale, sc, out);
  else if (D == 128)
    attend_heads<8>(q, G, kc, vc, table, j0, ctx, bs, Hkv, g, D, scale, sc, out);
  else
    attend_heads<0>(q, G, kc, vc, table, j0, ctx, bs, Hkv, g, D, scale, sc, out);
}

// Decode attention for the torch path's decode rows (`TorchAttentionBackend`): q [B, H, D] (rows may be strided),
// caches [num_blocks, block_size, Hkv, D], tables [B, W] int32, ctx [B] int32, `window` > 0: only the last `window`
// keys (sliding window). Returns [B, H, D]. Threads split (sequence, KV head) pairs.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor ctx, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.size(2) == k_cache.size(3) && q.stride(2) == 1 &&
              q.stride(1) == q.size(2), "paged_decode: q [B, H, D] with contiguous heads, caches [N, bs, Hkv, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
              q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: contiguous K and V caches of q's dtype and one shape");
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && ctx.scalar_type() == torch::kInt32 && tables.is_contiguous() &&
              tables.size(0) == q.size(0) && ctx.size(0) == q.size(0), "paged_decode: tables [B, W] and ctx [B] int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(D % 16 == 0 && D <= 512 && H % Hkv == 0, "paged_decode: head_dim a multiple of 16 up to 512, GQA groups");
  const int32_t* cl = ctx.data_ptr<int32_t>();
  int32_t max_ctx = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(cl[b] >= 1 && cl[b] <= tables.size(1) * bs, "paged_decode: context length ", cl[b],
                " does not fit the block table");
    check_table(tables.data_ptr<int32_t>() + b * tables.size(1), cl[b], bs, k_cache.size(0), "paged_decode");
    max_ctx = std::max(max_ctx, cl[b]);
  }
  auto out = torch::empty({B, H, D}, q.options());
  const int32_t* tab = tables.data_ptr<int32_t>();
  const int64_t G = H / Hkv, W = tables.size(1), qs = q.stride(0);
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *qp = (const T*)q.data_ptr(), *kc = (const T*)k_cache.data_ptr(), *vc = (const T*)v_cache.data_ptr();
    T* op = (T*)out.data_ptr();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t u0, int64_t u1) {
      std::vector<float> sc(G * max_ctx);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / Hkv, g = u % Hkv;
        const int32_t j0 = window > 0 ? std::max<int64_t>(0, cl[b] - window) : 0;
        attend(qp + b * qs + g * G * D, G, kc, vc, tab + b * W, j0, cl[b], bs, Hkv, g, D, float(scale), sc.data(),
               op + (b * H + g * G) * D);
      }
    });
  };
  if (q.scalar_type() == torch::kFloat32)
    run((float*)nullptr);
  else if (q.scalar_type() == torch::kBFloat16)
    run((bf16*)nullptr);
  else
    TORCH_CHECK(false, "paged_decode: fp32 or bf16");
  return out;
}

// ---- the whole forward step ----------------------------------------------------------------------------------------

struct Step {
  // Per layer, HF orientation [out, in] (dense: packed by `pack`): qkv [(H + 2 Hkv) D, hidden], o [hidden, H D],
  // gate_up [2 I, hidden] (gate rows first), down [hidden, I]; the norms' weights [hidden]. K/V caches
  // [num_blocks, block_size, Hkv, D].
  std::vector<torch::Tensor> in_norm, post_norm, k_cache, v_cache;
  std::vector<Mat> qkv, o, gate_up, down;
  Mat lm_head;
  torch::Tensor embed, final_norm, cos, sin;   // embed [V, hidden]; cos / signed sin [P, D]
  int64_t H, Hkv, D, hidden, inter, vocab, block_size;
  float eps, scale;
  bool is_bf16, any_q4 = false;
  // Where the step's time goes (`profile()`): per thread and phase, seconds of work and of waiting at the barrier
  // that ends the phase (a thread done before the others waits there); summed over steps until read.
  static constexpr int PHASES = 7;
  std::vector<double> prof_work, prof_wait;
  int64_t prof_steps = 0;

  // `layers`: per layer input_norm, qkv, qkv_sz, o, o_sz, post_norm, gate_up, gate_up_sz, down, down_sz, where a
  // matrix is packed (`pack`) with an empty `_sz`, or int4: uint8 codes [N, K / 2] and bf16 scales and zeros
  // `_sz` [N, K / 32, 2].
  Step(std::vector<torch::Tensor> layers, torch::Tensor embed, torch::Tensor final_norm, torch::Tensor lm_head,
       torch::Tensor lm_head_sz, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_cache,
       std::vector<torch::Tensor> v_cache, int64_t H, int64_t Hkv, int64_t D, int64_t inter, int64_t vocab, double eps,
       double scale)
      : k_cache(k_cache), v_cache(v_cache), embed(embed), final_norm(final_norm), cos(cos), sin(sin), H(H), Hkv(Hkv),
        D(D), inter(inter), vocab(vocab), eps(float(eps)), scale(float(scale)) {
    TORCH_CHECK(layers.size() % 10 == 0 && layers.size() / 10 == k_cache.size() && k_cache.size() == v_cache.size(),
                "Step: 10 tensors per layer (input_norm, qkv, qkv_sz, o, o_sz, post_norm, gate_up, gate_up_sz, down, "
                "down_sz) and one K, V cache each");
    const auto dt = embed.scalar_type();
    TORCH_CHECK(dt == torch::kFloat32 || (dt == torch::kBFloat16 && has_bf16()),
                "Step: fp32, or bf16 with AVX512-BF16");
    is_bf16 = dt == torch::kBFloat16;
    hidden = embed.size(1), block_size = k_cache[0].size(1);
    TORCH_CHECK(D % 16 == 0 && D <= 512 && H % Hkv == 0, "Step: head_dim a multiple of 16 up to 512, GQA groups");
    TORCH_CHECK(hidden % 2 == 0 && inter % 2 == 0 && (H * D) % 2 == 0, "Step: even hidden and intermediate sizes");
    auto check = [&](const torch::Tensor& t, std::vector<int64_t> shape, const char* what) {
      TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.sizes().vec() == shape, "Step: ", what,
                  " must be contiguous, of the embedding's dtype, shaped ", c10::IntArrayRef(shape));
    };
    // packed in the step's dtype, or int4 (fp32 steps only): codes [N, K / 2] uint8, sz [N, K / 32, 2] bf16, repacked
    // here (`pack_q4`)
    auto mat = [&](const torch::Tensor& w, const torch::Tensor& sz, int64_t N, int64_t K, const char* what) {
      if (!sz.numel()) {
        check(w, packed_shape(is_bf16, N, K), what);
        return Mat{w, sz, N, K, w.data_ptr(), nullptr};
      }
      TORCH_CHECK(dt == torch::kFloat32, "Step: int4 weights with fp32 activations only (", what, ")");
      const std::vector<int64_t> codes{N, K / 2}, scales{N, K / 32, 2};
      const bool ok = w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.sizes().vec() == codes &&
                      sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.sizes().vec() == scales &&
                      K % 32 == 0 && has_bf16();
      TORCH_CHECK(ok, "Step: int4 ", what, " must be uint8 codes [", N, ", ", K / 2, "] and bf16 scales and zeros [", N,
                  ", ", K / 32, ", 2] (groups of 32, a CPU with AVX512-BF16)");
      any_q4 = true;
      auto [q, s] = pack_q4(w, sz, N, K);
      return Mat{q, s, N, K, q.data_ptr(), (const bf16*)s.data_ptr()};
    };
    for (size_t i = 0; i < layers.size(); i += 10) {
      check(layers[i], {hidden}, "input_norm");
      check(layers[i + 5], {hidden}, "post_norm");
      in_norm.push_back(layers[i]), post_norm.push_back(layers[i + 5]);
      qkv.push_back(mat(layers[i + 1], layers[i + 2], (H + 2 * Hkv) * D, hidden, "qkv"));
      o.push_back(mat(layers[i + 3], layers[i + 4], hidden, H * D, "o"));
      gate_up.push_back(mat(layers[i + 6], layers[i + 7], 2 * inter, hidden, "gate_up"));
      down.push_back(mat(layers[i + 8], layers[i + 9], hidden, inter, "down"));
      // gate's block b and up's block b + I / 32 hold the same outputs' two halves
      TORCH_CHECK(inter % 32 == 0, "Step: gate_up needs an intermediate size I that is a multiple of 32");
    }
    this->lm_head = mat(lm_head, lm_head_sz, vocab, hidden, "lm_head");
    for (size_t l = 0; l < k_cache.size(); ++l) {
      check(k_cache[l], {k_cache[0].size(0), block_size, Hkv, D}, "k_cache");
      check(v_cache[l], {k_cache[0].size(0), block_size, Hkv, D}, "v_cache");
    }
    check(final_norm, {hidden}, "final_norm");
    check(cos, {cos.size(0), D}, "cos");
    check(sin, {cos.size(0), D}, "sin");
  }

  // One forward step over T tokens of R sequences (a varlen batch: decodes, prefill chunks, or both), as
  // `ModelRunner.forward` computes it: ids, positions, slots [T] int64 (the cache slot of each new token), tables
  // [R, W] int32, ctx [R] int32 (each sequence's keys after this step's writes), cu_q [R + 1] int32 (sequence r's
  // tokens are cu_q[r] .. cu_q[r + 1], its last ones: token i of a sequence with q tokens sees ctx - q + i + 1 keys),
  // logits_idx [N] int64 (the tokens whose logits are wanted). Returns fp32 logits [N, V] and the final-normed hidden
  // states [N, hidden] of those tokens.
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor ids, torch::Tensor positions, torch::Tensor slots,
                                               torch::Tensor tables, torch::Tensor ctx, torch::Tensor cu_q,
                                               torch::Tensor logits_idx) {
    const int64_t T = ids.size(0), R = ctx.size(0), N = logits_idx.size(0);
    auto vec = [](const torch::Tensor& t, c10::ScalarType s) { return t.dim() == 1 && t.scalar_type() == s && t.is_contiguous(); };
    TORCH_CHECK(vec(ids, torch::kInt64) && vec(positions, torch::kInt64) && vec(slots, torch::kInt64) &&
                vec(ctx, torch::kInt32) && vec(cu_q, torch::kInt32) && vec(logits_idx, torch::kInt64) &&
                tables.scalar_type() == torch::kInt32 && tables.dim() == 2 && tables.is_contiguous() &&
                tables.size(0) == R && positions.size(0) == T && slots.size(0) == T && cu_q.size(0) == R + 1,
                "Step.run: ids, positions, slots [T] int64, tables [R, W] int32, ctx [R] int32, cu_q [R + 1] int32, "
                "logits_idx [N] int64");
    const int64_t *id = ids.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>(), *sl = slots.data_ptr<int64_t>();
    const int64_t *li = logits_idx.data_ptr<int64_t>();
    const int32_t *cl = ctx.data_ptr<int32_t>(), *cq = cu_q.data_ptr<int32_t>();
    const int64_t cached = k_cache[0].size(0) * block_size;
    std::vector<int32_t> trow(T), tctx(T);   // each token's sequence and the keys it sees
    int32_t max_ctx = 1;
    TORCH_CHECK(cq[0] == 0 && cq[R] == T, "Step.run: cu_q must run from 0 to the number of tokens ", T);
    for (int64_t r = 0; r < R; ++r) {
      const int32_t q = cq[r + 1] - cq[r];
      TORCH_CHECK(q >= 1 && q <= cl[r] && cl[r] <= tables.size(1) * block_size, "Step.run: sequence ", r, " has ", q,
                  " new tokens and a context of ", cl[r], " (needs 1 <= tokens <= context <= the block table's slots)");
      check_table(tables.data_ptr<int32_t>() + r * tables.size(1), cl[r], block_size, k_cache[0].size(0), "Step.run");
      for (int32_t i = 0; i < q; ++i) trow[cq[r] + i] = int32_t(r), tctx[cq[r] + i] = cl[r] - q + i + 1;
      max_ctx = std::max(max_ctx, cl[r]);
    }
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(id[t] >= 0 && id[t] < embed.size(0), "Step.run: token id ", id[t], " outside the vocabulary");
      TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "Step.run: position ", pos[t], " past the RoPE table");
      TORCH_CHECK(sl[t] >= 0 && sl[t] < cached, "Step.run: slot ", sl[t], " is not a slot of the cache (0..",
                  cached - 1, ")");
    }
    for (int64_t n = 0; n < N; ++n)
      TORCH_CHECK(li[n] >= 0 && li[n] < T, "Step.run: logits index ", li[n], " is not a token of the step");
    auto logits = torch::empty({N, vocab}, torch::kFloat32);
    auto hidden_out = torch::empty({N, hidden}, embed.options());
    {
      pybind11::gil_scoped_release no_gil;
      Args a{id, pos, sl, tables.data_ptr<int32_t>(), tables.size(1), trow.data(), tctx.data(), max_ctx, T, li, N};
      if (is_bf16)
        run_typed<bf16>(a, logits.data_ptr<float>(), (bf16*)hidden_out.data_ptr());
      else
        run_typed<float>(a, logits.data_ptr<float>(), hidden_out.data_ptr<float>());
    }
    return {logits, hidden_out};
  }

  // {"phases": names, "work": [threads][phases] seconds, "wait": same, "steps": n} since the last call; resets.
  pybind11::dict profile() {
    static const char* names[PHASES] = {"norm + qkv", "rope + cache write", "attention", "o + residual",
                                        "norm + gate_up + silu", "down + residual", "final norm + lm_head"};
    pybind11::list phases, work, wait;
    for (int p = 0; p < PHASES; ++p) phases.append(names[p]);
    for (size_t t = 0; t < prof_work.size() / PHASES; ++t) {
      pybind11::list w, q;
      for (int p = 0; p < PHASES; ++p) w.append(prof_work[t * PHASES + p]), q.append(prof_wait[t * PHASES + p]);
      work.append(w), wait.append(q);
    }
    pybind11::dict d;
    d["phases"] = phases, d["work"] = work, d["wait"] = wait, d["steps"] = prof_steps;
    std::fill(prof_work.begin(), prof_work.end(), 0.0), std::fill(prof_wait.begin(), prof_wait.end(), 0.0);
    prof_steps = 0;
    return d;
  }

  struct Args {
    const int64_t *id, *pos, *slots;
    const int32_t* tab;
    int64_t W;
    const int32_t *trow, *tctx;
    int32_t max_ctx;
    int64_t M;            // tokens
    const int64_t* lidx;  // logits rows
    int64_t N;
  };

  template <typename T> void run_typed(const Args& a, float* out, T* hid) {
    const int64_t M = a.M, QKV = (H + 2 * Hkv) * D, G = H / Hkv, L = (int64_t)qkv.size(), half = D / 2;
    const int nt = std::max(1, at::get_num_threads());
    if ((int64_t)prof_work.size() < nt * PHASES) prof_work.resize(nt * PHASES), prof_wait.resize(nt * PHASES);
    ++prof_steps;
    std::vector<float> h(M * hidden);                        // the residual stream (values of dtype T)
    std::vector<T> qkv_buf(M * QKV), attn(M * H * D), act(M * inter);
    std::vector<T> xn(size_t(nt) * M * hidden);               // each thread's normed copy of h
    std::vector<float> scores(size_t(nt) * (H / Hkv) * a.max_ctx);
    const int64_t KMAX = std::max({hidden, inter, H * D});
    std::vector<bf16> xq(any_q4 ? size_t(nt) * M * KMAX : 0);   // int4 inputs, per thread
    std::vector<float> xqs(any_q4 ? size_t(nt) * M * KMAX / 32 : 0);
    const T* E = (const T*)embed.data_ptr();
    for (int64_t t = 0; t < M; ++t)
      for (int64_t i = 0; i < hidden; ++i) h[t * hidden + i] = to_f(E[a.id[t] * hidden + i]);
    const T* C = (const T*)cos.data_ptr();
    const T* S = (const T*)sin.data_ptr();

    // HF RMSNorm as the engine does it: fp32 statistics, cast back, times the weight (each rounded to T); rows
    // `idx[i]` of h (all rows when idx is null) into dst's rows i.
    auto rms_norm = [&](const T* weight, T* dst, int64_t rows, const int64_t* idx) {
      for (int64_t i = 0; i < rows; ++i) {
        const float* x = h.data() + (idx ? idx[i] : i) * hidden;
        __m512 ss16 = _mm512_setzero_ps();
        float ss = 0.f;
        lanes16(hidden, [&](int64_t k) { ss16 = _mm512_fmadd_ps(load16(x + k), load16(x + k), ss16); },
                [&](int64_t k) { ss += x[k] * x[k]; });
        const float r = 1.f / std::sqrt((_mm512_reduce_add_ps(ss16) + ss) / hidden + eps);
        T* y = dst + i * hidden;
        lanes16(hidden, [&](int64_t k) {
          store16(y + k, _mm512_mul_ps(load16(weight + k), vround<T>(_mm512_mul_ps(load16(x + k), _mm512_set1_ps(r)))));
        }, [&](int64_t k) { put(y + k, to_f(weight[k]) * round_to<T>(x[k] * r)); });
      }
    };
    // RoPE of one head (x * cos + swap_halves(x) * signed_sin), in place.
    auto rope = [&](T* x, int64_t p) {
      alignas(64) float tmp[512];
      for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(tmp + d, load16(x + d));
      if (half % 16 == 0) {
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 sw = _mm512_load_ps(tmp + (d < half ? d + half : d - half));
          const __m512 a = vround<T>(_mm512_mul_ps(_mm512_load_ps(tmp + d), load16(C + p * D + d)));
          store16(x + d, _mm512_add_ps(a, vround<T>(_mm512_mul_ps(sw, load16(S + p * D + d)))));
        }
        return;
      }
      for (int64_t d = 0; d < D; ++d) {
        const float sw = tmp[d < half ? d + half : d - half];
        put(x + d, round_to<T>(tmp[d] * to_f(C[p * D + d])) + round_to<T>(sw * to_f(S[p * D + d])));
      }
    };

#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num();
      T* x = xn.data() + size_t(t) * M * hidden;
      float* sc = scores.data() + size_t(t) * (H / Hkv) * a.max_ctx;
      bf16* xp = any_q4 ? xq.data() + size_t(t) * M * KMAX : nullptr;
      float* xs = any_q4 ? xqs.data() + size_t(t) * M * KMAX / 32 : nullptr;
      float tb[MR * 32], tu[MR * 32];
      int64_t n0, n1;
      using clock = std::chrono::steady_clock;
      auto mark = clock::now();
      // the end of phase p: this thread's work since the last mark, then its wait at the barrier
      auto end_phase = [&](int p) {
        const auto done = clock::now();
        prof_work[t * PHASES + p] += std::chrono::duration<double>(done - mark).count();
        if (p < PHASES - 1) {
#pragma omp barrier
        }
        mark = clock::now();
        prof_wait[t * PHASES + p] += std::chrono::duration<double>(mark - done).count();
      };
      // int4: x rounded to bf16 with its group sums, once per product (each thread its own copy)
      auto prep = [&](const T* in, int64_t rows, const Mat& w) {
        if constexpr (std::is_same_v<T, float>) {
          if (w.q4()) prep_q4(in, rows, w.K, xp, xs);
        }
      };
      // this thread's share of w's outputs for `rows` rows of `in`: emit(m, n, v, cnt) with outputs n .. n + cnt of
      // row m in v (fp32 sums), blocks of 32 outputs by register tiles
      auto mm = [&](const T* in, int64_t rows, const Mat& w, auto&& emit) {
        prep(in, rows, w);
        share(w.blocks(), t, nt, n0, n1);
        for_tiles(rows, n0, n1, [&](int64_t m, int64_t r, int64_t b) {
          w.tile(m, r, in, xp, xs, b, tb);
          for (int64_t i = 0; i < r; ++i) emit(m + i, b * 32, tb + i * 32, std::min<int64_t>(32, w.N - b * 32));
        }, w.mr());
      };
      // h[m, n ..] = round(h + round(v)): the residual add
      auto residual = [&](int64_t m, int64_t n, const float* v, int64_t cnt) {
        float* y = h.data() + m * hidden + n;
        lanes16(cnt, [&](int64_t c) {
          _mm512_storeu_ps(y + c, vround<T>(_mm512_add_ps(_mm512_loadu_ps(y + c), vround<T>(_mm512_loadu_ps(v + c)))));
        }, [&](int64_t c) { y[c] = round_to<T>(y[c] + round_to<T>(v[c])); });
      };
      // act[m, n ..] = round(SiLU(round(gate))) * round(up), rounded
      auto silu_mul = [&](int64_t m, int64_t n, const float* gt, const float* up, int64_t cnt) {
        T* y = act.data() + m * inter + n;
        lanes16(cnt, [&](int64_t c) {
          const __m512 g = vround<T>(_mm512_loadu_ps(gt + c));
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
          const __m512 s = vround<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
          store16(y + c, _mm512_mul_ps(s, vround<T>(_mm512_loadu_ps(up + c))));
        }, [&](int64_t c) {
          const float g = round_to<T>(gt[c]);
          put(y + c, round_to<T>(g / (1.f + std::exp(-g))) * round_to<T>(up[c]));
        });
      };
      for (int64_t l = 0; l < L; ++l) {
        T* kc = (T*)k_cache[l].data_ptr();
        T* vc = (T*)v_cache[l].data_ptr();
        // 1. norm (every thread, its own copy), this thread's outputs of q, k, v
        rms_norm((const T*)in_norm[l].data_ptr(), x, M, nullptr);
        mm(x, M, qkv[l], [&](int64_t m, int64_t n, const float* v, int64_t cnt) {
          store_row(qkv_buf.data() + m * QKV + n, v, cnt);
        });
        end_phase(0);
        // 2. per (token, KV head): RoPE of its K and query heads, the new K / V into the cache
        for (int64_t u = t; u < M * Hkv; u += nt) {
          const int64_t i = u / Hkv, g = u % Hkv;
          T* row = qkv_buf.data() + i * QKV;
          rope(row + (H + g) * D, a.pos[i]);
          std::memcpy(kc + (a.slots[i] * Hkv + g) * D, row + (H + g) * D, D * sizeof(T));
          std::memcpy(vc + (a.slots[i] * Hkv + g) * D, row + (H + Hkv + g) * D, D * sizeof(T));
          for (int64_t qh = g * G; qh < (g + 1) * G; ++qh) rope(row + qh * D, a.pos[i]);
        }
        end_phase(1);
        // 3. attention of each token's query heads over the keys it sees (its sequence's earlier tokens, its own)
        for (int64_t u = t; u < M * Hkv; u += nt) {
          const int64_t i = u / Hkv, g = u % Hkv;
          attend(qkv_buf.data() + i * QKV + g * G * D, G, kc, vc, a.tab + a.trow[i] * a.W, 0, a.tctx[i], block_size,
                 Hkv, g, D, scale, sc, &attn[(i * H + g * G) * D]);
        }
        end_phase(2);
        // 4. o_proj and the residual add
        mm(attn.data(), M, o[l], residual);
        end_phase(3);
        // 5. norm, this thread's outputs of gate and up, SiLU(gate) * up
        rms_norm((const T*)post_norm[l].data_ptr(), x, M, nullptr);
        const Mat& gu = gate_up[l];   // gate's block b and up's block b + I / 32
        prep(x, M, gu);
        share(inter / 32, t, nt, n0, n1);
        for_tiles(M, n0, n1, [&](int64_t m, int64_t r, int64_t b) {
          gu.tile(m, r, x, xp, xs, b, tb);
          gu.tile(m, r, x, xp, xs, b + inter / 32, tu);
          for (int64_t i = 0; i < r; ++i) silu_mul(m + i, b * 32, tb + i * 32, tu + i * 32, 32);
        }, gu.mr());
        end_phase(4);
        // 6. down and the residual add
        mm(act.data(), M, down[l], residual);
        end_phase(5);
      }
      // final norm of the logits rows, the LM head (logits rounded to T as the engine's matmul output, in fp32)
      rms_norm((const T*)final_norm.data_ptr(), x, a.N, a.lidx);
      if (t == 0) std::memcpy(hid, x, a.N * hidden * sizeof(T));
      mm(x, a.N, lm_head, [&](int64_t m, int64_t n, const float* v, int64_t cnt) {
        float* y = out + m * vocab + n;
        lanes16(cnt, [&](int64_t c) { _mm512_storeu_ps(y + c, vround<T>(_mm512_loadu_ps(v + c))); },
                [&](int64_t c) { y[c] = round_to<T>(v[c]); });
      });
      end_phase(6);   // (the parallel region's end is its barrier)
    }
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a weight [N, K] in the kernel's layout: blocks of 32 outputs");
  m.def("gemm", &gemm, "y = x @ w.T for w = pack(w) of a [N, K] weight: (x, packed, N)");
  m.def("has_bf16", &has_bf16);
  m.def("paged_decode", &paged_decode, "decode attention read through the block tables: (q, k_cache, v_cache, "
        "tables, ctx, scale, window) -> [B, H, D]");
  pybind11::class_<Step>(m, "Step")
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t,
                          int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("run", &Step::run, "one forward step: (fp32 logits [N, V], final-normed hidden [N, hidden])")
      .def("profile", &Step::profile, "seconds of work and barrier wait per thread and phase since the last call");
}
