// The engine's optional native path (`engine/native.py`): a GEMV for the few rows of a decode step, and a whole
// Llama-family decode step in one call.
//
// Why a whole step: at batch 1 a decode step in torch is ~1,000 small ops (norms, RoPE, cache writes, attention,
// residual adds) of a few microseconds of dispatch each, around ~120 matrix-vector products that stream the weights.
// `Step.run` does the same work as `ModelRunner.forward` for a pure decode batch inside one OpenMP parallel region:
// every product is split over the threads by output rows (statically, an equal share each: taking chunks of 16 rows
// from a shared counter instead, as llama.cpp does, measured 1.1-1.8x slower per step here, the threads' reads no
// longer two long streams), the threads meet at a barrier between dependent phases
// (5 per layer), and everything between the products (RMSNorm, RoPE, the paged-cache write, attention over the
// block table, SiLU, the residual adds) is plain loops on data that is already in cache. This is how llama.cpp runs
// a token (a pre-planned graph of kernels and a spinning thread pool), and what CUDA-graph capture buys on a GPU.
//
// Numbers follow the engine's torch path: weights, activations and the KV cache in the engine's dtype (fp32 or
// bf16), rounded to it where torch rounds (after each product, the norm, RoPE, SiLU and every residual add); the
// norm's statistics, attention's scores and softmax, and every dot product accumulate in fp32.
// GEMV: each weight row is read from memory once and multiplied by all M rows of x while it sits in L1; fp32 with
// AVX-512 FMA (16 products per instruction), bf16 with AVX512-BF16 `dpbf16` (32), int4 codes unpacked in registers
// (below). K must be a multiple of 16 (fp32), 32 (bf16) or 64 (int4), head_dim a multiple of 16; native.py checks.
// `paged_decode` is the step's attention on its own, for the torch path's larger decode batches.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

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

// ---- dot products of one weight row with one x row (4 accumulators: 64 / 128 numbers per iteration) -------------
inline float dot(const float* x, const float* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), _mm512_loadu_ps(w + k + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48), _mm512_loadu_ps(w + k + 48), a3);
  }
  for (; k < K; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}

#if defined(__AVX512BF16__)
inline __m512bh bh(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline float dot(const bf16* x, const bf16* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    a0 = _mm512_dpbf16_ps(a0, bh(x + k), bh(w + k));
    a1 = _mm512_dpbf16_ps(a1, bh(x + k + 32), bh(w + k + 32));
    a2 = _mm512_dpbf16_ps(a2, bh(x + k + 64), bh(w + k + 64));
    a3 = _mm512_dpbf16_ps(a3, bh(x + k + 96), bh(w + k + 96));
  }
  for (; k < K; k += 32) a0 = _mm512_dpbf16_ps(a0, bh(x + k), bh(w + k));
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#else
inline float dot(const bf16*, const bf16*, int64_t) { TORCH_CHECK(false, "bf16 needs AVX512-BF16"); }
#endif

// This thread's share [n0, n1) of N output rows.
inline void share(int64_t N, int t, int nt, int64_t& n0, int64_t& n1) { n0 = N * t / nt; n1 = N * (t + 1) / nt; }

// ---- int4 weights (the engine's `quantization="int4"`, `quant.weight_only.WeightOnlyInt4` with groups of 32) ------
// Row n: K/2 bytes of codes (element 2i in the low nibble of byte i, 2i+1 in the high one) and per group of 32 a bf16
// scale and zero; the weight is (q - 8) * scale + zero, as torch's int4 kernel computes it. So
// x . w = sum over groups of scale * (x_g . q_g) + (zero - 8 scale) * sum(x_g).
// x is prepared once per product (`prep_q4`), rounded to bf16 as torch's int4 kernel takes its input: per block of
// two groups (64 numbers, 32 bytes of codes) the 32 even-indexed numbers, then the 32 odd ones (the nibble order), and
// per group the pair (-8 sum(x_g), sum(x_g)) that multiplies the group's (scale, zero). In the loop, 32 bytes of
// codes become 64 bf16 weights by two table lookups (`vpermw`: the code is the index into 0..15 in bf16, exact) and
// two `dpbf16` multiply them by x, summing in fp32; each group's half of the accumulator is then scaled by its
// group's scale. The zeros' part is one more dot product, of the (scale, zero) pairs with the prepared sums.
#if defined(__AVX512BF16__)
inline float dot_q4(const bf16* xp, const float* xsum, const uint8_t* q, const bf16* sz, int64_t K) {
  const __m512i table = _mm512_set_epi16(0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0,
                                         0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,   // 15 .. 0
                                         0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0,
                                         0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  const __m512i low = _mm512_set1_epi16(0xF);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 32; g += 2) {
    const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(q + g * 16)));   // 2 codes per lane
    const __m512i even = _mm512_permutexvar_epi16(_mm512_and_si512(c, low), table);
    const __m512i odd = _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 4), table);
    __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(xp + g * 32), (__m512bh)even);
    t = _mm512_dpbf16_ps(t, (__m512bh)_mm512_loadu_si512(xp + g * 32 + 32), (__m512bh)odd);
    const float s0 = to_f(sz[2 * g]), s1 = to_f(sz[2 * g + 2]);
    acc = _mm512_fmadd_ps(t, _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0), _mm512_set1_ps(s1)), acc);
  }
  // the zeros' part: (scale, zero) pairs times (-8 sum(x_g), sum(x_g)) pairs, 8 groups per instruction
  int64_t i = 0;
  for (; i + 16 <= K / 16; i += 16) acc = _mm512_fmadd_ps(load16(sz + i), _mm512_loadu_ps(xsum + i), acc);
  float zsum = 0.f;
  for (; i < K / 16; ++i) zsum += to_f(sz[i]) * xsum[i];
  return _mm512_reduce_add_ps(acc) + zsum;
}
#else
inline float dot_q4(const bf16*, const float*, const uint8_t*, const bf16*, int64_t) {
  TORCH_CHECK(false, "int4 needs AVX512-BF16");
}
#endif

inline void prep_q4(const float* x, int64_t M, int64_t K, bf16* xp, float* xsum) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / 32; g += 2) {
      const float* src = x + m * K + g * 32;
      bf16* dst = xp + m * K + g * 32;
      for (int h = 0; h < 2; ++h) {   // group g + h: its evens go to lanes 16h.., its odds to 32 + 16h..
        float sum = 0.f;
        for (int i = 0; i < 16; ++i) {
          put(dst + 16 * h + i, src[32 * h + 2 * i]), put(dst + 32 + 16 * h + i, src[32 * h + 2 * i + 1]);
          sum += to_f(dst[16 * h + i]) + to_f(dst[32 + 16 * h + i]);
        }
        xsum[m * (K / 16) + 2 * (g + h)] = -8.f * sum, xsum[m * (K / 16) + 2 * (g + h) + 1] = sum;
      }
    }
}

// One weight matrix of the step, [N, K]: dense in the step's dtype, or int4 codes + bf16 scales and zeros.
struct Mat {
  torch::Tensor w, sz;   // sz empty for a dense matrix
  int64_t N = 0, K = 0;
  const void* wp = nullptr;
  const bf16* szp = nullptr;
  bool q4() const { return szp != nullptr; }
};

// x[m] . w[n] where `xp`, `xs` hold x prepared by `prep_q4` for an int4 w (the result rounded to bf16, as torch's
// int4 kernel returns it).
template <typename T>
inline float row_dot(const T* x, const bf16* xp, const float* xs, int64_t m, const Mat& w, int64_t n) {
  const int64_t K = w.K;
  if (w.q4())
    return round_to<bf16>(
        dot_q4(xp + m * K, xs + m * (K / 16), (const uint8_t*)w.wp + n * (K / 2), w.szp + n * (K / 16), K));
  return dot(x + m * K, (const T*)w.wp + n * K, K);
}

// y = x w^T: every weight row read once, for all M rows of x.
template <typename T> torch::Tensor gemv_typed(const torch::Tensor& x, const torch::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const T *xp = (const T*)x.data_ptr(), *wp = (const T*)w.data_ptr();
  T* yp = (T*)y.data_ptr();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) put(yp + m * N + n, dot(xp + m * K, wp + n * K, K));
  });
  return y;
}

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
  if (x.scalar_type() == torch::kFloat32) {
    TORCH_CHECK(x.size(1) % 16 == 0, "gemv: fp32 K must be a multiple of 16");
    return gemv_typed<float>(x, w);
  }
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && has_bf16(), "gemv: fp32, or bf16 on a CPU with AVX512-BF16");
  TORCH_CHECK(x.size(1) % 32 == 0, "gemv: bf16 K must be a multiple of 32");
  return gemv_typed<bf16>(x, w);
}

// ---- decode attention over the paged cache ------------------------------------------------------------------------
// The blocks a row reads (the first ceil(ctx / block_size) entries of its table) must be blocks of the cache: a wrong
// table is refused before any read or write, never followed out of the cache.
inline void check_table(const int32_t* row, int32_t ctx, int64_t block_size, int64_t num_blocks, const char* who) {
  for (int64_t i = 0; i < (ctx + block_size - 1) / block_size; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, who, ": block ", row[i], " of a block table is not a block of "
                "the cache (0..", num_blocks - 1, ")");
}

// One query head q [D] (RoPE applied) of a sequence whose keys j0 <= j < ctx sit in its blocks `table` of the cache
// [num_blocks, block_size, Hkv, D], KV head g: softmax(q K^T * scale) V into out [D]. Scores and the weighted sum
// in fp32 (`sc` holds ctx scores, `ac` D sums); read through the block table, nothing gathered.
template <typename T>
inline void attend(const T* q, const T* kc, const T* vc, const int32_t* table, int32_t j0, int32_t ctx,
                   int64_t block_size, int64_t Hkv, int64_t g, int64_t D, float scale, float* sc, float* ac, T* out) {
  __m512 qv[32];   // D <= 512
  for (int64_t d = 0; d < D; d += 16) qv[d / 16] = load16(q + d);
  float mx = -INFINITY;
  for (int32_t j = j0; j < ctx; ++j) {
    const T* k = kc + ((int64_t(table[j / block_size]) * block_size + j % block_size) * Hkv + g) * D;
    __m512 s = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) s = _mm512_fmadd_ps(qv[d / 16], load16(k + d), s);
    sc[j] = _mm512_reduce_add_ps(s) * scale;
    mx = std::max(mx, sc[j]);
  }
  float sum = 0.f;
  for (int32_t j = j0; j < ctx; ++j) sum += (sc[j] = std::exp(sc[j] - mx));
  for (int64_t d = 0; d < D; ++d) ac[d] = 0.f;
  for (int32_t j = j0; j < ctx; ++j) {
    const T* v = vc + ((int64_t(table[j / block_size]) * block_size + j % block_size) * Hkv + g) * D;
    const __m512 p = _mm512_set1_ps(sc[j]);
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(ac + d, _mm512_fmadd_ps(p, load16(v + d), _mm512_loadu_ps(ac + d)));
  }
  for (int64_t d = 0; d < D; ++d) put(out + d, ac[d] / sum);
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
      std::vector<float> sc(max_ctx), ac(D);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = u / Hkv, g = u % Hkv;
        const int32_t j0 = window > 0 ? std::max<int64_t>(0, cl[b] - window) : 0;
        for (int64_t qh = g * G; qh < (g + 1) * G; ++qh)
          attend(qp + b * qs + qh * D, kc, vc, tab + b * W, j0, cl[b], bs, Hkv, g, D, float(scale), sc.data(),
                 ac.data(), op + (b * H + qh) * D);
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

// ---- the whole decode step ---------------------------------------------------------------------------------------

struct Step {
  // Per layer, HF orientation [out, in]: qkv [(H + 2 Hkv) D, hidden], o [hidden, H D], gate_up [2 I, hidden] (gate
  // rows first), down [hidden, I]; the norms' weights [hidden]. K/V caches [num_blocks, block_size, Hkv, D].
  std::vector<torch::Tensor> in_norm, post_norm, k_cache, v_cache;
  std::vector<Mat> qkv, o, gate_up, down;
  Mat lm_head;
  torch::Tensor embed, final_norm, cos, sin;   // embed [V, hidden]; lm_head [V, hidden]; cos / signed sin [P, D]
  int64_t H, Hkv, D, hidden, inter, vocab, block_size;
  float eps, scale;
  bool is_bf16;

  // `layers`: per layer input_norm, qkv, qkv_sz, o, o_sz, post_norm, gate_up, gate_up_sz, down, down_sz, where a
  // matrix's `_sz` is an empty tensor for a dense weight, or the bf16 scales and zeros [N, K / 32, 2] of uint8 codes.
  Step(std::vector<torch::Tensor> layers, torch::Tensor embed, torch::Tensor final_norm, torch::Tensor lm_head,
       torch::Tensor lm_head_sz, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> k_cache,
       std::vector<torch::Tensor> v_cache, int64_t H, int64_t Hkv, int64_t D, double eps, double scale)
      : k_cache(k_cache), v_cache(v_cache), embed(embed), final_norm(final_norm), cos(cos), sin(sin), H(H), Hkv(Hkv),
        D(D), eps(float(eps)), scale(float(scale)) {
    TORCH_CHECK(layers.size() % 10 == 0 && layers.size() / 10 == k_cache.size() && k_cache.size() == v_cache.size(),
                "Step: 10 tensors per layer (input_norm, qkv, qkv_sz, o, o_sz, post_norm, gate_up, gate_up_sz, down, "
                "down_sz) and one K, V cache each");
    const auto dt = embed.scalar_type();
    TORCH_CHECK(dt == torch::kFloat32 || (dt == torch::kBFloat16 && has_bf16()),
                "Step: fp32, or bf16 with AVX512-BF16");
    TORCH_CHECK(D <= 512, "Step: head_dim up to 512");
    is_bf16 = dt == torch::kBFloat16;
    hidden = embed.size(1), vocab = lm_head.size(0), inter = layers[6].size(0) / 2;
    block_size = k_cache[0].size(1);
    TORCH_CHECK(D % 16 == 0 && hidden % 32 == 0 && inter % 32 == 0 && (H * D) % 32 == 0, "Step: unsupported shapes");
    auto check = [&](const torch::Tensor& t, std::vector<int64_t> shape, const char* what) {
      TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.sizes().vec() == shape, "Step: ", what,
                  " must be contiguous, of the embedding's dtype, shaped ", c10::IntArrayRef(shape));
    };
    // a dense matrix in the step's dtype, or int4 (fp32 steps only): codes [N, K / 2] uint8, sz [N, K / 32, 2] bf16
    auto mat = [&](const torch::Tensor& w, const torch::Tensor& sz, int64_t N, int64_t K, const char* what) {
      Mat m{w, sz, N, K, w.data_ptr(), sz.numel() ? (const bf16*)sz.data_ptr() : nullptr};
      if (!m.q4()) {
        check(w, {N, K}, what);
        return m;
      }
      TORCH_CHECK(dt == torch::kFloat32, "Step: int4 weights with fp32 activations only (", what, ")");
      const std::vector<int64_t> codes{N, K / 2}, scales{N, K / 32, 2};
      const bool ok = w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.sizes().vec() == codes &&
                      sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.sizes().vec() == scales &&
                      K % 64 == 0 && has_bf16();
      TORCH_CHECK(ok, "Step: int4 ", what, " must be uint8 codes [", N, ", ", K / 2, "] and bf16 scales and zeros [", N,
                  ", ", K / 32, ", 2] (groups of 32, K a multiple of 64, a CPU with AVX512-BF16)");
      return m;
    };
    for (size_t i = 0; i < layers.size(); i += 10) {
      check(layers[i], {hidden}, "input_norm");
      check(layers[i + 5], {hidden}, "post_norm");
      in_norm.push_back(layers[i]), post_norm.push_back(layers[i + 5]);
      qkv.push_back(mat(layers[i + 1], layers[i + 2], (H + 2 * Hkv) * D, hidden, "qkv"));
      o.push_back(mat(layers[i + 3], layers[i + 4], hidden, H * D, "o"));
      gate_up.push_back(mat(layers[i + 6], layers[i + 7], 2 * inter, hidden, "gate_up"));
      down.push_back(mat(layers[i + 8], layers[i + 9], hidden, inter, "down"));
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

  // One decode step of B sequences (one token each): ids, positions [B] int64, slots [B] int64 (cache slot of each
  // new token), tables [B, W] int32, ctx [B] int32 (keys after this step's write). Returns fp32 logits [B, V] and
  // the final-normed hidden states [B, hidden].
  std::tuple<torch::Tensor, torch::Tensor> run(torch::Tensor ids, torch::Tensor positions, torch::Tensor slots,
                                               torch::Tensor tables, torch::Tensor ctx) {
    const int64_t B = ids.size(0);
    TORCH_CHECK(ids.scalar_type() == torch::kInt64 && positions.scalar_type() == torch::kInt64 &&
                slots.scalar_type() == torch::kInt64 && tables.scalar_type() == torch::kInt32 &&
                ctx.scalar_type() == torch::kInt32 && tables.dim() == 2 && tables.size(0) == B &&
                positions.size(0) == B && slots.size(0) == B && ctx.size(0) == B && ids.is_contiguous() &&
                positions.is_contiguous() && slots.is_contiguous() && ctx.is_contiguous() && tables.is_contiguous(),
                "Step.run: ids, positions, slots [B] int64, tables [B, W] int32, ctx [B] int32");
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int32_t* cl = ctx.data_ptr<int32_t>();
    int32_t max_ctx = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(pos[b] >= 0 && pos[b] < cos.size(0), "Step.run: position ", pos[b], " past the RoPE table");
      TORCH_CHECK(cl[b] >= 1 && cl[b] <= tables.size(1) * block_size, "Step.run: context length ", cl[b],
                  " does not fit the block table");
      const int64_t slot = slots.data_ptr<int64_t>()[b], cached = k_cache[0].size(0) * block_size;
      TORCH_CHECK(slot >= 0 && slot < cached, "Step.run: slot ", slot, " is not a slot of the cache (0..", cached - 1,
                  ")");
      check_table(tables.data_ptr<int32_t>() + b * tables.size(1), cl[b], block_size, k_cache[0].size(0), "Step.run");
      max_ctx = std::max(max_ctx, cl[b]);
    }
    auto logits = torch::empty({B, vocab}, torch::kFloat32);
    auto hidden_out = torch::empty({B, hidden}, embed.options());
    {
      pybind11::gil_scoped_release no_gil;
      if (is_bf16)
        run_typed<bf16>(ids, pos, slots.data_ptr<int64_t>(), tables, cl, max_ctx, logits, hidden_out);
      else
        run_typed<float>(ids, pos, slots.data_ptr<int64_t>(), tables, cl, max_ctx, logits, hidden_out);
    }
    return {logits, hidden_out};
  }

  template <typename T>
  void run_typed(const torch::Tensor& ids, const int64_t* pos, const int64_t* slots, const torch::Tensor& tables,
                 const int32_t* ctx, int32_t max_ctx, torch::Tensor& logits, torch::Tensor& hidden_out) {
    const int64_t B = ids.size(0), W = tables.size(1), QKV = (H + 2 * Hkv) * D, G = H / Hkv;
    const int nt = std::max(1, at::get_num_threads());
    const int64_t* id = ids.data_ptr<int64_t>();
    const int32_t* tab = tables.data_ptr<int32_t>();
    std::vector<float> h(B * hidden);                        // the residual stream (values of dtype T)
    std::vector<T> qkv_buf(B * QKV), attn(B * H * D), act(B * inter);
    std::vector<T> xn(size_t(nt) * B * hidden);               // each thread's normed copy of h
    std::vector<float> scores(size_t(nt) * max_ctx), acc(size_t(nt) * D);
    const int64_t KMAX = std::max({hidden, inter, H * D});
    std::vector<bf16> xq(size_t(nt) * B * KMAX);   // int4 inputs, per thread
    std::vector<float> xqs(size_t(nt) * B * KMAX / 16);
    const T* E = (const T*)embed.data_ptr();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(id[b] >= 0 && id[b] < embed.size(0), "Step.run: token id ", id[b], " outside the vocabulary");
      for (int64_t i = 0; i < hidden; ++i) h[b * hidden + i] = to_f(E[id[b] * hidden + i]);
    }
    float* out = logits.data_ptr<float>();
    T* hid = (T*)hidden_out.data_ptr();
    const T* C = (const T*)cos.data_ptr();
    const T* S = (const T*)sin.data_ptr();
    const int64_t L = (int64_t)qkv.size(), half = D / 2;

    // HF RMSNorm as the engine does it: fp32 statistics, cast back, times the weight (each rounded to T).
    auto rms_norm = [&](const T* weight, T* dst) {
      for (int64_t b = 0; b < B; ++b) {
        const float* x = h.data() + b * hidden;
        float ss = 0.f;
        for (int64_t i = 0; i < hidden; ++i) ss += x[i] * x[i];
        const float r = 1.f / std::sqrt(ss / hidden + eps);
        for (int64_t i = 0; i < hidden; ++i) put(dst + b * hidden + i, to_f(weight[i]) * round_to<T>(x[i] * r));
      }
    };
    // RoPE of one head (x * cos + swap_halves(x) * signed_sin), in place.
    auto rope = [&](T* x, int64_t p) {
      float tmp[512];
      for (int64_t d = 0; d < D; ++d) tmp[d] = to_f(x[d]);
      for (int64_t d = 0; d < D; ++d) {
        const float sw = tmp[d < half ? d + half : d - half];
        put(x + d, round_to<T>(tmp[d] * to_f(C[p * D + d])) + round_to<T>(sw * to_f(S[p * D + d])));
      }
    };

#pragma omp parallel num_threads(nt)
    {
      const int t = omp_get_thread_num();
      T* x = xn.data() + size_t(t) * B * hidden;
      float* sc = scores.data() + size_t(t) * max_ctx;
      float* ac = acc.data() + size_t(t) * D;
      bf16* xp = xq.data() + size_t(t) * B * KMAX;
      float* xs = xqs.data() + size_t(t) * B * KMAX / 16;
      int64_t n0, n1;
      // this thread's rows [n0, n1) of w times the B rows of `in`: emit(m, n, value)
      auto gemv = [&](const T* in, const Mat& w, auto&& emit) {
        if constexpr (std::is_same_v<T, float>) {
          if (w.q4()) prep_q4(in, B, w.K, xp, xs);
        }
        share(w.N, t, nt, n0, n1);
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t m = 0; m < B; ++m) emit(m, n, row_dot(in, xp, xs, m, w, n));
      };
      for (int64_t l = 0; l < L; ++l) {
        T* kc = (T*)k_cache[l].data_ptr();
        T* vc = (T*)v_cache[l].data_ptr();
        // 1. norm (every thread, its own copy), this thread's rows of q, k, v
        rms_norm((const T*)in_norm[l].data_ptr(), x);
        gemv(x, qkv[l], [&](int64_t m, int64_t n, float v) { put(&qkv_buf[m * QKV + n], v); });
#pragma omp barrier
        // 2. per (sequence, KV head): RoPE and cache write of the new K / V, then attention of its G query heads
        for (int64_t u = t; u < B * Hkv; u += nt) {
          const int64_t b = u / Hkv, g = u % Hkv;
          T* row = qkv_buf.data() + b * QKV;
          rope(row + (H + g) * D, pos[b]);
          T* kdst = kc + (slots[b] * Hkv + g) * D;
          T* vdst = vc + (slots[b] * Hkv + g) * D;
          std::memcpy(kdst, row + (H + g) * D, D * sizeof(T));
          std::memcpy(vdst, row + (H + Hkv + g) * D, D * sizeof(T));
          for (int64_t qh = g * G; qh < (g + 1) * G; ++qh) {
            rope(row + qh * D, pos[b]);
            attend(row + qh * D, kc, vc, tab + b * W, 0, ctx[b], block_size, Hkv, g, D, scale, sc, ac,
                   &attn[(b * H + qh) * D]);
          }
        }
#pragma omp barrier
        // 3. o_proj and the residual add, this thread's rows of h
        gemv(attn.data(), o[l], [&](int64_t m, int64_t n, float v) {
          h[m * hidden + n] = round_to<T>(h[m * hidden + n] + round_to<T>(v));
        });
#pragma omp barrier
        // 4. norm, this thread's rows of gate and up, SiLU(gate) * up
        rms_norm((const T*)post_norm[l].data_ptr(), x);
        if constexpr (std::is_same_v<T, float>) {
          if (gate_up[l].q4()) prep_q4(x, B, hidden, xp, xs);
        }
        share(inter, t, nt, n0, n1);
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t m = 0; m < B; ++m) {
            const float gt = round_to<T>(row_dot(x, xp, xs, m, gate_up[l], n));
            const float up = round_to<T>(row_dot(x, xp, xs, m, gate_up[l], inter + n));
            put(&act[m * inter + n], round_to<T>(gt / (1.f + std::exp(-gt))) * up);
          }
#pragma omp barrier
        // 5. down and the residual add
        gemv(act.data(), down[l], [&](int64_t m, int64_t n, float v) {
          h[m * hidden + n] = round_to<T>(h[m * hidden + n] + round_to<T>(v));
        });
#pragma omp barrier
      }
      // final norm, the LM head (logits rounded to T as the engine's matmul output, returned in fp32)
      rms_norm((const T*)final_norm.data_ptr(), x);
      if (t == 0) std::memcpy(hid, x, B * hidden * sizeof(T));
      gemv(x, lm_head, [&](int64_t m, int64_t n, float v) { out[m * vocab + n] = round_to<T>(v); });
    }
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w.T for a few rows of x; w [N, K] read once");
  m.def("has_bf16", &has_bf16);
  m.def("paged_decode", &paged_decode, "decode attention read through the block tables: (q, k_cache, v_cache, "
        "tables, ctx, scale, window) -> [B, H, D]");
  pybind11::class_<Step>(m, "Step")
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor,
                          torch::Tensor, torch::Tensor, std::vector<torch::Tensor>, std::vector<torch::Tensor>, int64_t,
                          int64_t, int64_t, double, double>())
      .def("run", &Step::run, "one decode step: (fp32 logits [B, V], final-normed hidden [B, hidden])");
}
