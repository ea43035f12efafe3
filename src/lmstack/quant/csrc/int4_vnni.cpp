// int4 weight x int8 activation matmul for small M (batch-1 decode) with AVX-512 VNNI.
// Seed 001 "量化" / "性能指标分析": a decode step reads every weight once, so the kernel must keep up
// with memory (0.5 byte per weight) rather than spend its time unpacking or in per-call overhead.
//
// Weights: codes q in [0, 15], per group of G inputs a scale d and minimum m (w = d*q + m), laid out
// by tiles of 16 output rows: packed (O/16, I/8, 64) bytes, byte 4r+j of chunk c holds
// q[16t+r, 8c+j] in its low nibble and q[16t+r, 8c+4+j] in its high nibble; d, m are fp16
// (O/16, I/G, 16). Activations: per row and group, sx = max|x|/127, xq = round(x/sx) (int8),
// xs = sum x. Then  y[o] = sum_g d[o,g]*sx[g]*sum_{i in g} q[o,i]*xq[i] + m[o,g]*xs[g]:
// one vpdpbusd multiplies 16 rows x 4 inputs (u8 codes x s8 activations) into 16 int32 lanes, one
// lane per output row, so no horizontal sums are needed.
// terms = 2 splits each activation in two int8 terms, x ~ sx1*xq1 + sx2*xq2 with xq2 the rounded residual
// (sx2 = max|x - sx1*xq1|/127 <= sx1/254): about 15 bits instead of 8, for a second vpdpbusd on codes
// already unpacked; both terms land in one accumulator, so the output is written once.
// Per call: the activations are quantised with AVX-512 into a per-thread scratch buffer (no allocation
// but the output), and the weight stream is prefetched a few cache lines ahead.
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

// Prefetch distance: this far ahead of the chunk being multiplied. The weights stream from DRAM once per
// token and the hardware prefetcher alone left one core at ~15 GB/s of its ~40; 8 KiB ahead measured best
// (1-32 KiB tried on SmolLM2-135M's matrices, one thread).
constexpr int64_t kPrefetch = 8192;
// Split a call over threads only from this many weights x activation rows on (SmolLM2 decode: the FFN
// and unembedding split, the 576 x 576 attention projections do not -- two threads were slower there,
// 7.2 vs 6.1 us): below it the fork costs more than the share of the work it saves.
constexpr int64_t kParallelWeights = 512 * 1024;

// One group of G inputs of one activation row: TERMS int8 terms, their scales, and the exact sum.
inline void quantise_group(const float* x, int64_t G, int terms, int8_t* q1, int8_t* q2, float* s1, float* s2,
                           float* sum) {
  if (G % 16 == 0) {
    __m512 amax = _mm512_setzero_ps(), acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < G; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      acc = _mm512_add_ps(acc, v);
    }
    const float a = _mm512_reduce_max_ps(amax), s = a / 127.f, inv = a > 0.f ? 127.f / a : 0.f;
    *s1 = s;
    *sum = _mm512_reduce_add_ps(acc);
    const __m512 vinv = _mm512_set1_ps(inv), vs = _mm512_set1_ps(s);
    __m512 rmax = _mm512_setzero_ps();
    for (int64_t i = 0; i < G; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));  // round to nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + i), _mm512_cvtsepi32_epi8(qi));
      if (terms == 2) {
        const __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(vs, _mm512_cvtepi32_ps(qi)));
        rmax = _mm512_max_ps(rmax, _mm512_abs_ps(r));
      }
    }
    if (terms == 2) {
      const float b = _mm512_reduce_max_ps(rmax), inv2 = b > 0.f ? 127.f / b : 0.f;
      *s2 = b / 127.f;
      const __m512 vinv2 = _mm512_set1_ps(inv2);
      for (int64_t i = 0; i < G; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v, vinv));
        const __m512 r = _mm512_sub_ps(v, _mm512_mul_ps(vs, _mm512_cvtepi32_ps(qi)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + i),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(r, vinv2))));
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

// One tile of 16 output rows for NR activation rows at once, each as TERMS int8 rows (xq row r*TERMS+t,
// scales sx[(r*TERMS+t)*NG + g], sums xs[r*NG + g]): each 64-byte chunk of codes is loaded and unpacked
// once and multiplied into NR*TERMS accumulator pairs.
template <int NR, int TERMS>
inline void tile_rows(const uint8_t* w, const int8_t* xq, const float* sx, const float* xs, const uint16_t* d,
                      const uint16_t* m, float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t chunks = G / 8;
  for (int64_t g = 0; g < NG; ++g) {
    __m512i a0[NR * TERMS], a1[NR * TERMS];
    for (int r = 0; r < NR * TERMS; ++r) { a0[r] = _mm512_setzero_si512(); a1[r] = _mm512_setzero_si512(); }
    for (int64_t c = 0; c < chunks; ++c, w += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < NR * TERMS; ++r) {
        const int8_t* xc = xq + r * I + g * G + c * 8;
        int32_t x_lo, x_hi;
        std::memcpy(&x_lo, xc, 4);
        std::memcpy(&x_hi, xc + 4, 4);
        a0[r] = _mm512_dpbusd_epi32(a0[r], lo, _mm512_set1_epi32(x_lo));
        a1[r] = _mm512_dpbusd_epi32(a1[r], hi, _mm512_set1_epi32(x_hi));
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * 16)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * 16)));
    for (int r = 0; r < NR; ++r) {
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * NG + g]), acc[r]);
      for (int t = 0; t < TERMS; ++t) {
        const int k = r * TERMS + t;
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0[k], a1[k]));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(sx[k * NG + g])), acc[r]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(y + r * O, acc[r]);
}

template <int TERMS>
void run_tiles(const uint8_t* wp, const uint16_t* dp, const uint16_t* mp, const int8_t* xqp, const float* sxp,
               const float* xsp, float* yp, int64_t M, int64_t I, int64_t G, int64_t NG, int64_t O, int64_t T) {
  constexpr int STEP = TERMS == 1 ? 4 : 2;  // activation rows per pass: 4 (or 2 x 2 terms) accumulator pairs
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
  // Threads only when each gets a few tiles: a fork costs more than a small matrix's share of the work.
  if (at::get_num_threads() > 1 && M * T * 16 * I >= kParallelWeights) at::parallel_for(0, T, 1, body); else body(0, T);
}

struct Scratch {  // per calling thread: the quantised activations, reused across calls
  std::vector<int8_t> xq;
  std::vector<float> sx, xs;
};

at::Tensor int4_vnni_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& d,
                        const at::Tensor& m, int64_t G, int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "int4_vnni_mm: terms must be 1 or 2, got ", terms);
  TORCH_CHECK(x_in.dim() == 2, "int4_vnni_mm: x must be (M, I), got ", x_in.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous(),
              "int4_vnni_mm: packed must be contiguous uint8 (O/16, I/8, 64)");
  const int64_t M = x_in.size(0), I = x_in.size(1), T = packed.size(0), O = 16 * T;
  TORCH_CHECK(packed.size(1) * 8 == I, "int4_vnni_mm: x has ", I, " features, weights ", packed.size(1) * 8);
  TORCH_CHECK(G % 8 == 0 && I % G == 0, "int4_vnni_mm: group size ", G, " must be a multiple of 8 dividing ", I);
  const int64_t NG = I / G;
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.numel() == T * NG * 16 &&
              m.numel() == T * NG * 16 && d.is_contiguous() && m.is_contiguous(),
              "int4_vnni_mm: d, m must be contiguous fp16 (O/16, I/G, 16)");
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

// A fragment: the AVX2 kernel's library registers its own op in the same namespace; both may be loaded.
TORCH_LIBRARY_FRAGMENT(lmstack_quant, lib) {
  lib.def("int4_vnni_mm(Tensor x, Tensor packed, Tensor d, Tensor m, int G, int terms=2) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmstack_quant, CPU, lib) {
  lib.impl("int4_vnni_mm", &int4_vnni_mm);
}
