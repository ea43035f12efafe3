// What the two int4 x int8 decode kernels share (int4_vnni.cpp: AVX-512 VNNI; int4_avx2.cpp: AVX2): the
// op's argument checks, the per-thread scratch for the quantised activations, the scalar quantisation of a
// group that is not a multiple of 16, the loop over activation rows and groups, and the split of the output
// tiles over threads. Each kernel supplies an ISA struct with
//   static void quantise_group(const float* x, int64_t G, int terms, int8_t* q1, int8_t* q2, float* s1,
//                              float* s2, float* sum);   // one group of one activation row
//   template <int NR, int TERMS> static void tile(...);  // 16 output rows x NR activation rows
//   static constexpr int kStep1, kStep2;                  // activation rows per pass for 1 and 2 terms
// CS336 notes "量化": packed (O/16, I/8, 64) codes, fp16 d, m (O/16, I/G, 16), y[o] = sum_g d[o,g]*sum_t
// sx_t[g]*sum_{i in g} q[o,i]*xq_t[i] + m[o,g]*xs[g] (the formula in quant/int4_vnni.py).
// This header is part of each kernel's build hash (utils.build_extension hashes the quoted #includes), so a
// change here rebuilds both.
#pragma once

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace lmstack_int4 {

// Prefetch distance: this far ahead of the chunk being multiplied. The weights stream from DRAM once per
// token and the hardware prefetcher alone left one core at ~15 GB/s of its ~40; 8 KiB ahead measured best
// (1-32 KiB tried on SmolLM2-135M's matrices, one thread).
constexpr int64_t kPrefetch = 8192;
// Split a call over threads only from this many weights x activation rows on (SmolLM2 decode: the FFN
// and unembedding split, the 576 x 576 attention projections do not -- two threads were slower there,
// 7.2 vs 6.1 us): below it the fork costs more than the share of the work it saves.
constexpr int64_t kParallelWeights = 512 * 1024;

// One group of G (a multiple of 8) inputs with plain loops: the same numbers as the vector versions
// (sx = max|x|/127, xq = round-to-nearest-even(x * 127/max|x|), the residual's term the same way).
inline void quantise_group_scalar(const float* x, int64_t G, int terms, int8_t* q1, int8_t* q2, float* s1,
                                  float* s2, float* sum) {
  float a = 0.f, acc = 0.f;
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

// The 8 int8 activations of one chunk (inputs 8c .. 8c+7 at xc) as two 4-byte words: inputs 8c+j (the codes'
// low nibbles) and 8c+4+j (the high nibbles), each broadcast against a chunk's 16 (or 8) output rows.
inline void chunk_words(const int8_t* xc, int32_t& lo, int32_t& hi) {
  std::memcpy(&lo, xc, 4);
  std::memcpy(&hi, xc + 4, 4);
}

struct Scratch {  // per calling thread: the quantised activations, reused across calls
  std::vector<int8_t> xq;  // (M * terms, I): row r*terms + t is term t of activation row r
  std::vector<float> sx;   // (M * terms, NG)
  std::vector<float> xs;   // (M, NG): the exact sum of each group
};

// Rows of quantised activations per block of ``run_tiles``: about this many bytes, so that a block stays in L2
// while every tile of the thread passes over it (a 352-row prefill of SmolLM2's 576 x 1536 matrix has 540 KB).
constexpr int64_t kRowBlockBytes = 64 * 1024;

// The last rest < STEP rows of a block in one pass of NR = rest rows (``pass`` takes NR as an integral constant).
template <int N, class Pass>
inline void rest_pass(int64_t rest, Pass& pass) {
  if constexpr (N > 0) {
    if (rest == N) pass(std::integral_constant<int, N>{});
    else rest_pass<N - 1>(rest, pass);
  }
}

// All output tiles for all M activation rows, in blocks of rows (``kRowBlockBytes``): per block, every tile,
// STEP rows per pass over the tile (its codes stay in L1 between passes), the block's last M % STEP rows in one
// pass too (one by one would unpack the codes that many times). Tiles split over threads in contiguous
// ranges (each tile's 16 outputs are one 64-byte line per row: threads never write the same line) when the call
// is large enough. Each output's arithmetic is the same whatever the blocks and passes.
template <class Isa, int TERMS>
void run_tiles(const uint8_t* wp, const uint16_t* dp, const uint16_t* mp, const int8_t* xqp, const float* sxp,
               const float* xsp, float* yp, int64_t M, int64_t I, int64_t G, int64_t NG, int64_t O, int64_t T) {
  constexpr int STEP = TERMS == 1 ? Isa::kStep1 : Isa::kStep2;
  const int64_t RB = std::max<int64_t>(STEP, kRowBlockBytes / (TERMS * I) / STEP * STEP);
  auto rows = [&](int64_t t, int64_t r, int64_t r1) {  // rows r .. r1-1 of tile t
    const uint8_t* w = wp + t * (I / 8) * 64;
    const uint16_t* dt = dp + t * NG * 16;
    const uint16_t* mt = mp + t * NG * 16;
    auto pass = [&](auto nr) {
      constexpr int NR = decltype(nr)::value;
      Isa::template tile<NR, TERMS>(w, xqp + r * TERMS * I, sxp + r * TERMS * NG, xsp + r * NG, dt, mt,
                                    yp + r * O + t * 16, I, G, NG, O);
      r += NR;
    };
    while (r + STEP <= r1) pass(std::integral_constant<int, STEP>{});
    rest_pass<STEP - 1>(r1 - r, pass);
  };
  auto body = [&](int64_t t0, int64_t t1) {
    for (int64_t r0 = 0; r0 < M; r0 += RB)
      for (int64_t t = t0; t < t1; ++t) rows(t, r0, std::min(M, r0 + RB));
  };
  if (at::get_num_threads() > 1 && M * T * 16 * I >= kParallelWeights) at::parallel_for(0, T, 1, body); else body(0, T);
}

// The packed weights' checks every op makes: packed (O/16, I/8, 64) uint8 with I = ``I`` (or, I < 0, whatever the
// layout says), G a multiple of 8 dividing I, d and m fp16 (O/16, I/G, 16). Returns I/G. ``name`` prefixes every error.
inline int64_t check_packed(const char* name, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                            int64_t G, int64_t I) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(2) == 64 && packed.is_contiguous(),
              name, ": packed must be contiguous uint8 (O/16, I/8, 64)");
  if (I < 0) I = packed.size(1) * 8;
  TORCH_CHECK(packed.size(1) * 8 == I, name, ": x has ", I, " features, weights ", packed.size(1) * 8);
  TORCH_CHECK(G > 0 && G % 8 == 0 && I % G == 0, name, ": group size ", G, " must be a multiple of 8 dividing ", I);
  const int64_t T = packed.size(0), NG = I / G;
  TORCH_CHECK(d.scalar_type() == at::kHalf && m.scalar_type() == at::kHalf && d.numel() == T * NG * 16 &&
              m.numel() == T * NG * 16 && d.is_contiguous() && m.is_contiguous(),
              name, ": d, m must be contiguous fp16 (O/16, I/G, 16)");
  return NG;
}

// The op: x (M, I) float32 or bf16 -> y (M, O) float32. ``name`` prefixes every error.
template <class Isa>
at::Tensor int4_mm(const char* name, const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& d,
                   const at::Tensor& m, int64_t G, int64_t terms) {
  TORCH_CHECK(terms == 1 || terms == 2, name, ": terms must be 1 or 2, got ", terms);
  TORCH_CHECK(x_in.dim() == 2, name, ": x must be (M, I), got ", x_in.sizes());
  const int64_t M = x_in.size(0), I = x_in.size(1), T = packed.size(0), O = 16 * T;
  const int64_t NG = check_packed(name, packed, d, m, G, I);
  const at::Tensor x = x_in.scalar_type() == at::kFloat ? x_in.contiguous() : x_in.to(at::kFloat).contiguous();
  static thread_local Scratch s;
  s.xq.resize(static_cast<size_t>(M * terms * I));
  s.sx.resize(static_cast<size_t>(M * terms * NG));
  s.xs.resize(static_cast<size_t>(M * NG));
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r)  // quantise the activations once per call: one scale per group and term
    for (int64_t g = 0; g < NG; ++g) {
      int8_t* q1 = s.xq.data() + (r * terms) * I + g * G;
      float* s1 = s.sx.data() + (r * terms) * NG + g;
      int8_t* q2 = terms == 2 ? q1 + I : nullptr;
      float* s2 = terms == 2 ? s1 + NG : nullptr;
      float* sum = s.xs.data() + r * NG + g;
      if (G % 16 == 0)
        Isa::quantise_group(xp + r * I + g * G, G, static_cast<int>(terms), q1, q2, s1, s2, sum);
      else
        quantise_group_scalar(xp + r * I + g * G, G, static_cast<int>(terms), q1, q2, s1, s2, sum);
    }
  at::Tensor y = at::empty({M, O}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  if (terms == 1)
    run_tiles<Isa, 1>(wp, dp, mp, s.xq.data(), s.sx.data(), s.xs.data(), y.data_ptr<float>(), M, I, G, NG, O, T);
  else
    run_tiles<Isa, 2>(wp, dp, mp, s.xq.data(), s.sx.data(), s.xs.data(), y.data_ptr<float>(), M, I, G, NG, O, T);
  return y;
}

// fp32 -> bf16 bits, rounded to nearest even (the weights are finite: no NaN case), as torch's conversion.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The weights themselves, W[o, i] = d[o,g]*q[o,i] + m[o,g] (O, I) in float32 or, ``bf16``, rounded to bf16: for
// a prefill (many activation rows), where a float GEMM on W beats the int8 dot products (quant/int4.py,
// ``gemm_rows``; bf16 for a CPU that multiplies it natively, AMX / AVX512_BF16: half the bytes written, and
// oneDNN's bf16 GEMM). One pass over the codes, tiles split over threads; each tile writes 16 whole rows, so
// threads never share an output line.
#if defined(__AVX512F__) && defined(__AVX512BW__)
// AVX-512 (the VNNI kernel's build): one 64-byte chunk (16 rows x 8 codes) at a time. The low and high nibbles
// interleaved by dwords give each row's 8 codes in input order, two rows per 128-bit lane (unpacklo: rows 4k,
// 4k+1; unpackhi: 4k+2, 4k+3); each pair becomes 16 floats d·q + m with the pair's d, m spread over 8 lanes
// each (permuted once per group), then is stored as 8 + 8 values (bf16: rounded to nearest even).
template <class Out>
inline void store_pair(Out* a, Out* b, __m512 w) {
  if constexpr (std::is_same_v<Out, float>) {
    _mm256_storeu_ps(a, _mm512_castps512_ps256(w));
    _mm256_storeu_ps(b, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1)));
  } else {
    const __m512i u = _mm512_castps_si512(w);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i h = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    const __m256i p = _mm512_cvtepi32_epi16(h);  // 16 x u16: row a's 8, then row b's
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a), _mm256_castsi256_si128(p));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b), _mm256_extracti128_si256(p, 1));
  }
}

// One tile of 16 output rows: ``out`` is its row 0 (row stride I), ``wt`` its codes (I/8, 64), ``dt``, ``mt`` its
// (NG, 16) d and m.
template <class Out>
inline void dequant_tile(Out* out, const uint8_t* wt, const at::Half* dt, const at::Half* mt, int64_t I, int64_t NG,
                         int64_t G) {
  // pair p = 2k + h (k: the 128-bit lane, h: 0 unpacklo, 1 unpackhi) holds rows 4k + 2h and 4k + 2h + 1
  __m512i idx[8];
  for (int k = 0; k < 4; ++k)
    for (int h = 0; h < 2; ++h) {
      const int r = 4 * k + 2 * h;
      idx[2 * k + h] = _mm512_set_epi32(r + 1, r + 1, r + 1, r + 1, r + 1, r + 1, r + 1, r + 1, r, r, r, r, r, r, r, r);
    }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < NG; ++g) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dt + g * 16)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mt + g * 16)));
    __m512 dpair[8], mpair[8];
    for (int p = 0; p < 8; ++p) {
      dpair[p] = _mm512_permutexvar_ps(idx[p], dv);
      mpair[p] = _mm512_permutexvar_ps(idx[p], mv);
    }
    for (int64_t c = g * G / 8; c < (g + 1) * G / 8; ++c) {
      const __m512i v = _mm512_loadu_si512(wt + c * 64);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512i ab[2] = {_mm512_unpacklo_epi32(lo, hi), _mm512_unpackhi_epi32(lo, hi)};
      Out* base = out + 8 * c;
#define LMSTACK_PAIR(K, H)                                                                                   \
  {                                                                                                         \
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(ab[H], K)));          \
    const int r = 4 * (K) + 2 * (H);                                                                        \
    store_pair(base + r * I, base + (r + 1) * I, _mm512_fmadd_ps(dpair[2 * (K) + (H)], q, mpair[2 * (K) + (H)])); \
  }
      LMSTACK_PAIR(0, 0) LMSTACK_PAIR(0, 1) LMSTACK_PAIR(1, 0) LMSTACK_PAIR(1, 1)
      LMSTACK_PAIR(2, 0) LMSTACK_PAIR(2, 1) LMSTACK_PAIR(3, 0) LMSTACK_PAIR(3, 1)
#undef LMSTACK_PAIR
    }
  }
}
#else
template <class Out>
inline void dequant_tile(Out* out, const uint8_t* wt, const at::Half* dt, const at::Half* mt, int64_t I, int64_t NG,
                         int64_t G) {
  for (int64_t g = 0; g < NG; ++g) {
    float dr[16], mr[16];
    for (int r = 0; r < 16; ++r) {
      dr[r] = static_cast<float>(dt[g * 16 + r]);
      mr[r] = static_cast<float>(mt[g * 16 + r]);
    }
    for (int64_t c = g * G / 8; c < (g + 1) * G / 8; ++c) {
      const uint8_t* b = wt + c * 64;
      for (int r = 0; r < 16; ++r) {
        Out* row = out + r * I + 8 * c;
#if defined(__AVX2__) && defined(__FMA__)
        // the row's 4 bytes twice as 8 int32 lanes, shifted by 0 (inputs j) or 4 (inputs 4 + j), masked
        int32_t bytes;
        std::memcpy(&bytes, b + 4 * r, 4);
        const __m256i v = _mm256_cvtepu8_epi32(_mm_set1_epi32(bytes));
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                           _mm256_set1_epi32(0xF));
        const __m256 w = _mm256_fmadd_ps(_mm256_set1_ps(dr[r]), _mm256_cvtepi32_ps(q), _mm256_set1_ps(mr[r]));
        if constexpr (std::is_same_v<Out, float>) {
          _mm256_storeu_ps(row, w);
        } else {  // bf16: u + 0x7FFF + (bit 16 of u), the top 16 bits (bf16_bits on 8 lanes)
          const __m256i u = _mm256_castps_si256(w);
          const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
          const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
          const __m128i packed16 = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(row), packed16);
        }
#else
        for (int j = 0; j < 8; ++j) {
          const float w = dr[r] * static_cast<float>(j < 4 ? b[4 * r + j] & 0xF : b[4 * r + j - 4] >> 4) + mr[r];
          if constexpr (std::is_same_v<Out, float>) row[j] = w; else row[j] = bf16_bits(w);
        }
#endif
      }
    }
  }
}
#endif

template <class Out>
void int4_dequant_into(Out* out, const uint8_t* wp, const at::Half* dp, const at::Half* mp, int64_t T, int64_t I,
                       int64_t NG, int64_t G) {
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      dequant_tile(out + 16 * t * I, wp + t * (I / 8) * 64, dp + t * NG * 16, mp + t * NG * 16, I, NG, G);
  });
}

inline at::Tensor int4_dequant(const char* name, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                               int64_t G, bool bf16) {
  const int64_t NG = check_packed(name, packed, d, m, G, -1);
  const int64_t T = packed.size(0), I = packed.size(1) * 8, O = 16 * T;
  at::Tensor w = at::empty({O, I}, packed.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  if (bf16)
    int4_dequant_into(reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>()), wp, dp, mp, T, I, NG, G);
  else
    int4_dequant_into(w.data_ptr<float>(), wp, dp, mp, T, I, NG, G);
  return w;
}

}  // namespace lmstack_int4
