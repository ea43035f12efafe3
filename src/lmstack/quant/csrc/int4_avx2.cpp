// int4 weight x int8 activation matmul for small M (batch-1 decode) with AVX2, FMA and F16C: the twin of
// int4_vnni.cpp for CPUs without AVX-512 VNNI (most laptops, AMD Zen 1-3, many cloud VMs). Compiled with
// -mavx2 -mfma -mf16c only, so it runs on any AVX2 CPU.
// CS336 notes "量化" / "性能指标分析": a decode step reads every weight once, so the kernel must keep up
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
#include "int4_common.h"
#include "int4_gemm.h"
#include <immintrin.h>

namespace {

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

struct Avx2 {
  // Activation rows per pass over a tile: 4 with one term, 2 with two (``many``).
  static constexpr int kStep1 = 4, kStep2 = 2;
  static constexpr int64_t kPrefetch = lmstack_int4::kPrefetch;
  // Chunks of 8 inputs whose int16 partial sums fit before vpmaddwd: 4 chunks x 4 products x 15 x 127 < 2^15.
  static constexpr int kChunksPerS16 = 4;

  // One group of G inputs of one activation row: TERMS int8 terms, their scales, and the exact sum.
  static void quantise_group(const float* x, int64_t G, int terms, int8_t* q1, int8_t* q2, float* s1, float* s2,
                             float* sum) {
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
  }

  // One 64-byte chunk of codes (prefetched kPrefetch ahead) as u8 nibbles: lo/hi of rows 0-7 (bytes 0-31) and of
  // rows 8-15 (bytes 32-63), the low nibble inputs 8c+j, the high 8c+4+j.
  static inline void unpack(const uint8_t* wc, __m256i& lo0, __m256i& hi0, __m256i& lo1, __m256i& hi1) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    _mm_prefetch(reinterpret_cast<const char*>(wc + kPrefetch), _MM_HINT_T0);
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + 32));
    lo0 = _mm256_and_si256(v0, low);
    hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
    lo1 = _mm256_and_si256(v1, low);
    hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
  }

  // One activation row's TERMS int16 sums (s0: output rows 0-7, s1: 8-15) of a block -> floats f = sum_t sx_t * dot_t
  // (the int16 pairs summed to int32 by vpmaddwd with ones; sx_t at sxg[t * NG]).
  template <int TERMS>
  static inline void dots(const __m256i* s0, const __m256i* s1, const float* sxg, int64_t NG, __m256& f0, __m256& f1) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 sc = _mm256_set1_ps(sxg[0]);
    f0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0[0], ones)), sc);
    f1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1[0], ones)), sc);
    if (TERMS == 2) {
      const __m256 sc2 = _mm256_set1_ps(sxg[NG]);
      f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s0[1], ones)), sc2, f0);
      f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s1[1], ones)), sc2, f1);
    }
  }

  // One tile of 16 output rows (two halves of 8) for NR activation rows, each as TERMS int8 rows (xq row
  // r*TERMS+t, scales sx[(r*TERMS+t)*NG + g], sums xs[r*NG + g]). Per block of up to 4 chunks (the int16
  // limit): one vpmaddwd per sum, then the terms combined in float (f = sx1*dot1 + sx2*dot2) before the one
  // multiply by the rows' d. Up to 2 int8 rows in registers (``both``), more with the accumulators in L1 (``many``).
  template <int NR, int TERMS>
  static void tile(const uint8_t* w, const int8_t* xq, const float* sx, const float* xs, const uint16_t* d,
                   const uint16_t* m, float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
    if constexpr (NR * TERMS > 2) {
      many<NR, TERMS>(w, xq, sx, xs, d, m, y, I, G, NG, O);
    } else {
      both<NR, TERMS>(w, xq, sx, xs, d, m, y, I, G, NG, O);
    }
  }

  // A tile for K = NR*TERMS >= 3 int8 rows. The fp32 accumulators (NR x 16) live in L1, not in registers, so
  // the K pairs of int16 sums, the unpacked codes and two broadcasts fit in the 16 ymm registers; d and m are
  // converted once per group. Per chunk: 2 loads and 6 ops to unpack, per int8 row 2 broadcasts, 4 vpmaddubsw
  // and 4 int16 adds; per block of up to 4 chunks and row one vpmaddwd per half, the float terms and one load
  // and store of the accumulators. Each output's operations and their order are those of ``both``: same bits.
  template <int NR, int TERMS>
  static void many(const uint8_t* w, const int8_t* xq, const float* sx, const float* xs, const uint16_t* d,
                   const uint16_t* m, float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
    alignas(32) float acc[NR][16];
    alignas(32) float dg[16], mg[16];  // this group's d and m in fp32
    for (int r = 0; r < NR; ++r) {
      _mm256_store_ps(acc[r], _mm256_setzero_ps());
      _mm256_store_ps(acc[r] + 8, _mm256_setzero_ps());
    }
    const int64_t chunks = G / 8;
    for (int64_t g = 0; g < NG; ++g) {
      for (int h = 0; h < 16; h += 8) {
        _mm256_store_ps(dg + h, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * 16 + h))));
        _mm256_store_ps(mg + h, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * 16 + h))));
      }
      const int8_t* xg = xq + g * G;
      const float *sxg = sx + g, *xsg = xs + g;
      int64_t c = 0;  // the group's first block also adds m * sum(x), before its products (as ``both``)
      for (; c + kChunksPerS16 <= chunks; c += kChunksPerS16, w += 64 * kChunksPerS16) {
        if (c == 0) many_block<NR, TERMS, kChunksPerS16, true>(w, xg, sxg, dg, mg, xsg, acc, I, NG);
        else many_block<NR, TERMS, kChunksPerS16, false>(w, xg + c * 8, sxg, dg, mg, xsg, acc, I, NG);
      }
      const bool first = c == 0;
      switch (chunks - c) {  // G = 8, 16, 24 or a tail of G > 32: the rest of the group
#define LMSTACK_TAIL(N)                                                                       \
  case N:                                                                                     \
    if (first) many_block<NR, TERMS, N, true>(w, xg + c * 8, sxg, dg, mg, xsg, acc, I, NG);   \
    else many_block<NR, TERMS, N, false>(w, xg + c * 8, sxg, dg, mg, xsg, acc, I, NG);        \
    w += 64 * N;                                                                              \
    break;
        LMSTACK_TAIL(1) LMSTACK_TAIL(2) LMSTACK_TAIL(3)
#undef LMSTACK_TAIL
        default: break;
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(y + r * O, _mm256_load_ps(acc[r]));
      _mm256_storeu_ps(y + r * O + 8, _mm256_load_ps(acc[r] + 8));
    }
  }

  // NC (<= 4) chunks of one group for ``many``: the int16 sums of each int8 row (zeroed, then one add chain per
  // sum: the empty asm keeps GCC from reassociating the chain into a tree of live products, which spilled),
  // then acc += [m * sum(x)] + d * sum_t sx_t * dot_t.
  template <int NR, int TERMS, int NC, bool M_TERM>
  static inline void many_block(const uint8_t* w, const int8_t* xg, const float* sxg, const float* dg,
                                const float* mg, const float* xsg, float (*acc)[16], int64_t I, int64_t NG) {
    constexpr int K = NR * TERMS;
    __m256i s0[K], s1[K];  // rows 0-7 and 8-15 of the tile
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      s0[k] = _mm256_setzero_si256();
      s1[k] = _mm256_setzero_si256();
    }
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      __m256i lo0, hi0, lo1, hi1;
      unpack(w + 64 * c, lo0, hi0, lo1, hi1);
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) {
        const int8_t* xc = xg + k * I + c * 8;
        int32_t x_lo, x_hi;
        lmstack_int4::chunk_words(xc, x_lo, x_hi);
        const __m256i bl = _mm256_set1_epi32(x_lo), bh = _mm256_set1_epi32(x_hi);
        s0[k] = _mm256_add_epi16(s0[k], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, bl), _mm256_maddubs_epi16(hi0, bh)));
        s1[k] = _mm256_add_epi16(s1[k], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, bl), _mm256_maddubs_epi16(hi1, bh)));
        __asm__("" : "+x"(s0[k]), "+x"(s1[k]));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < NR; ++r) {
      __m256 f0, f1;
      dots<TERMS>(s0 + r * TERMS, s1 + r * TERMS, sxg + r * TERMS * NG, NG, f0, f1);
      __m256 a0 = _mm256_load_ps(acc[r]), a1 = _mm256_load_ps(acc[r] + 8);
      if (M_TERM) {
        const __m256 xsb = _mm256_set1_ps(xsg[r * NG]);
        a0 = _mm256_fmadd_ps(_mm256_load_ps(mg), xsb, a0);
        a1 = _mm256_fmadd_ps(_mm256_load_ps(mg + 8), xsb, a1);
      }
      _mm256_store_ps(acc[r], _mm256_fmadd_ps(f0, _mm256_load_ps(dg), a0));
      _mm256_store_ps(acc[r] + 8, _mm256_fmadd_ps(f1, _mm256_load_ps(dg + 8), a1));
    }
  }

  // Both halves of a tile at once for one or two int8 rows (decode): each 64-byte chunk of codes is loaded and
  // unpacked once and multiplied into NR*TERMS pairs of int16 sums.
  template <int NR, int TERMS>
  static void both(const uint8_t* w, const int8_t* xq, const float* sx, const float* xs, const uint16_t* d,
                   const uint16_t* m, float* y, int64_t I, int64_t G, int64_t NG, int64_t O) {
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
      const int8_t* xg = xq + g * G;
      int64_t c = 0;
      for (; c + kChunksPerS16 <= chunks; c += kChunksPerS16, w += 64 * kChunksPerS16)
        block<NR, TERMS, kChunksPerS16>(w, xg + c * 8, sx + g, d0, d1, acc0, acc1, I, NG);
      switch (chunks - c) {  // G = 8, 16, 24 or a tail of G > 32: the rest of the group
        case 1: block<NR, TERMS, 1>(w, xg + c * 8, sx + g, d0, d1, acc0, acc1, I, NG); w += 64; break;
        case 2: block<NR, TERMS, 2>(w, xg + c * 8, sx + g, d0, d1, acc0, acc1, I, NG); w += 128; break;
        case 3: block<NR, TERMS, 3>(w, xg + c * 8, sx + g, d0, d1, acc0, acc1, I, NG); w += 192; break;
        default: break;
      }
    }
    for (int r = 0; r < NR; ++r) {
      _mm256_storeu_ps(y + r * O, acc0[r]);
      _mm256_storeu_ps(y + r * O + 8, acc1[r]);
    }
  }

  // NC (<= 4) chunks of one group: int16 sums of q*xq for each of the NR*TERMS activation rows, the first
  // chunk initialising them (no zeroing), then acc += d * sum_t sx_t * dot_t.
  template <int NR, int TERMS, int NC>
  static inline void block(const uint8_t* w, const int8_t* xg, const float* sxg, __m256 d0, __m256 d1,
                           __m256* acc0, __m256* acc1, int64_t I, int64_t NG) {
    constexpr int K = NR * TERMS;
    __m256i s0[K], s1[K];  // int16 sums, rows 0-7 and 8-15
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) {
      __m256i lo0, hi0, lo1, hi1;
      unpack(w + 64 * c, lo0, hi0, lo1, hi1);
      for (int k = 0; k < K; ++k) {
        const int8_t* xc = xg + k * I + c * 8;
        int32_t x_lo, x_hi;
        lmstack_int4::chunk_words(xc, x_lo, x_hi);
        const __m256i bl = _mm256_set1_epi32(x_lo), bh = _mm256_set1_epi32(x_hi);
        const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, bl), _mm256_maddubs_epi16(hi0, bh));
        const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, bl), _mm256_maddubs_epi16(hi1, bh));
        s0[k] = c == 0 ? p0 : _mm256_add_epi16(s0[k], p0);
        s1[k] = c == 0 ? p1 : _mm256_add_epi16(s1[k], p1);
      }
    }
    for (int r = 0; r < NR; ++r) {
      __m256 f0, f1;
      dots<TERMS>(s0 + r * TERMS, s1 + r * TERMS, sxg + r * TERMS * NG, NG, f0, f1);
      acc0[r] = _mm256_fmadd_ps(f0, d0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(f1, d1, acc1[r]);
    }
  }
};

at::Tensor int4_avx2_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                        int64_t G, int64_t terms) {
  return lmstack_int4::int4_mm<Avx2>("int4_avx2_mm", x, packed, d, m, G, terms);
}

at::Tensor int4_avx2_dequant(const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m, int64_t G,
                              bool bf16) {
  return lmstack_int4::int4_dequant("int4_avx2_dequant", packed, d, m, G, bf16);
}

at::Tensor int4_avx2_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                           int64_t G, bool bf16, int64_t block) {
  return lmstack_int4::int4_gemm("int4_avx2_gemm", x, packed, d, m, G, bf16, block);
}

}  // namespace

// A fragment: the VNNI kernel's library registers its own op in the same namespace; both may be loaded.
TORCH_LIBRARY_FRAGMENT(lmstack_quant, lib) {
  lib.def("int4_avx2_mm(Tensor x, Tensor packed, Tensor d, Tensor m, int G, int terms=2) -> Tensor");
  lib.def("int4_avx2_dequant(Tensor packed, Tensor d, Tensor m, int G, bool bf16=False) -> Tensor");
  lib.def("int4_avx2_gemm(Tensor x, Tensor packed, Tensor d, Tensor m, int G, bool bf16=False, int block=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmstack_quant, CPU, lib) {
  lib.impl("int4_avx2_mm", &int4_avx2_mm);
  lib.impl("int4_avx2_dequant", &int4_avx2_dequant);
  lib.impl("int4_avx2_gemm", &int4_avx2_gemm);
}
