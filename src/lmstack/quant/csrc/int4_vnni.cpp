// int4 weight x int8 activation matmul for small M (batch-1 decode) with AVX-512 VNNI.
// CS336 notes "量化" / "性能指标分析": a decode step reads every weight once, so the kernel must keep up
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
#include "int4_common.h"
#include "int4_gemm.h"
#include <immintrin.h>

namespace {

struct Vnni {
  static constexpr int kStep1 = 8, kStep2 = 4;  // activation rows per pass: 8 (or 4 x 2 terms) accumulators
  static constexpr int64_t kPrefetch = lmstack_int4::kPrefetch;

  // One group of G inputs of one activation row: TERMS int8 terms, their scales, and the exact sum.
  static void quantise_group(const float* x, int64_t G, int terms, int8_t* q1, int8_t* q2, float* s1, float* s2,
                             float* sum) {
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
  }

  // The products of one group's NC chunks (NC < 0: as many as the group has) for K int8 rows into a0 (zeroed here):
  // each 64-byte chunk of codes is loaded and unpacked once and multiplied into the K accumulators (the low and
  // high nibbles' products into the same one: exact int32 sums, so the order does not matter).
  // A compile-time NC (G = 32, 64, 128) unrolls the chunks too, which keeps every accumulator in its own
  // register (with the run-time loop GCC copied each to another register and back per chunk).
  template <int K, int NC>
  static inline void group_dots(const uint8_t* w, const int8_t* xg, int64_t I, int64_t chunks, __m512i* a0) {
    const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 16
    for (int k = 0; k < K; ++k) a0[k] = _mm512_setzero_si512();
    const int64_t n = NC > 0 ? NC : chunks;
#pragma GCC unroll 16
    for (int64_t c = 0; c < n; ++c) {
      const uint8_t* wc = w + 64 * c;
      _mm_prefetch(reinterpret_cast<const char*>(wc + kPrefetch), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(wc);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 16
      for (int k = 0; k < K; ++k) {
        const int8_t* xc = xg + k * I + c * 8;
        int32_t x_lo, x_hi;
        lmstack_int4::chunk_words(xc, x_lo, x_hi);
        a0[k] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(a0[k], lo, _mm512_set1_epi32(x_lo)), hi,
                                    _mm512_set1_epi32(x_hi));
      }
    }
  }

  // One tile of 16 output rows for NR activation rows at once, each as TERMS int8 rows (xq row r*TERMS+t,
  // scales sx[(r*TERMS+t)*NG + g], sums xs[r*NG + g]): per group the products (``group_dots``), then
  // acc += m * sum(x) + sum_t cvt(dot_t) * d * sx_t. Every output's operations are the same for any NC.
  template <int NR, int TERMS, int NC>
  static void tile_nc(const uint8_t* w, const int8_t* xq, const float* sx, const float* xs, const uint16_t* d,
                      const uint16_t* m, float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
    constexpr int K = NR * TERMS;
    __m512 acc[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    const int64_t chunks = G / 8;
    for (int64_t g = 0; g < NG; ++g, w += 64 * chunks) {
      __m512i a0[K];
      group_dots<K, NC>(w, xq + g * G, I, chunks, a0);
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * 16)));
      const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + g * 16)));
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * NG + g]), acc[r]);
#pragma GCC unroll 2
        for (int t = 0; t < TERMS; ++t) {
          const int k = r * TERMS + t;
          const __m512 dot = _mm512_cvtepi32_ps(a0[k]);
          acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dv, _mm512_set1_ps(sx[k * NG + g])), acc[r]);
        }
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(y + r * O, acc[r]);
  }

  template <int NR, int TERMS>
  static void tile(const uint8_t* w, const int8_t* xq, const float* sx, const float* xs, const uint16_t* d,
                   const uint16_t* m, float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
    switch (G) {
      case 32: tile_nc<NR, TERMS, 4>(w, xq, sx, xs, d, m, y, I, G, NG, O); break;
      case 64: tile_nc<NR, TERMS, 8>(w, xq, sx, xs, d, m, y, I, G, NG, O); break;
      case 128: tile_nc<NR, TERMS, 16>(w, xq, sx, xs, d, m, y, I, G, NG, O); break;
      default: tile_nc<NR, TERMS, -1>(w, xq, sx, xs, d, m, y, I, G, NG, O); break;
    }
  }
};

at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                        int64_t G, int64_t terms) {
  return lmstack_int4::int4_mm<Vnni>("int4_vnni_mm", x, packed, d, m, G, terms);
}

at::Tensor int4_vnni_dequant(const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m, int64_t G,
                              bool bf16) {
  return lmstack_int4::int4_dequant("int4_vnni_dequant", packed, d, m, G, bf16);
}

at::Tensor int4_vnni_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                           int64_t G, bool bf16, int64_t block) {
  return lmstack_int4::int4_gemm("int4_vnni_gemm", x, packed, d, m, G, bf16, block);
}

}  // namespace

// A fragment: the AVX2 kernel's library registers its own op in the same namespace; both may be loaded.
TORCH_LIBRARY_FRAGMENT(lmstack_quant, lib) {
  lib.def("int4_vnni_mm(Tensor x, Tensor packed, Tensor d, Tensor m, int G, int terms=2) -> Tensor");
  lib.def("int4_vnni_dequant(Tensor packed, Tensor d, Tensor m, int G, bool bf16=False) -> Tensor");
  lib.def("int4_vnni_gemm(Tensor x, Tensor packed, Tensor d, Tensor m, int G, bool bf16=False, int block=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmstack_quant, CPU, lib) {
  lib.impl("int4_vnni_mm", &int4_vnni_mm);
  lib.impl("int4_vnni_dequant", &int4_vnni_dequant);
  lib.impl("int4_vnni_gemm", &int4_vnni_gemm);
}
