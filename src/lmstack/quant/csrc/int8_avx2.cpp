// int8 weight x int8 activation matmul for small M (batch-1 decode) with AVX2, FMA and F16C (compiled with
// -mavx2 -mfma -mf16c only). CS336 notes "量化": Int8Linear's weights, Q in [-127, 127] with one scale s[o]
// per output row (w = s[o]*Q), read once per decode step at one byte per weight.
//
// Weights by tiles of 16 output rows: packed (O/16, I/4, 64) int8, byte 4r+j of chunk c holding
// Q[16t+r, 4c+j], so one int32 lane per output row (two 256-bit halves of 8 rows) and no horizontal sums.
// Activations per row and group of G inputs as in int4_avx2.cpp: sx = max|x|/127, xq = round(x/sx), and
// with terms = 2 the rounded residual as a second int8 term (~15 bits). Then
//   y[o] = s[o] * sum_g sum_t sx_t[g] * sum_{i in g} Q[o,i]*xq_t[i].
// The u8 x s8 vpmaddubsw needs one unsigned operand: |xq| (u8) times Q with the sign of xq (vpsignb), so
// each product is Q*xq; a pair is at most 2*127*127 = 32258 < 2^15, then vpmaddwd with ones -> int32.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPrefetch = 8192;  // as in int4_vnni.cpp
constexpr int64_t kParallelWeights = 512 * 1024;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline __m256 vabs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

inline void store_i8x8(int8_t* dst, __m256i a) {  // 8 int32 -> 8 int8, saturated, in order
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  const __m128i b = _mm_packs_epi16(w, w);
  std::memcpy(dst, &b, 8);
}

// One group of G (a multiple of 8) inputs: TERMS int8 terms and their scales.
inline void quantise_group(const float* x, int64_t G, int terms, int8_t* q1, int8_t* q2, float* s1, float* s2) {
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < G; i += 8) amax = _mm256_max_ps(amax, vabs(_mm256_loadu_ps(x + i)));
  const float a = hmax(amax), s = a / 127.f, inv = a > 0.f ? 127.f / a : 0.f;
  *s1 = s;
  const __m256 vinv = _mm256_set1_ps(inv), vs = _mm256_set1_ps(s);
  __m256 rmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < G; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(v, vinv));  // round to nearest even
    store_i8x8(q1 + i, qi);
    if (terms == 2) rmax = _mm256_max_ps(rmax, vabs(_mm256_sub_ps(v, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(qi)))));
  }
  if (terms == 2) {
    const float b = hmax(rmax), inv2 = b > 0.f ? 127.f / b : 0.f;
    *s2 = b / 127.f;
    const __m256 vinv2 = _mm256_set1_ps(inv2);
    for (int64_t i = 0; i < G; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      const __m256 r = _mm256_sub_ps(v, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtps_epi32(_mm256_mul_ps(v, vinv)))));
      store_i8x8(q2 + i, _mm256_cvtps_epi32(_mm256_mul_ps(r, vinv2)));
    }
  }
}

// One tile of 16 output rows for NR activation rows, each TERMS int8 rows (xq row k = r*TERMS+t, its
// |xq| in ax, scales sx[k*NG + g]).
template <int NR, int TERMS>
inline void tile_rows(const int8_t* w, const int8_t* xq, const uint8_t* ax, const float* sx, const float* sw,
                      float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
  constexpr int K = NR * TERMS;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc0[NR], acc1[NR];
  for (int r = 0; r < NR; ++r) { acc0[r] = _mm256_setzero_ps(); acc1[r] = _mm256_setzero_ps(); }
  const int64_t chunks = G / 4;
  for (int64_t g = 0; g < NG; ++g) {
    __m256i i0[K], i1[K];
    for (int k = 0; k < K; ++k) { i0[k] = _mm256_setzero_si256(); i1[k] = _mm256_setzero_si256(); }
    for (int64_t c = 0; c < chunks; ++c, w += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
      for (int k = 0; k < K; ++k) {
        const int64_t off = k * I + g * G + c * 4;
        int32_t xs, xa;
        std::memcpy(&xs, xq + off, 4);
        std::memcpy(&xa, ax + off, 4);
        const __m256i bs = _mm256_set1_epi32(xs), ba = _mm256_set1_epi32(xa);
        i0[k] = _mm256_add_epi32(i0[k], _mm256_madd_epi16(_mm256_maddubs_epi16(ba, _mm256_sign_epi8(v0, bs)), ones));
        i1[k] = _mm256_add_epi32(i1[k], _mm256_madd_epi16(_mm256_maddubs_epi16(ba, _mm256_sign_epi8(v1, bs)), ones));
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < TERMS; ++t) {
        const int k = r * TERMS + t;
        const __m256 sc = _mm256_set1_ps(sx[k * NG + g]);
        acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[k]), sc, acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[k]), sc, acc1[r]);
      }
  }
  const __m256 s0 = _mm256_loadu_ps(sw), s1 = _mm256_loadu_ps(sw + 8);
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(y + r * O, _mm256_mul_ps(acc0[r], s0));
    _mm256_storeu_ps(y + r * O + 8, _mm256_mul_ps(acc1[r], s1));
  }
}

template <int TERMS>
void run_tiles(const int8_t* wp, const float* swp, const int8_t* xqp, const uint8_t* axp, const float* sxp,
               float* yp, int64_t M, int64_t I, int64_t G, int64_t NG, int64_t O, int64_t T) {
  constexpr int STEP = TERMS == 1 ? 2 : 1;
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int8_t* w = wp + t * (I / 4) * 64;
      int64_t r = 0;
      for (; r + STEP <= M; r += STEP)
        tile_rows<STEP, TERMS>(w, xqp + r * TERMS * I, axp + r * TERMS * I, sxp + r * TERMS * NG, swp + t * 16,
                               yp + r * O + t * 16, I, G, NG, O);
      for (; r < M; ++r)
        tile_rows<1, TERMS>(w, xqp + r * TERMS * I, axp + r * TERMS * I, sxp + r * TERMS * NG, swp + t * 16,
                            yp + r * O + t * 16, I, G, NG, O);
    }
  };
  if (at::get_num_threads() > 1 && M * T * 16 * I >= kParallelWeights) at::parallel_for(0, T, 1, body); else body(0, T);
}

struct Scratch {
  std::vector<int8_t> xq;
  std::vector<uint8_t> ax;
  std::vector<float> sx;
};

at::Tensor int8_avx2_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale, int64_t G,
                        int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "int8_avx2_mm: terms must be 1 or 2, got ", terms);
  TORCH_CHECK(x_in.dim() == 2, "int8_avx2_mm: x must be (M, I), got ", x_in.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous(),
              "int8_avx2_mm: packed must be contiguous int8 (O/16, I/4, 64)");
  const int64_t M = x_in.size(0), I = x_in.size(1), T = packed.size(0), O = 16 * T;
  TORCH_CHECK(packed.size(1) * 4 == I, "int8_avx2_mm: x has ", I, " features, weights ", packed.size(1) * 4);
  TORCH_CHECK(G % 8 == 0 && I % G == 0, "int8_avx2_mm: group size ", G, " must be a multiple of 8 dividing ", I);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == O && scale.is_contiguous(),
              "int8_avx2_mm: scale must be contiguous fp32 (O,)");
  const int64_t NG = I / G;
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  static thread_local Scratch s;
  s.xq.resize(static_cast<size_t>(M * terms * I));
  s.ax.resize(static_cast<size_t>(M * terms * I));
  s.sx.resize(static_cast<size_t>(M * terms * NG));
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < NG; ++g) {
      int8_t* q1 = s.xq.data() + (r * terms) * I + g * G;
      float* s1 = s.sx.data() + (r * terms) * NG + g;
      quantise_group(xp + r * I + g * G, G, static_cast<int>(terms), q1, terms == 2 ? q1 + I : nullptr, s1,
                     terms == 2 ? s1 + NG : nullptr);
    }
  for (size_t i = 0; i < s.xq.size(); ++i) s.ax[i] = static_cast<uint8_t>(std::abs(static_cast<int>(s.xq[i])));
  at::Tensor y = at::empty({M, O}, x.options());
  const int8_t* wp = packed.data_ptr<int8_t>();
  if (terms == 1)
    run_tiles<1>(wp, scale.data_ptr<float>(), s.xq.data(), s.ax.data(), s.sx.data(), y.data_ptr<float>(), M, I, G, NG, O, T);
  else
    run_tiles<2>(wp, scale.data_ptr<float>(), s.xq.data(), s.ax.data(), s.sx.data(), y.data_ptr<float>(), M, I, G, NG, O, T);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack_quant, lib) {
  lib.def("int8_avx2_mm(Tensor x, Tensor packed, Tensor scale, int G, int terms=2) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmstack_quant, CPU, lib) {
  lib.impl("int8_avx2_mm", &int8_avx2_mm);
}
