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
// once for the G query heads that share it, in tiles of 16 slots: 16 scores per query head, one rescale of
// the running output per tile; a row's KV heads go through a tile together (the pool's order) with the next
// tile prefetched. Plain loops for the compiler to vectorise: the file is built once per ISA
// (the -m flags in lmstack/inference/paged_kernel.py) and the op is named after the build (LMSTACK_OP).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
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

// One stored row of H values -> fp32, times the block's scale.
inline void load_row(const float* src, float s, int64_t H, float* dst) {
  for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * s;
}
inline void load_row(const c10::BFloat16* src, float s, int64_t H, float* dst) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  for (int64_t h = 0; h < H; ++h) dst[h] = bits_to_float(static_cast<uint32_t>(raw[h]) << 16) * s;
}
inline void load_row(const c10::Half* src, float s, int64_t H, float* dst) {
  for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<float>(src[h]) * s;
}
inline void load_row(const int8_t* src, float s, int64_t H, float* dst) {
  for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<float>(src[h]) * s;
}
const float* fp8_table() {  // the 256 e4m3 codes' values, built once
  static const std::vector<float> t = [] {
    std::vector<float> v(256);
    for (int i = 0; i < 256; ++i) v[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return v;
  }();
  return t.data();
}
inline void load_row(const c10::Float8_e4m3fn* src, float s, int64_t H, float* dst) {
  const uint8_t* raw = reinterpret_cast<const uint8_t*>(src);
  const float* lut = fp8_table();
  for (int64_t h = 0; h < H; ++h) dst[h] = lut[raw[h]] * s;
}

#if defined(__AVX512F__)
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

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// s[t] = q · k_t for the tile's 16 rows (rows past the tile's end point at zeros); full 16-value chunks
// with plain loads (folded into the FMA), the tail masked
inline void score_tile(const float* q, const float* const* krow, int64_t H, float* s) {
  __m512 acc[kTile];
  for (int t = 0; t < kTile; ++t) acc[t] = _mm512_setzero_ps();
  const int64_t H16 = H / 16 * 16;
  for (int64_t h0 = 0; h0 < H16; h0 += 16) {
    const __m512 qv = _mm512_loadu_ps(q + h0);
    for (int t = 0; t < kTile; ++t) acc[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(krow[t] + h0), acc[t]);
  }
  if (H16 < H) {
    const __mmask16 m = tail_mask(H - H16);
    const __m512 qv = _mm512_maskz_loadu_ps(m, q + H16);
    for (int t = 0; t < kTile; ++t) acc[t] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, krow[t] + H16), acc[t]);
  }
  _mm512_storeu_ps(s, hsum16(acc));
}

// a = alpha a + sum_t p[t] v_t (H values; p[t] = 0 past the tile's end): the 16 broadcasts of p made once
inline void pv_tile(float* a, float alpha, const float* p, const float* const* vrow, int64_t H) {
  __m512 pb[kTile];
  for (int t = 0; t < kTile; ++t) pb[t] = _mm512_set1_ps(p[t]);
  const __m512 va = _mm512_set1_ps(alpha);
  const int64_t H16 = H / 16 * 16;
  for (int64_t h0 = 0; h0 < H16; h0 += 16) {
    __m512 r = _mm512_mul_ps(va, _mm512_loadu_ps(a + h0));
    for (int t = 0; t < kTile; ++t) r = _mm512_fmadd_ps(pb[t], _mm512_loadu_ps(vrow[t] + h0), r);
    _mm512_storeu_ps(a + h0, r);
  }
  if (H16 < H) {
    const __mmask16 m = tail_mask(H - H16);
    __m512 r = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, a + H16));
    for (int t = 0; t < kTile; ++t) r = _mm512_fmadd_ps(pb[t], _mm512_maskz_loadu_ps(m, vrow[t] + H16), r);
    _mm512_mask_storeu_ps(a + H16, m, r);
  }
}
#else
// The same two steps in plain loops over 16-value chunks (vectorised by the build's -m flags).
inline void score_tile(const float* q, const float* const* krow, int64_t H, float* s) {
  const int64_t H16 = H / 16 * 16;
  for (int t = 0; t < kTile; ++t) {
    const float* k = krow[t];
    float acc[16] = {};
    for (int64_t h0 = 0; h0 < H16; h0 += 16)
      for (int j = 0; j < 16; ++j) acc[j] += q[h0 + j] * k[h0 + j];
    float sum = 0.f;
    for (int j = 0; j < 16; ++j) sum += acc[j];
    for (int64_t h = H16; h < H; ++h) sum += q[h] * k[h];
    s[t] = sum;
  }
}

inline void pv_tile(float* a, float alpha, const float* p, const float* const* vrow, int64_t H) {
  const int64_t H16 = H / 16 * 16;
  for (int64_t h0 = 0; h0 < H16; h0 += 16) {
    float r[16];
    for (int j = 0; j < 16; ++j) r[j] = alpha * a[h0 + j];
    for (int t = 0; t < kTile; ++t) {
      const float pt = p[t];
      const float* v = vrow[t] + h0;
      for (int j = 0; j < 16; ++j) r[j] += pt * v[j];
    }
    for (int j = 0; j < 16; ++j) a[h0 + j] = r[j];
  }
  for (int64_t h = H16; h < H; ++h) {
    float r = alpha * a[h];
    for (int t = 0; t < kTile; ++t) r += p[t] * vrow[t][h];
    a[h] = r;
  }
}
#endif

struct Args {
  const float* q;        // (B, N, H) fp32, already times 1/sqrt(H)
  const float* k_new;    // (B, K, H) fp32 or null
  const float* v_new;
  const float* k_scale;  // (NB, K) or null
  const float* v_scale;
  const int64_t* table;  // (B, M)
  const int64_t* pos;    // (B,)
  float* out;            // (B, N, H) fp32
  int64_t B, N, K, G, H, bs, M, NB, window;
  float softcap;
};

// The running state of G query heads (max m, sum l, output acc (G, H)) and one tile's update from its
// scores sc (G, kTile), the first n valid, and value rows vrow (kTile; zeros past n).
struct Online {
  std::vector<float> m, l, acc;
  explicit Online(int64_t G, int64_t H) : m(G, kNegInf), l(G, 0.f), acc(G * H, 0.f) {}

  void update(const float* sc, int64_t n, const float* const* vrow, int64_t G, int64_t H) {
    alignas(64) float p[kTile];
    for (int64_t g = 0; g < G; ++g) {
      const float* s = sc + g * kTile;
      float mt = kNegInf;  // s[t] = -inf past n
#pragma omp simd reduction(max : mt)
      for (int t = 0; t < kTile; ++t) mt = std::max(mt, s[t]);
      if (mt == kNegInf) continue;  // nothing this tile adds (every score -inf)
      const float m_new = std::max(m[g], mt);
      const float alpha = m[g] == kNegInf ? 0.f : exp_nonpos(m[g] - m_new);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < kTile; ++t) {
        p[t] = exp_nonpos(s[t] - m_new);  // -inf (past n) -> 0
        sum += p[t];
      }
      l[g] = l[g] * alpha + sum;
      m[g] = m_new;
      pv_tile(acc.data() + g * H, alpha, p, vrow, H);
    }
  }
};

inline void cap(float* s, int64_t n, float c) {
  for (int64_t t = 0; t < n; ++t) s[t] = c * std::tanh(s[t] / c);
}

// Row t of the tile: a pointer into the pool (float32 without scales) or the row converted into buf.
template <typename T>
inline const float* row_of(const T* src, const float* scale, float* buf, int64_t H) {
  load_row(src, scale ? *scale : 1.f, H, buf);
  return buf;
}
template <>
inline const float* row_of<float>(const float* src, const float* scale, float* buf, int64_t H) {
  if (!scale) return src;
  load_row(src, *scale, H, buf);
  return buf;
}

// Row b, KV heads [kh0, kh1): slot by slot through the row's blocks, a tile of 16 slots at a time, every
// head of the range per tile (so the pool is read in the order it lies: a slot's heads are adjacent).
template <typename T>
void attend_row(const Args& a, const T* kp, const T* vp, int64_t b, int64_t kh0, int64_t kh1) {
  const int64_t G = a.G, H = a.H, K = a.K, bs = a.bs;
  const int64_t p = a.pos[b];
  const int64_t hi = a.k_new ? p : p + 1;  // pool slots [lo, hi) are visible
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
  const int64_t* row = a.table + b * a.M;
  std::vector<Online> st;
  for (int64_t kh = kh0; kh < kh1; ++kh) st.emplace_back(G, H);
  std::vector<float> kbuf(kTile * H), vbuf(kTile * H), zeros(H, 0.f), sc(G * kTile);
  const float* krow[kTile];
  const float* vrow[kTile];
  auto score = [&](int64_t kh, int64_t n) {  // head kh's G queries against the tile's rows, -inf past n
    const float* q = a.q + (b * a.N + kh * G) * H;  // (G, H): query heads kh*G .. kh*G + G - 1
    for (int64_t g = 0; g < G; ++g) {
      float* s = sc.data() + g * kTile;
      score_tile(q + g * H, krow, H, s);
      for (int64_t t = n; t < kTile; ++t) s[t] = kNegInf;
      if (a.softcap > 0.f) cap(s, n, a.softcap);
    }
    st[kh - kh0].update(sc.data(), n, vrow, G, H);
  };
  const int64_t span = (kh1 - kh0) * H * static_cast<int64_t>(sizeof(T));  // bytes of a slot's heads
  auto prefetch = [&](int64_t s) {  // slot s's K and V rows of heads [kh0, kh1): the pool is cold
    const int64_t blk = row[s / bs];
    if (blk < 0 || blk >= a.NB) return;  // reported when read
    const char* k = reinterpret_cast<const char*>(kp + ((blk * bs + s % bs) * K + kh0) * H);
    const char* v = reinterpret_cast<const char*>(vp + ((blk * bs + s % bs) * K + kh0) * H);
    for (int64_t off = 0; off < span; off += 64) {
      __builtin_prefetch(k + off, 0, 3);
      __builtin_prefetch(v + off, 0, 3);
    }
    asm volatile("");  // GCC 12 deleted these loops of prefetches as code without effect
  };
  for (int64_t s = lo; s < std::min(lo + kTile, hi); ++s) prefetch(s);
  for (int64_t t0 = lo; t0 < hi; t0 += kTile) {
    const int64_t n = std::min(kTile, hi - t0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t blk = row[(t0 + t) / bs];
      TORCH_CHECK(blk >= 0 && blk < a.NB, "paged_decode: block id ", blk, " (row ", b, ", table entry ",
                  (t0 + t) / bs, ") outside the pool's ", a.NB, " blocks");
      if (t0 + kTile + t < hi) prefetch(t0 + kTile + t);  // the next tile's rows arrive while this one is scored
    }
    for (int64_t kh = kh0; kh < kh1; ++kh) {
      for (int64_t t = 0; t < kTile; ++t) {
        if (t >= n) {
          krow[t] = vrow[t] = zeros.data();
          continue;
        }
        const int64_t s = t0 + t, blk = row[s / bs];
        const int64_t at = ((blk * bs + s % bs) * K + kh) * H;
        krow[t] = row_of<T>(kp + at, a.k_scale ? a.k_scale + blk * K + kh : nullptr, kbuf.data() + t * H, H);
        vrow[t] = row_of<T>(vp + at, a.v_scale ? a.v_scale + blk * K + kh : nullptr, vbuf.data() + t * H, H);
      }
      score(kh, n);
    }
  }
  for (int64_t kh = kh0; kh < kh1; ++kh) {
    if (a.k_new) {  // this step's token: one more visible column, at position p
      krow[0] = a.k_new + (b * K + kh) * H;
      vrow[0] = a.v_new + (b * K + kh) * H;
      for (int64_t t = 1; t < kTile; ++t) krow[t] = vrow[t] = zeros.data();
      score(kh, 1);
    }
    const Online& o_st = st[kh - kh0];
    float* o = a.out + (b * a.N + kh * G) * H;
    for (int64_t g = 0; g < G; ++g) {
      const float inv = 1.f / o_st.l[g];  // l = 0 (no visible key) gives NaN, as a softmax over none does
      for (int64_t h = 0; h < H; ++h) o[g * H + h] = o_st.acc[g * H + h] * inv;
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
      attend_row<T>(a, k, v, b, i % a.K, i % a.K + (last - i));
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
  const at::Tensor q = (q_in.to(at::kFloat) * (1.0 / std::sqrt(static_cast<double>(H)))).contiguous();
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
         B, N, K, N / K, H, bs, M, NB, window, static_cast<float>(softcap)};
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
