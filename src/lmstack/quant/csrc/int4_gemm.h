// The int4 prefill GEMM without the whole dequantised weight in memory (both kernels' builds include it):
// y (M, O) fp32 = x (M, I) · W^T, W = d·q + m, with W dequantised one block of output rows at a time into a
// per-thread buffer that stays in L2 and multiplied right after (CS336 notes "性能指标分析": the old path wrote
// the whole (O, I) weight in bf16/fp32 to DRAM and read it back; at 90 rows that pass took a third of the
// layer). Two ways to multiply a block:
//  * bf16 on a CPU oneDNN's brgemm micro-kernel runs (AMX / AVX512_BF16; ATen's ``cpublas::brgemm``, the one
//    torch.compile's CPU GEMM templates call): the block is dequantised straight into the VNNI layout the
//    kernel takes for B, (I/2, N, 2) bf16 (element (i, n) at ((i/2)·N + n)·2 + i%2), and the kernel writes
//    its fp32 accumulators into the output's columns (ld_c = O): no pack pass, no cast pass.
//  * otherwise (fp32, e.g. an AVX2-only CPU; or bf16 without the micro-kernel): the block is dequantised row
//    major and ``at::mm_out`` (MKL / oneDNN) writes into the output's columns (bf16: through a small tile).
// Blocks split over threads (at::parallel_for); each block's GEMM then runs on its thread alone (inside the
// parallel region oneDNN and MKL do not fork again), so nothing nests.
#pragma once

#include "int4_common.h"
#include <ATen/ThreadLocalState.h>
#include <ATen/native/CPUBlas.h>

namespace lmstack_int4 {

// Output rows per block when the caller passes block = 0 (benchmarks/int4_prefill.py on SmolLM2-135M's shapes,
// M = 16-512, docs/quant.md): brgemm 128 (32 rows 5-10 % slower, 64 within 1-3 % but up to 10 % slower at 512
// rows, 192 and 256 the same); at::mm fp32 128 (64-576 within noise). On n > 1 threads the block halves (down
// to 64 rows) until there are 4n blocks, so the last thread's share is not a whole extra block.
constexpr int64_t kBlockBrgemm = 128;
constexpr int64_t kBlockMm = 128;
constexpr int64_t kBlockMinTiles = 4;

// 16 floats -> 16 bf16 bits, rounded to nearest even (bf16_bits on every lane).
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m256i bf16x16(__m512 w) {
  const __m512i u = _mm512_castps_si512(w);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16));
}

// One tile of 16 output rows into the VNNI block ``out`` (I/2, N, 2) at columns n0..n0+15. A 64-byte chunk's low
// nibbles are inputs 8c+0..3 of the 16 rows (4 bytes a row), the high ones 8c+4..7. Each 16-byte quarter k
// (rows 4k..4k+3) becomes 16 floats d·q + m (the rows' d, m spread by a permute per group); quarters 0, 1 as
// bf16 side by side give A (rows 0-7, one dword per row and input pair), quarters 2, 3 give B (rows 8-15), and
// the even dwords of A:B are input pair 0 of all 16 rows, the odd ones pair 1: one 64-byte store per pair.
// PAIR(hi, lo) turns two 16-float vectors into 32 bf16 (lo in the low half): with AVX512_BF16 one vcvtne2ps2bf16
// (the rounding is the same, nearest even), else the integer rounding of bf16x16 on each.
#define LMSTACK_VNNI_TILE(PAIR)                                                                                 \
  __m512i quarter[4]; /* lane l of quarter k: row 4k + l/4 */                                                  \
  for (int k = 0; k < 4; ++k) {                                                                                \
    alignas(64) int32_t ix[16];                                                                                \
    for (int l = 0; l < 16; ++l) ix[l] = 4 * k + l / 4;                                                        \
    quarter[k] = _mm512_load_si512(ix);                                                                        \
  }                                                                                                            \
  alignas(64) int32_t ev[16], od[16];                                                                          \
  for (int l = 0; l < 16; ++l) {                                                                               \
    ev[l] = 2 * l;                                                                                             \
    od[l] = 2 * l + 1;                                                                                         \
  }                                                                                                            \
  const __m512i even = _mm512_load_si512(ev), odd = _mm512_load_si512(od), low = _mm512_set1_epi32(0x0F);      \
  for (int64_t g = 0; g < NG; ++g) {                                                                           \
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dt + g * 16)));     \
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mt + g * 16)));     \
    __m512 dq[4], mq[4];                                                                                       \
    for (int k = 0; k < 4; ++k) {                                                                              \
      dq[k] = _mm512_permutexvar_ps(quarter[k], dv);                                                           \
      mq[k] = _mm512_permutexvar_ps(quarter[k], mv);                                                           \
    }                                                                                                          \
    for (int64_t c = g * G / 8; c < (g + 1) * G / 8; ++c) {                                                    \
      _mm_prefetch(reinterpret_cast<const char*>(wt + c * 64 + kPrefetch), _MM_HINT_T0); /* as the kernels do */ \
      __m512 f[2][4]; /* [low | high nibbles][quarter k] */                                                    \
      for (int k = 0; k < 4; ++k) {                                                                            \
        const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wt + c * 64 + 16 * k))); \
        f[0][k] = _mm512_fmadd_ps(dq[k], _mm512_cvtepi32_ps(_mm512_and_si512(x, low)), mq[k]);                 \
        f[1][k] = _mm512_fmadd_ps(dq[k], _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4)), mq[k]);                  \
      }                                                                                                        \
      for (int h = 0; h < 2; ++h) { /* 0: inputs 8c+0..3 (pairs 4c, 4c+1); 1: 8c+4..7 (pairs 4c+2, 4c+3) */   \
        const __m512i A = PAIR(f[h][1], f[h][0]), B = PAIR(f[h][3], f[h][2]);                               \
        const int64_t pair = 4 * c + 2 * h;                                                                    \
        _mm512_storeu_si512(out + (pair * N + n0) * 2, _mm512_permutex2var_epi32(A, even, B));                 \
        _mm512_storeu_si512(out + ((pair + 1) * N + n0) * 2, _mm512_permutex2var_epi32(A, odd, B));            \
      }                                                                                                        \
    }                                                                                                          \
  }

inline __m512i bf16_pair(__m512 hi, __m512 lo) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16(lo)), bf16x16(hi), 1);
}
inline void dequant_tile_vnni_int(uint16_t* out, int64_t N, int64_t n0, const uint8_t* wt, const at::Half* dt,
                                  const at::Half* mt, int64_t I, int64_t NG, int64_t G) {
  LMSTACK_VNNI_TILE(bf16_pair)
}
__attribute__((target("avx512bf16"))) inline void dequant_tile_vnni_ne(uint16_t* out, int64_t N, int64_t n0,
                                                                       const uint8_t* wt, const at::Half* dt,
                                                                       const at::Half* mt, int64_t I, int64_t NG,
                                                                       int64_t G) {
#define LMSTACK_NE(hi, lo) ((__m512i)_mm512_cvtne2ps_pbh(hi, lo))
  LMSTACK_VNNI_TILE(LMSTACK_NE)
#undef LMSTACK_NE
}
#undef LMSTACK_VNNI_TILE

// AVX512_BF16's conversion where the CPU has it (asked once), else the integer rounding.
inline void dequant_tile_vnni(uint16_t* out, int64_t N, int64_t n0, const uint8_t* wt, const at::Half* dt,
                              const at::Half* mt, int64_t I, int64_t NG, int64_t G) {
  static const bool ne = __builtin_cpu_supports("avx512bf16");
  if (ne) dequant_tile_vnni_ne(out, N, n0, wt, dt, mt, I, NG, G);
  else dequant_tile_vnni_int(out, N, n0, wt, dt, mt, I, NG, G);
}
#else
inline void dequant_tile_vnni(uint16_t* out, int64_t N, int64_t n0, const uint8_t* wt, const at::Half* dt,
                              const at::Half* mt, int64_t I, int64_t NG, int64_t G) {
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t c = g * G / 8; c < (g + 1) * G / 8; ++c)
      for (int r = 0; r < 16; ++r) {
        const float d = static_cast<float>(dt[g * 16 + r]), m = static_cast<float>(mt[g * 16 + r]);
        const uint8_t* b = wt + c * 64 + 4 * r;
        for (int j = 0; j < 8; ++j) {
          const int64_t i = 8 * c + j;
          const float w = d * static_cast<float>(j < 4 ? b[j] & 0xF : b[j - 4] >> 4) + m;
          out[((i / 2) * N + n0 + r) * 2 + (i & 1)] = bf16_bits(w);
        }
      }
}
#endif

// Whether ATen's bf16 brgemm runs here: asked once, by a 1 x 16 x 32 product (torch builds without oneDNN's
// micro-kernel, or a CPU without AMX / AVX512_BF16, raise).
inline bool brgemm_bf16_ok() {
  static const bool ok = [] {
    try {
      std::vector<at::BFloat16> a(32, at::BFloat16(1.f)), b(32 * 16, at::BFloat16(1.f));
      std::vector<float> c(16, 0.f);
      at::native::cpublas::brgemm(1, 16, 32, 32, 16, 16, false, a.data(), b.data(), c.data(), true);
      at::native::cpublas::brgemm_release(true);
      return c[0] == 32.f && c[15] == 32.f;
    } catch (...) {
      return false;
    }
  }();
  return ok;
}

// The op: x (M, I) float32 or bf16 -> y (M, O) float32, W in ``bf16`` (else fp32), ``block`` output rows per
// block (a multiple of 16; 0: the measured default). ``name`` prefixes every error.
inline at::Tensor int4_gemm(const char* name, const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& d,
                            const at::Tensor& m, int64_t G, bool bf16, int64_t block) {
  TORCH_CHECK(x_in.dim() == 2, name, ": x must be (M, I), got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, name,
              ": x must be float32 or bfloat16, got ", x_in.scalar_type());
  const int64_t M = x_in.size(0), I = x_in.size(1), T = packed.size(0), O = 16 * T;
  const int64_t NG = check_packed(name, packed, d, m, G, I);
  TORCH_CHECK(block >= 0 && block % 16 == 0, name, ": block must be 0 (the default) or a positive multiple of 16 "
              "output rows, got ", block);
  at::Tensor y = at::empty({M, O}, x_in.options().dtype(at::kFloat));
  if (M == 0 || T == 0) return y;
  const at::Tensor x = x_in.to(bf16 ? at::kBFloat16 : at::kFloat).contiguous();  // one cast of the activations
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.data_ptr<at::Half>();
  const bool brgemm = bf16 && brgemm_bf16_ok();
  const int64_t threads = at::get_num_threads();
  int64_t TB = std::max<int64_t>(1, (block ? block : brgemm ? kBlockBrgemm : kBlockMm) / 16);  // tiles a block
  if (!block)
    while (threads > 1 && TB > kBlockMinTiles && (T + TB - 1) / TB < 4 * threads) TB /= 2;
  const int64_t NB = (T + TB - 1) / TB;
  float* yp = y.data_ptr<float>();
  // the caller's thread-local state (inference mode, grad mode) for the worker threads: at::parallel_for does
  // not carry it, and the fp32 path's at::mm_out into an inference-mode y raised "Inplace update to inference
  // tensor outside InferenceMode" on a worker thread
  const at::ThreadLocalState caller;
  auto body = [&](int64_t b0, int64_t b1) {
    at::ThreadLocalStateGuard tls(caller);
    // this thread's block of W, reused across calls; 64-byte aligned: the micro-kernel's tile loads of B rows
    // that straddle two cache lines made whole calls ~1.8x slower (the vector's own alignment is malloc's 16)
    static thread_local std::vector<uint8_t> wbuf;
    wbuf.resize(static_cast<size_t>(16 * TB * I * (bf16 ? 2 : 4) + 64));
    void* wb = wbuf.data() + ((64 - reinterpret_cast<uintptr_t>(wbuf.data()) % 64) % 64);
    uint16_t* w16 = static_cast<uint16_t*>(wb);
    float* w32 = static_cast<float*>(wb);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t0 = b * TB, nt = std::min(TB, T - t0), N = 16 * nt;
      const uint8_t* wt = wp + t0 * (I / 8) * 64;
      const at::Half* dt = dp + t0 * NG * 16;
      const at::Half* mt = mp + t0 * NG * 16;
      if (brgemm) {
        for (int64_t t = 0; t < nt; ++t)
          dequant_tile_vnni(w16, N, 16 * t, wt + t * (I / 8) * 64, dt + t * NG * 16, mt + t * NG * 16, I, NG, G);
        at::native::cpublas::brgemm(M, N, I, I, N, O, false, x.data_ptr<at::BFloat16>(),
                                    reinterpret_cast<const at::BFloat16*>(w16), yp + 16 * t0, true);
      } else if (!bf16) {
        for (int64_t t = 0; t < nt; ++t)
          dequant_tile(w32 + 16 * t * I, wt + t * (I / 8) * 64, dt + t * NG * 16, mt + t * NG * 16, I, NG, G);
        at::Tensor out = y.narrow(1, 16 * t0, N);  // (M, N) with row stride O: the GEMM writes it in place
        at::mm_out(out, x, at::from_blob(w32, {N, I}, x.options()).t());
      } else {
        for (int64_t t = 0; t < nt; ++t)
          dequant_tile(w16 + 16 * t * I, wt + t * (I / 8) * 64, dt + t * NG * 16, mt + t * NG * 16, I, NG, G);
        const at::Tensor w = at::from_blob(w16, {N, I}, x.options());
        y.narrow(1, 16 * t0, N).copy_(at::mm(x, w.t()));
      }
    }
    if (brgemm) at::native::cpublas::brgemm_release(true);
  };
  if (threads > 1 && NB > 1) at::parallel_for(0, NB, 1, body); else body(0, NB);
  return y;
}

}  // namespace lmstack_int4
