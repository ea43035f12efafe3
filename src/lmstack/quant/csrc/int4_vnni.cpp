// int4 weight x int8 activation matmul for small M (batch-1 decode) with AVX-512 VNNI.
// Seed 001 "量化" / "性能指标分析": a decode step reads every weight once, so the kernel must keep up
// with memory (0.5 byte per weight) rather than spend its time unpacking.
//
// Weights: codes q in [0, 15], per group of G inputs a scale d and minimum m (w = d*q + m), laid out
// by tiles of 16 output rows: packed (O/16, I/8, 64) bytes, byte 4r+j of chunk c holds
// q[16t+r, 8c+j] in its low nibble and q[16t+r, 8c+4+j] in its high nibble; d, m are fp16
// (O/16, I/G, 16). Activations: per row and group, sx = max|x|/127, xq = round(x/sx) (int8),
// xs = sum x. Then  y[o] = sum_g d[o,g]*sx[g]*sum_{i in g} q[o,i]*xq[i] + m[o,g]*xs[g]:
// one vpdpbusd multiplies 16 rows x 4 inputs (u8 codes x s8 activations) into 16 int32 lanes, one
// lane per output row, so no horizontal sums are needed.
// terms = 2 splits each activation in two int8 terms, x ~ sx1*xq1 + sx2*xq2 with xq2 the rounded residual
// (sx2 = max|x - sx1*xq1|/127 <= sx1/254): about 15 bits instead of 8, for a second pass over codes
// already in registers (the two terms are two activation rows sharing one unpacking of the weights).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// One tile of 16 output rows for NR activation rows at once: each 64-byte chunk of codes is loaded and
// unpacked once and multiplied into NR accumulators.
template <int NR>
inline void tile_rows(const uint8_t* w, const int8_t* xq, const float* sx, const float* xs, const uint16_t* d,
                      const uint16_t* m, float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc_q[NR], acc_m[NR];
  for (int r = 0; r < NR; ++r) { acc_q[r] = _mm512_setzero_ps(); acc_m[r] = _mm512_setzero_ps(); }
  const int64_t chunks = G / 8;
  for (int64_t g = 0; g < NG; ++g) {
    __m512i a0[NR], a1[NR];
    for (int r = 0; r < NR; ++r) { a0[r] = _mm512_setzero_si512(); a1[r] = _mm512_setzero_si512(); }
    for (int64_t c = 0; c < chunks; ++c, w += 64) {
      const __m512i v = _mm512_loadu_si512(w);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < NR; ++r) {
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
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0[r], a1[r]));
      acc_q[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(sx[r * NG + g])), acc_q[r]);
      acc_m[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * NG + g]), acc_m[r]);
    }
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(y + r * O, _mm512_add_ps(acc_q[r], acc_m[r]));
}

at::Tensor int4_vnni_mm(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& d,
                        const at::Tensor& m, int64_t G, int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, "int4_vnni_mm: terms must be 1 or 2, got ", terms);
  TORCH_CHECK(x_in.dim() == 2, "int4_vnni_mm: x must be (M, I), got ", x_in.sizes());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64,
              "int4_vnni_mm: packed must be uint8 (O/16, I/8, 64)");
  const int64_t M = x_in.size(0), I = x_in.size(1), T = packed.size(0), O = 16 * T;
  TORCH_CHECK(packed.size(1) * 8 == I, "int4_vnni_mm: x has ", I, " features, weights ", packed.size(1) * 8);
  TORCH_CHECK(G % 8 == 0 && I % G == 0, "int4_vnni_mm: group size ", G, " must be a multiple of 8 dividing ", I);
  const int64_t NG = I / G;
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.numel() == T * NG * 16 &&
              m.numel() == T * NG * 16, "int4_vnni_mm: d, m must be fp16 (O/16, I/G, 16)");
  at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t MR = M * terms;  // activation rows the tiles run: (x) or (term 1, term 2) per row
  at::Tensor xq = at::empty({MR, I}, x.options().dtype(at::kChar));
  at::Tensor sx = at::empty({MR, NG}, x.options());
  at::Tensor xs = at::zeros({MR, NG}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* sxp = sx.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) {  // quantise the activations, one scale per group (and term)
    for (int64_t gi = 0; gi < NG; ++gi) {
      const float* g = xp + r * I + gi * G;
      int8_t* q1 = xqp + (r * terms) * I + gi * G;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < G; ++i) { amax = std::max(amax, std::fabs(g[i])); sum += g[i]; }
      const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      for (int64_t i = 0; i < G; ++i) q1[i] = static_cast<int8_t>(std::nearbyint(g[i] * inv));
      sxp[(r * terms) * NG + gi] = s;
      xsp[(r * terms) * NG + gi] = sum;  // the m term once, with the exact sum
      if (terms == 2) {
        int8_t* q2 = xqp + (r * 2 + 1) * I + gi * G;
        float rmax = 0.f;
        for (int64_t i = 0; i < G; ++i) rmax = std::max(rmax, std::fabs(g[i] - s * q1[i]));
        const float inv2 = rmax > 0.f ? 127.f / rmax : 0.f;
        for (int64_t i = 0; i < G; ++i) q2[i] = static_cast<int8_t>(std::nearbyint((g[i] - s * q1[i]) * inv2));
        sxp[(r * 2 + 1) * NG + gi] = rmax / 127.f;
      }
    }
  }
  at::Tensor y = at::empty({MR, O}, x.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* w = wp + t * (I / 8) * 64;
      const uint16_t* dt = dp + t * NG * 16;
      const uint16_t* mt = mp + t * NG * 16;
      int64_t r = 0;
      for (; r + 4 <= MR; r += 4)
        tile_rows<4>(w, xqp + r * I, sxp + r * NG, xsp + r * NG, dt, mt, yp + r * O + t * 16, I, G, NG, O);
      for (; r + 2 <= MR; r += 2)
        tile_rows<2>(w, xqp + r * I, sxp + r * NG, xsp + r * NG, dt, mt, yp + r * O + t * 16, I, G, NG, O);
      for (; r < MR; ++r)
        tile_rows<1>(w, xqp + r * I, sxp + r * NG, xsp + r * NG, dt, mt, yp + r * O + t * 16, I, G, NG, O);
    }
  });
  return terms == 1 ? y : y.view({M, 2, O}).sum(1);
}

}  // namespace

TORCH_LIBRARY(lmstack_quant, lib) {
  lib.def("int4_vnni_mm(Tensor x, Tensor packed, Tensor d, Tensor m, int G, int terms=2) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmstack_quant, CPU, lib) {
  lib.impl("int4_vnni_mm", &int4_vnni_mm);
}
