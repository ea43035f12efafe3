// int4 weight x int8 activation matmul for small M (batch-1 decode) with AVX2, FMA and F16C: the twin of
// int4_vnni.cpp for CPUs without AVX-512 VNNI (most laptops, AMD Zen 1-3, many cloud VMs). Compiled with
// -mavx2 -mfma -mf16c only, so it runs on any AVX2 CPU.
// Seed 001 "量化" / "性能指标分析": a decode step reads every weight once, so the kernel must keep up
// with memory (0.5 byte per weight) rather than spend its time unpacking or in per-call overhead.
//
// Same packed layout, same formula as int4_vnni.cpp (codes q in [0, 15], w = d*q + m per group of G
// inputs; packed (O/16, I/8, 64) bytes, byte 4r+j of chunk c holding q[16t+r, 8c+j] low and
// q[16t+r, 8c+4+j] high; d, m fp16 (O/16, I/G, 16); activations per row and group sx = max|x|/127,
// xq = round(x/sx), xs = sum x):  y[o] = sum_g d[o,g]*sx[g]*sum_{i in g} q[o,i]*xq[i] + m[o,g]*xs[g].
// AVX2 has no vpdpbusd, so the u8 x s8 dot product of 4 bytes per int32 lane is the pair
// vpmaddubsw (u8 x s8 -> s16, adjacent pairs summed) + vpmaddwd with ones (-> s32, adjacent s16 summed),
// as in llama.cpp's Q4_1 x Q8_1 dot product. The 64-byte chunk is two 256-bit halves of 8 rows each, so
// again one lane per output row and no horizontal sums. The s16 sums of up to 4 chunks (16 products of
// |q| <= 15, |xq| <= 127: at most 30480 < 2^15) are added before the one vpmaddwd, which halves its count.
// terms = 2: each activation is two int8 terms, x ~ sx1*xq1 + sx2*xq2 (xq2 the rounded residual), both
// accumulated into one output.
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

// As in int4_vnni.cpp: prefetch the codes this far ahead, split over threads from this much work on.
constexpr int64_t kPrefetch = 8192;
constexpr int64_t kParallelWeights = 512 * 1024;
// Chunks of 8 inputs whose int16 partial sums fit before vpmaddwd: 4 chunks x 4 products x 15 x 127 < 2^15.
constexpr int64_t kChunksPerS16 = 4;

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256 vabs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

// 16 int32 (a: 0-7, b: 8-15) -> 16 int8 in order, saturated (AVX2 has no vpmovsdb).
inline void store_i8x16(int8_t* dst, __m256i a, __m256i b) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // 16 int16 in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

// One group of G inputs of one activation row: TERMS int8 terms, their scales, and the exact sum.
inline void quantise_group(const float* x, int64_t G, int terms, int8_t* q1, int8_t* q2, float* s1, float* s2,
                           float* sum) {
  if (G % 16 == 0) {
    __m256 amax = _mm256_setzero_ps(), acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < G; i += 8) {
      const __m256 v = _mm256_loadu_ps(x + i);
      amax = _mm256_max_ps(amax, vabs(v));
      acc = _mm256_add_ps(acc, v);
    }
    const float a = hmax(amax), s = a / 127.f, inv = a > 0.f ? 127.f / a : 0.f;
    *s1 = s;
    *sum = hsum(acc);
    const __m256 vinv = _mm256_set1_ps(inv), vs = _mm256_set1_ps(s);
    __m256 rmax = _mm256_setzero_ps();
    for (int64_t i = 0; i < G; i += 16) {
      const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
      const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vinv));  // round to nearest even
      const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vinv));
      store_i8x16(q1 + i, i0, i1);
      if (terms == 2) {
        rmax = _mm256_max_ps(rmax, vabs(_mm256_sub_ps(v0, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(i0)))));
        rmax = _mm256_max_ps(rmax, vabs(_mm256_sub_ps(v1, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(i1)))));
      }
    }
    if (terms == 2) {
      const float b = hmax(rmax), inv2 = b > 0.f ? 127.f / b : 0.f;
      *s2 = b / 127.f;
      const __m256 vinv2 = _mm256_set1_ps(inv2);
      for (int64_t i = 0; i < G; i += 16) {
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        const __m256 r0 = _mm256_sub_ps(v0, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtps_epi32(_mm256_mul_ps(v0, vinv)))));
        const __m256 r1 = _mm256_sub_ps(v1, _mm256_mul_ps(vs, _mm256_cvtepi32_ps(_mm256_cvtps_epi32(_mm256_mul_ps(v1, vinv)))));
        store_i8x16(q2 + i, _mm256_cvtps_epi32(_mm256_mul_ps(r0, vinv2)), _mm256_cvtps_epi32(_mm256_mul_ps(r1, vinv2)));
      }
    }
    return;
  }
  float a = 0.f, acc = 0.f;  // G a multiple of 8 only: plain loops
  for (int64_t i = 0; i < G; ++i) { a = std::max(a, std::fabs(x[i])); acc += x[i]; }
  const float s = a / 127.f, inv = a > 0.f ? 127.f / a : 0.f;
  *s1 = s;
  *sum = acc;
  for (int64_t i = 0; i < G; ++i) q1[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
  if (terms == 2) {
    float b = 0.f;
    for (int64_t i = 0; i < G; ++i) b = std::max(b, std::fabs(x[i] - s * q1[i]));
    const float inv2 = b > 0.f ? 127.f / b : 0.f;
    for (int64_t i = 0; i < G; ++i) q2[i] = static_cast<int8_t>(std::nearbyint((x[i] - s * q1[i]) * inv2));
    *s2 = b / 127.f;
  }
}

// One tile of 16 output rows (two halves of 8) for NR activation rows at once, each as TERMS int8 rows
// (xq row r*TERMS+t, scales sx[(r*TERMS+t)*NG + g], sums xs[r*NG + g]): each 64-byte chunk of codes is
// loaded and unpacked once and multiplied into NR*TERMS pairs of int16 sums.
template <int NR, int TERMS>
inline void tile_rows(const uint8_t* w, const int8_t* xq, const float* sx, const float* xs, const uint16_t* d,
                      const uint16_t* m, float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
  constexpr int K = NR * TERMS;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc0[NR], acc1[NR];  // output rows 0-7 and 8-15 of the tile
  for (int r = 0; r < NR; ++r) { acc0[r] = _mm256_setzero_ps(); acc1[r] = _mm256_setzero_ps(); }
  const int64_t chunks = G / 8;
  for (int64_t g = 0; g < NG; ++g) {
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * 16)));
    const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * 16 + 8)));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * 16)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * 16 + 8)));
    for (int r = 0; r < NR; ++r) {
      const __m256 s = _mm256_set1_ps(xs[r * NG + g]);
      acc0[r] = _mm256_fmadd_ps(m0, s, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(m1, s, acc1[r]);
    }
    for (int64_t c0 = 0; c0 < chunks; c0 += kChunksPerS16) {
      const int64_t c1 = std::min(chunks, c0 + kChunksPerS16);
      __m256i s0[K], s1[K];  // int16 sums of q*xq, rows 0-7 and 8-15
      for (int k = 0; k < K; ++k) { s0[k] = _mm256_setzero_si256(); s1[k] = _mm256_setzero_si256(); }
      for (int64_t c = c0; c < c1; ++c, w += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
        const __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
        const __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
        for (int k = 0; k < K; ++k) {
          const int8_t* xc = xq + k * I + g * G + c * 8;
          int32_t x_lo, x_hi;
          std::memcpy(&x_lo, xc, 4);
          std::memcpy(&x_hi, xc + 4, 4);
          const __m256i bl = _mm256_set1_epi32(x_lo), bh = _mm256_set1_epi32(x_hi);
          s0[k] = _mm256_add_epi16(s0[k], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, bl), _mm256_maddubs_epi16(hi0, bh)));
          s1[k] = _mm256_add_epi16(s1[k], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, bl), _mm256_maddubs_epi16(hi1, bh)));
        }
      }
      for (int r = 0; r < NR; ++r)
        for (int t = 0; t < TERMS; ++t) {
          const int k = r * TERMS + t;
          const __m256 sc = _mm256_set1_ps(sx[k * NG + g]);
          acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0[k], ones)), _mm256_mul_ps(d0, sc), acc0[r]);
          acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1[k], ones)), _mm256_mul_ps(d1, sc), acc1[r]);
        }
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(y + r * O, acc0[r]);
    _mm256_storeu_ps(y + r * O + 8, acc1[r]);
  }
}

template <int TERMS>
void run_tiles(const uint8_t* wp, const uint16_t* dp, const uint16_t* mp, const int8_t* xqp, const float* sxp,
               const float* xsp, float* yp, int64_t M, int64_t I, int64_t G, int64_t NG, int64_t O, int64_t T) {
  constexpr int STEP = TERMS == 1 ? 2 : 1;  // activation rows per pass: 2 int16 sum pairs (16 ymm registers)
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* w = wp + t * (I / 8) * 64;
      const uint16_t* dt = dp + t * NG * 16;
      const uint16_t* mt = mp + t * NG * 16;
      int64_t r = 0;
      for (; r + STEP <= M; r += STEP)
        tile_rows<STEP, TERMS>(w, xqp + r * TERMS * I, sxp + r * TERMS * NG, xsp + r * NG, dt, mt,
                               yp + r * O + t * 16, I, G, NG, O);
      for (; r < M; ++r)
        tile_rows<1, TERMS>(w, xqp + r * TERMS * I, sxp + r * TERMS * NG, xsp + r * NG, dt, mt,
                            yp + r * O + t * 16, I, G, NG, O);
    }
  };
  if (at::get_num_threads() > 1 && M * T * 16 * I >= kParallelWeights) at::parallel_for(0, T, 1, body); else body(0, T);
}

struct Scratch {  // per calling thread: the quantised activations, reused across calls
  std::vector<int8_t> xq;
  std::vector<float> sx, xs;
};

at::Tensor int4_avx2_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& d,
                        const at::Tensor& m, int64_t G, int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "int4_avx2_mm: terms must be 1 or 2, got ", terms);
  TORCH_CHECK(x_in.dim() == 2, "int4_avx2_mm: x must be (M, I), got ", x_in.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous(),
              "int4_avx2_mm: packed must be contiguous uint8 (O/16, I/8, 64)");
  const int64_t M = x_in.size(0), I = x_in.size(1), T = packed.size(0), O = 16 * T;
  TORCH_CHECK(packed.size(1) * 8 == I, "int4_avx2_mm: x has ", I, " features, weights ", packed.size(1) * 8);
  TORCH_CHECK(G % 8 == 0 && I % G == 0, "int4_avx2_mm: group size ", G, " must be a multiple of 8 dividing ", I);
  const int64_t NG = I / G;
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.numel() == T * NG * 16 &&
              m.numel() == T * NG * 16 && d.is_contiguous() && m.is_contiguous(),
              "int4_avx2_mm: d, m must be contiguous fp16 (O/16, I/G, 16)");
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  static thread_local Scratch s;
  s.xq.resize(static_cast<size_t>(M * terms * I));
  s.sx.resize(static_cast<size_t>(M * terms * NG));
  s.xs.resize(static_cast<size_t>(M * NG));
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)  // quantise the activations, one scale per group and term
    for (int64_t g = 0; g < NG; ++g) {
      int8_t* q1 = s.xq.data() + (r * terms) * I + g * G;
      float* s1 = s.sx.data() + (r * terms) * NG + g;
      quantise_group(xp + r * I + g * G, G, static_cast<int>(terms), q1, terms == 2 ? q1 + I : nullptr, s1,
                     terms == 2 ? s1 + NG : nullptr, s.xs.data() + r * NG + g);
    }
  at::Tensor y = at::empty({M, O}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  if (terms == 1)
    run_tiles<1>(wp, dp, mp, s.xq.data(), s.sx.data(), s.xs.data(), y.data_ptr<float>(), M, I, G, NG, O, T);
  else
    run_tiles<2>(wp, dp, mp, s.xq.data(), s.sx.data(), s.xs.data(), y.data_ptr<float>(), M, I, G, NG, O, T);
  return y;
}

}  // namespace

// A fragment: the VNNI kernel's library registers its own op in the same namespace; both may be loaded.
TORCH_LIBRARY_FRAGMENT(lmstack_quant, lib) {
  lib.def("int4_avx2_mm(Tensor x, Tensor packed, Tensor d, Tensor m, int G, int terms=2) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmstack_quant, CPU, lib) {
  lib.impl("int4_avx2_mm", &int4_avx2_mm);
}
