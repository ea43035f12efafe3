// Paged decode attention on the CPU: one query per row over that row's own blocks of the paged KV pool
// (vLLM's PagedAttention, Kwon et al. 2023), with FlashAttention-2's online softmax (Dao 2023: a running
// max m and sum l per query, the output rescaled by exp(m_old - m_new) when the max grows), fp32 sums.
// Book of LLMs §1.2/§1.3 for softmax(q k^T / sqrt(H) + mask) v, §1.9 for the window.
//
// Same semantics as lmstack.inference.paged_attention.paged_decode_attention:
//   q (B, N, 1, H); pools (NB, bs, K, H) float32 / bfloat16 / float16, or int8 / fp8 e4m3 codes with one
//   scale per (block, KV head) (NB, K); table (B, M) block ids; positions (B,); k_new, v_new (B, K, H) this
//   step's key/value or undefined. Slot s of row b is pool[table[b, s / bs], s % bs] and holds position s.
//   Visible: s <= p_b (s < p_b with k_new, which is then one more column at p_b), and p_b - s < window when
//   window > 0. softcap > 0: scores c * tanh(s / c) before the mask (Gemma-2). Query head n reads KV head
//   n / G, G = N / K (GQA).
// Per (row, KV head) only slots lo .. p_b are read (never the table's padding), each key and value row
// once for the G query heads that share it, in tiles of 16 slots: one pass over the tile's key rows scores
// all G heads (16 scores each), the online softmax updates each head's max and sum, and one pass over the
// value rows accumulates P·V for all G heads; a row's KV heads go through a tile together (the pool's order)
// with the next tile prefetched. The file is built once per ISA (the -m flags in
// lmstack/inference/paged_kernel.py) and the op is named after the build (LMSTACK_OP). The AVX-512 build
// and the AVX2 build (AVX2 + FMA + F16C) read the rows in place in their stored dtype and convert each 16
// (AVX-512) or 8 (AVX2) values in registers (fp16: vcvtph2ps, bf16: a 16-bit shift, int8: a sign extension,
// fp8: its bits placed in fp16's fields) inside vector score and P·V loops, the G heads in groups of up to 4
// with their sums in registers and H = 64, 128 compiled with their chunk counts; int8 / fp8 scales multiply
// the scores and the softmax weights, not the rows. AVX2 reads a row's last H % 8 values through a zeroed
// 8-value copy (no masked narrow loads). The generic build (neither) converts each row once into an fp32
// buffer and runs plain loops the compiler vectorises.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#ifndef LMSTACK_OP
#define LMSTACK_OP paged_decode_generic
#endif
#define LMSTACK_STR2(x) #x
#define LMSTACK_STR(x) LMSTACK_STR2(x)

namespace {

constexpr int64_t kTile = 16;  // key slots scored together (one AVX-512 vector of fp32 scores)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// exp(x) for x <= 0 (a score minus the running max) in plain arithmetic, so loops of it vectorise:
// x = n ln2 + r, |r| <= ln2/2, exp(r) by its Taylor polynomial to r^7 (error < 6e-9), 2^n in the exponent
// bits. Below -87 (exp < 1.7e-38, nothing next to the max's 1) it returns 0.
inline float exp_nonpos(float x) {
  const float xc = std::max(x, -87.f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, 4);
  return x < -87.f ? 0.f : p * two_n;
}

#if defined(__AVX512F__)
// 16 stored values -> 16 fp32 (m: the lanes to read, the rest 0), in registers: the key and value rows are
// read in place from the pool, converted inside the score and P·V loops (no fp32 copy of a row).
inline __m512 ld(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 ld(const c10::BFloat16* p, __mmask16 m) {  // bf16 = fp32's high 16 bits
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline __m512 ld(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }
inline __m512 ld(const int8_t* p, __mmask16 m) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p))); }
// e4m3 (sign, 4 exponent bits biased 7, 3 mantissa bits) placed in fp16's fields is its value times 2^-8,
// subnormals included (fp16's are converted exactly); codes 0x7F / 0xFF are NaN
inline __m512 ld(const c10::Float8_e4m3fn* p, __mmask16 m) {
  const __m256i w = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(m, p));
  const __m256i mag = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
  return _mm512_mask_blend_ps(_mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7F)), f,
                              _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: pairwise unpack-and-add (32-bit, then 64-bit
// elements), then the 128-bit lanes, 45 shuffles and adds instead of 16 separate horizontal sums.
inline __m512 hsum16(const __m512* v) {
  __m512 w[8], e[4];
  for (int j = 0; j < 8; ++j)  // 128-bit lane: [v2j, v2j+1, v2j, v2j+1] partial sums
    w[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // 128-bit lane: [v4j, v4j+1, v4j+2, v4j+3] partial sums
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    e[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88), _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
  const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(e[2], e[3], 0x88), _mm512_shuffle_f32x4(e[2], e[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, 0x88), _mm512_shuffle_f32x4(f0, f1, 0xDD));
}

// exp_nonpos on 16 lanes (the same steps as the scalar one).
inline __m512 exp_nonpos16(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm512_maskz_mul_ps(keep, p, _mm512_castsi512_ps(e));
}

// Scores of GN query heads (q (GN, Hp), zero past H) against the tile's first n key rows, one pass over
// each row (its 16-value chunks loaded once for the GN heads), two rows at a time (independent FMA chains):
// part (GN, kTile) vectors of partial sums, then s (GN, kTile) = their lane sums. CC: the chunk count Hp / 16
// when known at compile time (H = 64, 128: q and the sums stay in registers), 0 for any.
template <typename R, int GN, int CC>
inline void score_group(const float* q, int64_t Hp, int64_t H, const R* const* krow, int64_t n, float* s, __m512* part) {
  const int64_t C = CC ? CC : Hp / 16;
  const __mmask16 last = H % 16 ? __mmask16((1u << (H % 16)) - 1) : __mmask16(0xFFFF);
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    __m512 a[GN], b[GN];
    for (int g = 0; g < GN; ++g) a[g] = b[g] = _mm512_setzero_ps();
    const R *k0 = krow[t], *k1 = krow[t + 1];
    for (int64_t c = 0; c < C; ++c) {
      const __mmask16 m = c + 1 < C ? __mmask16(0xFFFF) : last;
      const __m512 kv0 = ld(k0 + c * 16, m), kv1 = ld(k1 + c * 16, m);
      for (int g = 0; g < GN; ++g) {
        const __m512 qv = _mm512_loadu_ps(q + g * Hp + c * 16);
        a[g] = _mm512_fmadd_ps(qv, kv0, a[g]);
        b[g] = _mm512_fmadd_ps(qv, kv1, b[g]);
      }
    }
    for (int g = 0; g < GN; ++g) {
      part[g * kTile + t] = a[g];
      part[g * kTile + t + 1] = b[g];
    }
  }
  for (; t < n; ++t) {
    __m512 a[GN];
    for (int g = 0; g < GN; ++g) a[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const __m512 kv = ld(krow[t] + c * 16, c + 1 < C ? __mmask16(0xFFFF) : last);
      for (int g = 0; g < GN; ++g) a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * Hp + c * 16), kv, a[g]);
    }
    for (int g = 0; g < GN; ++g) part[g * kTile + t] = a[g];
  }
  for (int g = 0; g < GN; ++g) {
    for (int64_t u = n; u < kTile; ++u) part[g * kTile + u] = _mm512_setzero_ps();
    _mm512_storeu_ps(s + g * kTile, hsum16(part + g * kTile));
  }
}

// acc (GN, Hp) = alpha[g] acc + sum_t w[g, t] v_t over the tile's first n value rows, each row's chunks
// loaded once for the GN heads (acc's tail past H stays 0: the rows' tails load as 0). CC as above: with it,
// all CC x GN sums in registers (independent FMA chains) and each row read once, else chunk by chunk.
template <typename R, int GN, int CC>
inline void pv_group(float* acc, int64_t Hp, int64_t H, const float* alpha, const float* w, const R* const* vrow, int64_t n) {
  const __mmask16 last = H % 16 ? __mmask16((1u << (H % 16)) - 1) : __mmask16(0xFFFF);
  if constexpr (CC > 0) {
    __m512 r[CC][GN];
    for (int c = 0; c < CC; ++c)
      for (int g = 0; g < GN; ++g) r[c][g] = _mm512_mul_ps(_mm512_set1_ps(alpha[g]), _mm512_loadu_ps(acc + g * Hp + c * 16));
    for (int64_t t = 0; t < n; ++t) {
      __m512 wb[GN];
      for (int g = 0; g < GN; ++g) wb[g] = _mm512_set1_ps(w[g * kTile + t]);
      for (int c = 0; c < CC; ++c) {
        const __m512 vv = ld(vrow[t] + c * 16, c + 1 < CC ? __mmask16(0xFFFF) : last);
        for (int g = 0; g < GN; ++g) r[c][g] = _mm512_fmadd_ps(wb[g], vv, r[c][g]);
      }
    }
    for (int c = 0; c < CC; ++c)
      for (int g = 0; g < GN; ++g) _mm512_storeu_ps(acc + g * Hp + c * 16, r[c][g]);
  } else {
    const int64_t C = Hp / 16;
    for (int64_t c = 0; c < C; ++c) {
      const __mmask16 m = c + 1 < C ? __mmask16(0xFFFF) : last;
      __m512 r[GN], r2[GN];
      for (int g = 0; g < GN; ++g) {
        r[g] = _mm512_mul_ps(_mm512_set1_ps(alpha[g]), _mm512_loadu_ps(acc + g * Hp + c * 16));
        r2[g] = _mm512_setzero_ps();
      }
      int64_t t = 0;
      for (; t + 2 <= n; t += 2) {  // two chains per head
        const __m512 v0 = ld(vrow[t] + c * 16, m), v1 = ld(vrow[t + 1] + c * 16, m);
        for (int g = 0; g < GN; ++g) {
          r[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * kTile + t]), v0, r[g]);
          r2[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * kTile + t + 1]), v1, r2[g]);
        }
      }
      if (t < n) {
        const __m512 v0 = ld(vrow[t] + c * 16, m);
        for (int g = 0; g < GN; ++g) r[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * kTile + t]), v0, r[g]);
      }
      for (int g = 0; g < GN; ++g) _mm512_storeu_ps(acc + g * Hp + c * 16, _mm512_add_ps(r[g], r2[g]));
    }
  }
}

// What the shared score_all / pv_all below need of this build: the vector of partial sums, its lanes (the
// chunk width), and whether a row's last chunk is a masked load (so H = 49 .. 64 runs the H = 64 code: the
// compile-time chunk count keys on Hp, the head dim rounded up to 16).
struct Isa {
  using Vec = __m512;
  static constexpr int kLanes = 16;
  static constexpr bool kMaskedTail = true;
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMSTACK_AVX2 1
// AVX2 + FMA + F16C: the AVX-512 section's twin on 8-lane vectors. The rows are read in place in their
// stored dtype and converted 8 values at a time in registers; a row's last H % 8 values (H not a multiple of
// 8) are copied into a zeroed 8-value block first (AVX2 has no masked 8/16-bit loads), so nothing past the row
// is read. AVX2 has 16 ymm registers (AVX-512: 32), so the blocks are smaller: the scores of GN heads take
// RT rows at a time (GN x RT sums, RT key chunks and a q chunk in registers), P·V takes CB chunks of the
// rows at a time (CB x GN sums, a value chunk and the GN weights): 6 to 16 independent FMA chains (Zen 3 /
// Skylake issue 2 FMAs a cycle of 4 cycles' latency: 8 keep them busy).
inline __m256 ld(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld(const c10::BFloat16* p) {  // bf16 = fp32's high 16 bits
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline __m256 ld(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 ld(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// e4m3 in fp16's fields (as the AVX-512 build): the value times 2^-8, subnormals exact; 0x7F / 0xFF are NaN
inline __m256 ld(const c10::Float8_e4m3fn* p) {
  const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(w, _mm_set1_epi16(0x7F));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  const __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F))));
  return _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
}
// The first rem (< 8) values at p, the rest 0: copied into a zeroed block (code 0 is 0.0 in every dtype).
template <typename R>
inline __m256 ld_tail(const R* p, int64_t rem) {
  alignas(32) unsigned char buf[8 * sizeof(R)] = {};
  std::memcpy(buf, p, rem * sizeof(R));
  return ld(reinterpret_cast<const R*>(buf));
}

// r[i] = the sum of v[i]'s 8 lanes, for 8 vectors at once: pairwise unpack-and-add (32-bit, then 64-bit
// elements) within the 128-bit lanes, then the two lanes: 21 shuffles and adds instead of 8 horizontal sums.
inline __m256 hsum8(const __m256* v) {
  __m256 w[4];
  for (int j = 0; j < 4; ++j)  // 128-bit lane: [v2j, v2j+1, v2j, v2j+1] partial sums
    w[j] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm256_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  __m256 e[2];
  for (int j = 0; j < 2; ++j) {  // 128-bit lane: [v4j, .., v4j+3] partial sums
    const __m256d a = _mm256_castps_pd(w[2 * j]), b = _mm256_castps_pd(w[2 * j + 1]);
    e[j] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(e[0], e[1], 0x20), _mm256_permute2f128_ps(e[0], e[1], 0x31));
}
inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float hadd8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// exp_nonpos on 8 lanes (the same steps as the scalar one: floor(x log2e + 1/2) for n).
inline __m256 exp_nonpos8(__m256 x) {
  const __m256 xc = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_GE_OQ);
  return _mm256_and_ps(keep, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Scores (partial sums) of GN query heads (q (GN, Hp), zero past H) against RT key rows, each row's chunks
// loaded once for the GN heads: part[g * kTile + i] (8 lanes) for row i of krow.
template <typename R, int GN, int RT>
inline void score_rows(const float* q, int64_t Hp, int64_t CF, int64_t rem, const R* const* krow, __m256* part) {
  __m256 a[GN][RT];
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < RT; ++i) a[g][i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < CF; ++c) {
    __m256 kv[RT];
    for (int i = 0; i < RT; ++i) kv[i] = ld(krow[i] + c * 8);
    for (int g = 0; g < GN; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * Hp + c * 8);
      for (int i = 0; i < RT; ++i) a[g][i] = _mm256_fmadd_ps(qv, kv[i], a[g][i]);
    }
  }
  if (rem) {  // q is 0 past H, and so are the tail's loads
    for (int i = 0; i < RT; ++i) {
      const __m256 kv = ld_tail(krow[i] + CF * 8, rem);
      for (int g = 0; g < GN; ++g) a[g][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * Hp + CF * 8), kv, a[g][i]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int i = 0; i < RT; ++i) part[g * kTile + i] = a[g][i];
}
// Rows per score block for GN heads (GN x RT sums + RT key chunks + a q chunk <= 16 registers; 16 / RT
// blocks a full tile). Measured on Zen 3 (H = 64, fp16 / fp32 pools in cache): GN = 3 with 2 rows ran 5-10%
// faster than with 3 (16 = 5 x 3 + 1 leaves a row on its own) or 4 (spills); GN = 1 with 4, 6 or 8 rows alike.
constexpr int score_rows_for(int gn) { return gn <= 2 ? 4 : 2; }

// s (GN, kTile) = q_g · k_t for the tile's first n key rows (0 past n). CC: the chunk count H / 8 when known
// at compile time (H = 64, 128), 0 for any H.
template <typename R, int GN, int CC>
inline void score_group(const float* q, int64_t Hp, int64_t H, const R* const* krow, int64_t n, float* s, __m256* part) {
  constexpr int RT = score_rows_for(GN);
  const int64_t CF = CC ? CC : H / 8, rem = CC ? 0 : H % 8;
  int64_t t = 0;
  for (; t + RT <= n; t += RT) score_rows<R, GN, RT>(q, Hp, CF, rem, krow + t, part + t);
  for (; t < n; ++t) score_rows<R, GN, 1>(q, Hp, CF, rem, krow + t, part + t);
  for (int g = 0; g < GN; ++g) {
    for (int64_t u = n; u < kTile; ++u) part[g * kTile + u] = _mm256_setzero_ps();
    _mm256_storeu_ps(s + g * kTile, hsum8(part + g * kTile));
    _mm256_storeu_ps(s + g * kTile + 8, hsum8(part + g * kTile + 8));
  }
}

// acc (GN, Hp) chunks [c0, c0 + CB) = alpha[g] acc + sum_t w[g, t] v_t over the tile's first n value rows:
// CB x GN sums in registers, each row's CB chunks loaded once for the GN heads. Tail: chunk c0 is the last
// rem (< 8) values (acc's tail past H stays 0: the tail loads as 0).
template <typename R, int GN, int CB, bool Tail>
inline void pv_chunks(float* acc, int64_t Hp, int64_t c0, int64_t rem, const float* alpha, const float* w, const R* const* vrow,
                      int64_t n) {
  __m256 r[CB][GN];
  for (int c = 0; c < CB; ++c)
    for (int g = 0; g < GN; ++g) r[c][g] = _mm256_mul_ps(_mm256_set1_ps(alpha[g]), _mm256_loadu_ps(acc + g * Hp + (c0 + c) * 8));
  for (int64_t t = 0; t < n; ++t) {
    for (int c = 0; c < CB; ++c) {
      const __m256 vv = Tail ? ld_tail(vrow[t] + c0 * 8, rem) : ld(vrow[t] + (c0 + c) * 8);
      for (int g = 0; g < GN; ++g) r[c][g] = _mm256_fmadd_ps(_mm256_set1_ps(w[g * kTile + t]), vv, r[c][g]);
    }
  }
  for (int c = 0; c < CB; ++c)
    for (int g = 0; g < GN; ++g) _mm256_storeu_ps(acc + g * Hp + (c0 + c) * 8, r[c][g]);
}
// Chunks per P·V block for GN heads: CB x GN sums + a value chunk + GN weights <= 16 registers (GN = 3:
// 12 + 1 + 3, no spill in GCC 12's code; 2 chunks measured the same).
constexpr int pv_chunks_for(int gn) { return gn == 1 ? 8 : gn <= 3 ? 4 : 2; }

template <typename R, int GN, int CC>
inline void pv_group(float* acc, int64_t Hp, int64_t H, const float* alpha, const float* w, const R* const* vrow, int64_t n) {
  constexpr int CB = pv_chunks_for(GN);
  if constexpr (CC > 0) {  // H = 8 CC: blocks of CB chunks, then single chunks
    for (int c0 = 0; c0 + CB <= CC; c0 += CB) pv_chunks<R, GN, CB, false>(acc, Hp, c0, 0, alpha, w, vrow, n);
    if constexpr (CC % CB != 0)
      for (int c0 = CC / CB * CB; c0 < CC; ++c0) pv_chunks<R, GN, 1, false>(acc, Hp, c0, 0, alpha, w, vrow, n);
  } else {  // the same at run time, then the tail's H % 8 values
    const int64_t CF = H / 8, rem = H % 8, CF0 = CF / CB * CB;
    for (int64_t c0 = 0; c0 < CF0; c0 += CB) pv_chunks<R, GN, CB, false>(acc, Hp, c0, 0, alpha, w, vrow, n);
    for (int64_t c0 = CF0; c0 < CF; ++c0) pv_chunks<R, GN, 1, false>(acc, Hp, c0, 0, alpha, w, vrow, n);
    if (rem) pv_chunks<R, GN, 1, true>(acc, Hp, CF, rem, alpha, w, vrow, n);
  }
}

// The shared score_all / pv_all below with 8-lane partial sums; no masked 8/16-bit loads, so the tail
// goes through ld_tail and the compile-time chunk count keys on H itself (H = 64, 128 only).
struct Isa {
  using Vec = __m256;
  static constexpr int kLanes = 8;
  static constexpr bool kMaskedTail = false;
};
#else
// Without AVX-512 or AVX2 (+ FMA + F16C): each tile row converted once into an fp32 buffer (F16C's 8-wide conversion for fp16 where
// the build has it, a shift for bf16, loops the compiler vectorises), then plain loops over it for the G heads.
inline void load_row(const c10::BFloat16* src, int64_t H, float* dst) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  for (int64_t h = 0; h < H; ++h) dst[h] = bits_to_float(static_cast<uint32_t>(raw[h]) << 16);
}
inline void load_row(const c10::Half* src, int64_t H, float* dst) {
  int64_t h = 0;
#if defined(__F16C__)
  for (; h + 8 <= H; h += 8) _mm256_storeu_ps(dst + h, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + h))));
#endif
  for (; h < H; ++h) dst[h] = static_cast<float>(src[h]);
}
inline void load_row(const int8_t* src, int64_t H, float* dst) {
  for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<float>(src[h]);
}
const float* fp8_table() {  // the 256 e4m3 codes' values, built once
  static const std::vector<float> t = [] {
    std::vector<float> v(256);
    for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return v;
  }();
  return t.data();
}

inline void load_row(const c10::Float8_e4m3fn* src, int64_t H, float* dst) {
  const uint8_t* raw = reinterpret_cast<const uint8_t*>(src);
  const float* lut = fp8_table();
  for (int64_t h = 0; h < H; ++h) dst[h] = lut[raw[h]];
}

// s[g, t] = q_g · k_t: per row, 16-value partial sums (one vector register's worth) for each head
template <typename R>
void score_all(const float* q, int64_t G, int64_t Hp, int64_t H, const R* const* krow, int64_t n, float* s) {
  const int64_t H16 = H / 16 * 16;
  for (int64_t t = 0; t < n; ++t) {
    const float* k = krow[t];
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * Hp;
      float acc[16] = {};
      for (int64_t h0 = 0; h0 < H16; h0 += 16)
        for (int j = 0; j < 16; ++j) acc[j] += qg[h0 + j] * k[h0 + j];
      float sum = 0.f;
      for (int j = 0; j < 16; ++j) sum += acc[j];
      for (int64_t h = H16; h < H; ++h) sum += qg[h] * k[h];
      s[g * kTile + t] = sum;
    }
  }
}
// acc[g] = alpha[g] acc[g] + sum_t w[g, t] v_t, 16 values at a time (kept in registers over the rows)
template <typename R>
void pv_all(float* acc, int64_t G, int64_t Hp, int64_t H, const float* alpha, const float* w, const R* const* vrow, int64_t n) {
  const int64_t H16 = H / 16 * 16;
  for (int64_t g = 0; g < G; ++g) {
    float* a = acc + g * Hp;
    const float* wg = w + g * kTile;
    for (int64_t h0 = 0; h0 < H16; h0 += 16) {
      float r[16];
      for (int j = 0; j < 16; ++j) r[j] = alpha[g] * a[h0 + j];
      for (int64_t t = 0; t < n; ++t) {
        const float wt = wg[t];
        const float* v = vrow[t] + h0;
        for (int j = 0; j < 16; ++j) r[j] += wt * v[j];
      }
      for (int j = 0; j < 16; ++j) a[h0 + j] = r[j];
    }
    for (int64_t h = H16; h < H; ++h) {
      float r = alpha[g] * a[h];
      for (int64_t t = 0; t < n; ++t) r += wg[t] * vrow[t][h];
      a[h] = r;
    }
  }
}
constexpr bool kInPlace = false;
#endif

#if defined(__AVX512F__) || defined(LMSTACK_AVX2)
// The vector builds' dispatch over their score_group / pv_group (Isa: the build's vector, lanes, tail kind).
// The G heads of a KV head in groups of up to 4 (their sums stay in registers); CC: the chunk count, 0 for
// one known only at run time.
template <typename R, int CC>
void score_all_c(const float* q, int64_t G, int64_t Hp, int64_t H, const R* const* krow, int64_t n, float* s) {
  typename Isa::Vec part[4 * kTile];
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const float* qg = q + g0 * Hp;
    float* sg = s + g0 * kTile;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: score_group<R, 1, CC>(qg, Hp, H, krow, n, sg, part); break;
      case 2: score_group<R, 2, CC>(qg, Hp, H, krow, n, sg, part); break;
      case 3: score_group<R, 3, CC>(qg, Hp, H, krow, n, sg, part); break;
      default: score_group<R, 4, CC>(qg, Hp, H, krow, n, sg, part); break;
    }
  }
}
template <typename R, int CC>
void pv_all_c(float* acc, int64_t G, int64_t Hp, int64_t H, const float* alpha, const float* w, const R* const* vrow, int64_t n) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    float* ag = acc + g0 * Hp;
    const float *al = alpha + g0, *wg = w + g0 * kTile;
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: pv_group<R, 1, CC>(ag, Hp, H, al, wg, vrow, n); break;
      case 2: pv_group<R, 2, CC>(ag, Hp, H, al, wg, vrow, n); break;
      case 3: pv_group<R, 3, CC>(ag, Hp, H, al, wg, vrow, n); break;
      default: pv_group<R, 4, CC>(ag, Hp, H, al, wg, vrow, n); break;
    }
  }
}
// H = 64 and 128 compiled with their chunk counts (AVX-512: 4, 8 for Hp = 64, 128; AVX2: 8, 16 for H = 64,
// 128), any other at run time.
template <typename R>
void score_all(const float* q, int64_t G, int64_t Hp, int64_t H, const R* const* krow, int64_t n, float* s) {
  const int64_t key = Isa::kMaskedTail ? Hp : H;
  if (key == 64) return score_all_c<R, 64 / Isa::kLanes>(q, G, Hp, H, krow, n, s);
  if (key == 128) return score_all_c<R, 128 / Isa::kLanes>(q, G, Hp, H, krow, n, s);
  score_all_c<R, 0>(q, G, Hp, H, krow, n, s);
}
template <typename R>
void pv_all(float* acc, int64_t G, int64_t Hp, int64_t H, const float* alpha, const float* w, const R* const* vrow, int64_t n) {
  const int64_t key = Isa::kMaskedTail ? Hp : H;
  if (key == 64) return pv_all_c<R, 64 / Isa::kLanes>(acc, G, Hp, H, alpha, w, vrow, n);
  if (key == 128) return pv_all_c<R, 128 / Isa::kLanes>(acc, G, Hp, H, alpha, w, vrow, n);
  pv_all_c<R, 0>(acc, G, Hp, H, alpha, w, vrow, n);
}
constexpr bool kInPlace = true;  // score_all / pv_all read the pool's rows in their stored dtype
#endif

struct Args {
  const float* q;        // (B, N, H) fp32
  const float* k_new;    // (B, K, H) fp32 or null
  const float* v_new;
  const float* k_scale;  // (NB, K) or null
  const float* v_scale;
  const int64_t* table;  // (B, M)
  const int64_t* pos;    // (B,)
  float* out;            // (B, N, H) fp32
  int64_t B, N, K, G, H, bs, M, NB, window;
  float softcap;
  float q_scale;  // 1/sqrt(H), applied as q is copied per row
};

inline void cap(float* s, int64_t n, float c) {
  for (int64_t t = 0; t < n; ++t) s[t] = c * std::tanh(s[t] / c);
}

// The running state of one KV head's G query heads: max m, sum l, output acc (G, Hp); q (G, Hp) zero past H.
struct Online {
  float* q;
  float *m, *l, *acc;
};

// One tile for one KV head: scores (G, kTile) of its n rows (krow; times the rows' scales ks, if any),
// -inf past n; the online softmax per head (Dao 2023); then P·V over the rows (vrow, scales vs) for all G.
template <typename R>
void tile(const Args& a, Online& o, const R* const* krow, const R* const* vrow, const float* ks, const float* vs, int64_t n,
          int64_t Hp, float* sc, float* alpha) {
  const int64_t G = a.G, H = a.H;
  score_all<R>(o.q, G, Hp, H, krow, n, sc);
  for (int64_t g = 0; g < G; ++g) {
    float* s = sc + g * kTile;
#if defined(__AVX512F__)  // the tile's 16 scores are one vector
    const __mmask16 valid = __mmask16((1u << n) - 1);
    __m512 sv = _mm512_loadu_ps(s);
    if (ks) sv = _mm512_mul_ps(sv, _mm512_loadu_ps(ks));
    if (a.softcap > 0.f) {
      _mm512_storeu_ps(s, sv);
      cap(s, n, a.softcap);
      sv = _mm512_loadu_ps(s);
    }
    sv = _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf), sv);
    const float mt = _mm512_reduce_max_ps(sv);
#elif defined(LMSTACK_AVX2)  // the tile's 16 scores are two vectors
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), nv = _mm256_set1_epi32(static_cast<int>(n));
    const __m256 valid0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, iota));
    const __m256 valid1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, _mm256_add_epi32(iota, _mm256_set1_epi32(8))));
    __m256 sv0 = _mm256_loadu_ps(s), sv1 = _mm256_loadu_ps(s + 8);
    if (ks) {
      sv0 = _mm256_mul_ps(sv0, _mm256_loadu_ps(ks));
      sv1 = _mm256_mul_ps(sv1, _mm256_loadu_ps(ks + 8));
    }
    if (a.softcap > 0.f) {
      _mm256_storeu_ps(s, sv0);
      _mm256_storeu_ps(s + 8, sv1);
      cap(s, n, a.softcap);
      sv0 = _mm256_loadu_ps(s);
      sv1 = _mm256_loadu_ps(s + 8);
    }
    sv0 = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), sv0, valid0);
    sv1 = _mm256_blendv_ps(_mm256_set1_ps(kNegInf), sv1, valid1);
    const float mt = hmax8(_mm256_max_ps(sv0, sv1));
#else
    if (ks)
      for (int64_t t = 0; t < n; ++t) s[t] *= ks[t];
    if (a.softcap > 0.f) cap(s, n, a.softcap);
    for (int64_t t = n; t < kTile; ++t) s[t] = kNegInf;
    float mt = kNegInf;
#pragma omp simd reduction(max : mt)
    for (int t = 0; t < kTile; ++t) mt = std::max(mt, s[t]);
#endif
    if (mt == kNegInf) {  // nothing this tile adds (every score -inf): weights 0, the output kept
      alpha[g] = 1.f;
      for (int t = 0; t < kTile; ++t) s[t] = 0.f;
      continue;
    }
    const float m_new = std::max(o.m[g], mt);
    alpha[g] = o.m[g] == kNegInf ? 0.f : exp_nonpos(o.m[g] - m_new);
#if defined(__AVX512F__)
    __m512 pv = exp_nonpos16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new)));  // -inf (past n) -> 0
    const float sum = _mm512_reduce_add_ps(pv);
    if (vs) pv = _mm512_maskz_mul_ps(valid, pv, _mm512_loadu_ps(vs));  // p v of codes times their scale
    _mm512_storeu_ps(s, pv);  // the scores become the weights
#elif defined(LMSTACK_AVX2)
    const __m256 mv = _mm256_set1_ps(m_new);
    __m256 p0 = exp_nonpos8(_mm256_sub_ps(sv0, mv)), p1 = exp_nonpos8(_mm256_sub_ps(sv1, mv));  // -inf (past n) -> 0
    const float sum = hadd8(_mm256_add_ps(p0, p1));
    if (vs) {  // p v of codes times their scale
      p0 = _mm256_and_ps(valid0, _mm256_mul_ps(p0, _mm256_loadu_ps(vs)));
      p1 = _mm256_and_ps(valid1, _mm256_mul_ps(p1, _mm256_loadu_ps(vs + 8)));
    }
    _mm256_storeu_ps(s, p0);  // the scores become the weights
    _mm256_storeu_ps(s + 8, p1);
#else
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < kTile; ++t) {
      s[t] = exp_nonpos(s[t] - m_new);  // -inf (past n) -> 0; the scores become the weights p
      sum += s[t];
    }
    if (vs)
      for (int64_t t = 0; t < n; ++t) s[t] *= vs[t];  // p v of codes times their scale
#endif
    o.l[g] = o.l[g] * alpha[g] + sum;
    o.m[g] = m_new;
  }
  pv_all<R>(o.acc, G, Hp, H, alpha, sc, vrow, n);
}

struct Slots {  // a tile's slots: block ids and row offsets (slot · K) in the pool
  int64_t n = 0, blk[kTile], at[kTile];
};

// The visible pool slots [lo, hi) of row b.
inline std::pair<int64_t, int64_t> visible(const Args& a, int64_t b) {
  const int64_t p = a.pos[b];
  return {a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0, a.k_new ? p : p + 1};
}

// Row b, KV heads [kh0, kh1): slot by slot through the row's blocks, a tile of 16 slots at a time, every
// head of the range per tile (so the pool is read in the order it lies: a slot's heads are adjacent). The
// next item of the thread (row nb >= 0, heads [nh0, nh1)) has its first tile prefetched during the last one.
template <typename T>
void attend_row(const Args& a, const T* kp, const T* vp, int64_t b, int64_t kh0, int64_t kh1, int64_t nb, int64_t nh0,
                int64_t nh1) {
  using R = std::conditional_t<kInPlace, T, float>;  // what score_all / pv_all read
  const int64_t G = a.G, H = a.H, K = a.K, bs = a.bs, Hp = (H + 15) / 16 * 16, nk = kh1 - kh0;
  const auto [lo, hi] = visible(a, b);  // pool slots [lo, hi) are visible
  const int64_t* row = a.table + b * a.M;
  // per KV head: q (G, Hp), acc (G, Hp), m (G), l (G); then the tile's scores (G, kTile) and alphas (G)
  std::vector<float> ws(nk * (2 * G * Hp + 2 * G) + G * kTile + G, 0.f);
  std::vector<Online> st(nk);
  for (int64_t i = 0; i < nk; ++i) {
    float* base = ws.data() + i * (2 * G * Hp + 2 * G);
    st[i] = Online{base, base + 2 * G * Hp, base + 2 * G * Hp + G, base + G * Hp};
    for (int64_t g = 0; g < G; ++g) {
      st[i].m[g] = kNegInf;
      const float* src = a.q + (b * a.N + (kh0 + i) * G + g) * H;
      for (int64_t h = 0; h < H; ++h) st[i].q[g * Hp + h] = src[h] * a.q_scale;
    }
  }
  float* sc = ws.data() + nk * (2 * G * Hp + 2 * G);
  float* alpha = sc + G * kTile;
  std::vector<float> kbuf(kInPlace ? 0 : kTile * H), vbuf(kInPlace ? 0 : kTile * H);
  const R* krow[kTile];
  const R* vrow[kTile];
  float ks[kTile] = {}, vs[kTile] = {};
  // a tile's slots [t0, t1) of row rb (t1 - t0 <= kTile): their block ids and their rows' offsets in the pool
  // (in rows of H), one division per tile
  auto slots_of = [&](int64_t rb, int64_t t0, int64_t t1, Slots& o) {
    const int64_t* r = a.table + rb * a.M;
    int64_t j = t0 / bs, off = t0 % bs;
    o.n = t1 - t0;
    for (int64_t t = 0; t < o.n; ++t) {
      const int64_t blk = r[j];
      TORCH_CHECK(blk >= 0 && blk < a.NB, "paged_decode: block id ", blk, " (row ", rb, ", table entry ", j,
                  ") outside the pool's ", a.NB, " blocks");
      o.blk[t] = blk;
      o.at[t] = (blk * bs + off) * K;
      if (++off == bs) {
        off = 0;
        ++j;
      }
    }
  };
  auto prefetch = [&](const Slots& o, int64_t h0, int64_t h1) {  // their K, V rows of heads [h0, h1): the pool is cold
    const int64_t span = (h1 - h0) * H * static_cast<int64_t>(sizeof(T));
    for (int64_t t = 0; t < o.n; ++t) {
      const char* k = reinterpret_cast<const char*>(kp + (o.at[t] + h0) * H);
      const char* v = reinterpret_cast<const char*>(vp + (o.at[t] + h0) * H);
      for (int64_t off = 0; off < span; off += 64) {
        __builtin_prefetch(k + off, 0, 3);
        __builtin_prefetch(v + off, 0, 3);
      }
      asm volatile("");  // GCC 12 deleted these loops of prefetches as code without effect
    }
  };
  Slots cur, nxt;
  if (lo < hi) {
    slots_of(b, lo, std::min(lo + kTile, hi), cur);
    prefetch(cur, kh0, kh1);
  }
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t n = cur.n;
    if (t0 + kTile < hi) {  // the next tile's rows arrive while this one is scored
      slots_of(b, t0 + kTile, std::min(t0 + 2 * kTile, hi), nxt);
      prefetch(nxt, kh0, kh1);
    } else if (nb >= 0) {  // the last tile: the next item's first
      const auto [nlo, nhi] = visible(a, nb);
      if (nlo < nhi) {
        slots_of(nb, nlo, std::min(nlo + kTile, nhi), nxt);
        prefetch(nxt, nh0, nh1);
      }
    }
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      for (int64_t t = 0; t < n; ++t) {
        const T* k = kp + (cur.at[t] + kh) * H;
        const T* v = vp + (cur.at[t] + kh) * H;
        if constexpr (kInPlace || std::is_same_v<T, float>) {
          krow[t] = reinterpret_cast<const R*>(k);
          vrow[t] = reinterpret_cast<const R*>(v);
        } else {
          load_row(k, H, kbuf.data() + t * H);
          load_row(v, H, vbuf.data() + t * H);
          krow[t] = reinterpret_cast<const R*>(kbuf.data() + t * H);
          vrow[t] = reinterpret_cast<const R*>(vbuf.data() + t * H);
        }
        if (a.k_scale) {
          ks[t] = a.k_scale[cur.blk[t] * K + kh];
          vs[t] = a.v_scale[cur.blk[t] * K + kh];
        }
      }
      tile<R>(a, st[kh - kh0], krow, vrow, a.k_scale ? ks : nullptr, a.k_scale ? vs : nullptr, n, Hp, sc, alpha);
    }
    std::swap(cur, nxt);
  }
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    Online& o = st[kh - kh0];
    if (a.k_new) {  // this step's token: one more visible column, at position p (fp32 rows)
      const float* kn = a.k_new + (b * K + kh) * H;
      const float* vn = a.v_new + (b * K + kh) * H;
      tile<float>(a, o, &kn, &vn, nullptr, nullptr, 1, Hp, sc, alpha);
    }
    float* out = a.out + (b * a.N + kh * G) * H;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.f / o.l[g];  // l = 0 (no visible key) gives NaN, as a softmax over none does
      for (int64_t h = 0; h < H; ++h) out[g * H + h] = o.acc[g * Hp + h] * inv;
    }
  }
}

// at::parallel_for over (row, KV head) items; a thread's consecutive items of one row go together.
template <typename T>
void run(const Args& a, const at::Tensor& kp, const at::Tensor& vp) {
  const T* k = reinterpret_cast<const T*>(kp.data_ptr());
  const T* v = reinterpret_cast<const T*>(vp.data_ptr());
  at::parallel_for(0, a.B * a.K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t b = i / a.K, last = std::min(end, (b + 1) * a.K);
      const int64_t nb = last < end ? last / a.K : -1, nlast = std::min(end, (nb + 1) * a.K);
      attend_row<T>(a, k, v, b, i % a.K, i % a.K + (last - i), nb, last % a.K, last % a.K + (nlast - last));
      i = last;
    }
  });
}

at::Tensor as_float(const at::Tensor& x) { return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous(); }

at::Tensor paged_decode(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table_in,
                        const at::Tensor& positions_in, const std::optional<at::Tensor>& k_new,
                        const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale, int64_t window, double softcap) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(2) == 1, "paged_decode: q must be (B, N, 1, H), got ", q_in.sizes());
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(), "paged_decode: pools must be (NB, bs, K, H) alike, got ",
              k_pool.sizes(), " and ", v_pool.sizes());
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "paged_decode: K and V pools differ in dtype");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat || q_in.scalar_type() == at::kBFloat16 || q_in.scalar_type() == at::kHalf,
              "paged_decode: q must be float32, bfloat16 or float16, got ", q_in.scalar_type());
  const int64_t B = q_in.size(0), N = q_in.size(1), H = q_in.size(3);
  const int64_t NB = k_pool.size(0), bs = k_pool.size(1), K = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == H, "paged_decode: pool head dim ", k_pool.size(3), " != q's ", H);
  TORCH_CHECK(K > 0 && N % K == 0, "paged_decode: ", N, " query heads are not a multiple of ", K, " KV heads");
  TORCH_CHECK(table_in.dim() == 2 && table_in.size(0) == B, "paged_decode: table must be (B=", B, ", M), got ", table_in.sizes());
  TORCH_CHECK(positions_in.dim() == 1 && positions_in.size(0) == B, "paged_decode: positions must be (B=", B, ",)");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "paged_decode: give both k_new and v_new or neither");
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "paged_decode: give both scales or neither");
  const at::Tensor table = table_in.to(at::kLong).contiguous(), positions = positions_in.to(at::kLong).contiguous();
  const int64_t M = table.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t hi = k_new ? pos[b] : pos[b] + 1;
    TORCH_CHECK(pos[b] >= 0 && hi <= M * bs, "paged_decode: row ", b, " at position ", pos[b], " needs slots up to ", hi,
                " but its table holds ", M, " blocks of ", bs);
  }
  const at::Tensor q = as_float(q_in);  // times 1/sqrt(H) in the kernel (one op less a call)
  at::Tensor kn, vn, ks, vs;
  if (k_new) {
    TORCH_CHECK(k_new->sizes() == at::IntArrayRef({B, K, H}) && v_new->sizes() == k_new->sizes(),
                "paged_decode: k_new, v_new must be (B, K, H) = (", B, ", ", K, ", ", H, ")");
    kn = as_float(*k_new);
    vn = as_float(*v_new);
  }
  if (k_scale) {
    TORCH_CHECK(k_scale->sizes() == at::IntArrayRef({NB, K}) && v_scale->sizes() == k_scale->sizes(),
                "paged_decode: scales must be (NB, K) = (", NB, ", ", K, ")");
    ks = as_float(*k_scale);
    vs = as_float(*v_scale);
  }
  const at::Tensor kp = k_pool.contiguous(), vp = v_pool.contiguous();
  at::Tensor out = at::empty({B, N, 1, H}, q.options());
  Args a{q.data_ptr<float>(),
         k_new ? kn.data_ptr<float>() : nullptr,
         k_new ? vn.data_ptr<float>() : nullptr,
         k_scale ? ks.data_ptr<float>() : nullptr,
         k_scale ? vs.data_ptr<float>() : nullptr,
         table.data_ptr<int64_t>(),
         pos,
         out.data_ptr<float>(),
         B, N, K, N / K, H, bs, M, NB, window, static_cast<float>(softcap),
         static_cast<float>(1.0 / std::sqrt(static_cast<double>(H)))};
  switch (kp.scalar_type()) {
    case at::kFloat: run<float>(a, kp, vp); break;
    case at::kBFloat16: run<c10::BFloat16>(a, kp, vp); break;
    case at::kHalf: run<c10::Half>(a, kp, vp); break;
    case at::kChar: run<int8_t>(a, kp, vp); break;
    case at::kFloat8_e4m3fn: run<c10::Float8_e4m3fn>(a, kp, vp); break;
    default: TORCH_CHECK(false, "paged_decode: pool dtype ", kp.scalar_type(), " (expected float32, bfloat16, float16, int8 or fp8 e4m3)");
  }
  return q_in.scalar_type() == at::kFloat ? out : out.to(q_in.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lmstack_attn, lib) {
  lib.def(LMSTACK_STR(LMSTACK_OP) "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor positions, Tensor? k_new, "
                                  "Tensor? v_new, Tensor? k_scale, Tensor? v_scale, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(lmstack_attn, CPU, lib) { lib.impl(LMSTACK_STR(LMSTACK_OP), &paged_decode); }
