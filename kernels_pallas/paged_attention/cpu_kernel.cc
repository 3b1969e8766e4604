// Paged attention for the CPU backend, as an XLA FFI custom call (the CPU counterpart of the Pallas bodies).
//
// Same contract as reference.py: q [S, Q, H, D], one layer's K/V pools [KVH, NP, PS, D], block tables [S, W] int32,
// context lengths [S] int32 that include the Q new tokens; query i of sequence s sits at position
// ctx - Q + i and attends keys 0..that position; a query at a negative position (left padding) outputs zeros.
// Tree mask [Q, M] uint8 (M = 0: none): over the last M key positions ctx - M .. ctx - 1, query i also needs
// mask[i, key - (ctx - M)] != 0 (a speculative token tree: its ancestors and itself).
//
// Why a custom call: XLA:CPU lowers the reference's page gather to a scalar loop (~2 GB/s) and the per-sequence
// batched dots poorly; at batch 32 the reference attention cost more than half of a SmolLM2 decode step. This
// kernel reads each key row once per block of query rows, straight from its page (no gathered copy), and only the
// keys below the context length (a page slot past it is never read, so stale or NaN data cannot leak).
//
// Work split: one item = (sequence, KV head, block of up to kRowBlock query rows, rows ordered (query, group), chunk
// of ~kChunkKeys keys); a block whose keys span several chunks merges its chunks' partial sums in a second phase.
// Both phases run on the spin team or XLA's intra-op pool through nightjar::ParallelPhases (../cpu_parallel.h).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "../cpu_math.h"
#include "../cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRowBlock = 16;

inline float ToFloat(float x) { return x; }
inline float ToFloat(uint16_t x) {  // bfloat16 bits
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline void FromFloat(float x, float* dst) { *dst = x; }
inline void FromFloat(float x, uint16_t* dst) {  // round to nearest even, NaN kept quiet
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *dst = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *dst = static_cast<uint16_t>(u >> 16);
}

// A page's first `count` floats: float pages in place, bf16 pages widened into buf.
inline const float* PageRows(const float* src, float*, int64_t) { return src; }
inline const float* PageRows(const uint16_t* src, float* buf, int64_t count) {
  for (int64_t j = 0; j < count; ++j) buf[j] = ToFloat(src[j]);
  return buf;
}

typedef float v8 __attribute__((vector_size(32)));                       // 8 floats in one AVX register
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));  // the same, at any float address
inline v8 Load8(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void Store8(float* p, v8 x) { *reinterpret_cast<v8u*>(p) = x; }
inline v8 Splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }

// Query rows per group in passes 1 and 3: with AVX-512's 32 vector registers three rows share every key and value
// load (Dot8Rows<3>: 24 accumulators), else one row at a time (16 registers).
#if defined(__AVX512F__)
constexpr int kRowGroup = 3;
#else
constexpr int kRowGroup = 1;
#endif

// Horizontal sums of eight 8-wide accumulators: out[u] = sum of a[u]'s lanes.
inline void Reduce8(const v8* a, float* out) {
#if defined(__AVX__)
  const __m256 b0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), b1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 b2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), b3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);  // [u0..u3 low, u0..u3 high], u4..u7
  const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
  _mm256_storeu_ps(out, sum);
#else
  for (int u = 0; u < 8; ++u) {
    float t = 0.0f;
    for (int l = 0; l < 8; ++l) t += a[u][l];
    out[u] = t;
  }
#endif
}

// out[g][u] = dot(q + g * D, kr + u * D) for RG query rows and 8 key rows (D % 8 == 0): eight independent
// accumulators per row (one per dot product would wait on the FMA latency), then one transposing reduction each;
// each key vector is loaded once for the RG rows (one row at a time loaded it RG times: the loads set the pace).
template <int RG>
inline void Dot8Rows(const float* q, const float* kr, int64_t D, float (*out)[8]) {
  v8 a[RG][8];
  for (int g = 0; g < RG; ++g) {
    for (int u = 0; u < 8; ++u) a[g][u] = Splat8(0.0f);
  }
  for (int64_t j = 0; j < D; j += 8) {
    v8 qv[RG];
    for (int g = 0; g < RG; ++g) qv[g] = Load8(q + g * D + j);
    for (int u = 0; u < 8; ++u) {
      const v8 kv = Load8(kr + u * D + j);
      for (int g = 0; g < RG; ++g) a[g][u] += qv[g] * kv;
    }
  }
  for (int g = 0; g < RG; ++g) Reduce8(a[g], out[g]);
}

// acc[g][0 .. 32) += sum over t < keys of p[g * ldp + t] * vr[t * D + 0 .. 32) for RG rows: each value vector is
// loaded once for the RG rows. A key a row does not see has p = 0 (pass 2 zeroes them).
template <int RG>
inline void AccumulateRows(const float* p, int64_t ldp, const float* vr, int64_t D, int64_t keys, float* acc) {
  v8 a[RG][4];
  for (int g = 0; g < RG; ++g) {
    for (int c = 0; c < 4; ++c) a[g][c] = Load8(acc + g * D + 8 * c);
  }
  for (int64_t t = 0; t < keys; ++t, vr += D) {
    const v8 v0 = Load8(vr), v1 = Load8(vr + 8), v2 = Load8(vr + 16), v3 = Load8(vr + 24);
    for (int g = 0; g < RG; ++g) {
      const v8 pg = Splat8(p[g * ldp + t]);
      a[g][0] += pg * v0;
      a[g][1] += pg * v1;
      a[g][2] += pg * v2;
      a[g][3] += pg * v3;
    }
  }
  for (int g = 0; g < RG; ++g) {
    for (int c = 0; c < 4; ++c) Store8(acc + g * D + 8 * c, a[g][c]);
  }
}

// The largest of row[0 .. n) (-inf when n = 0): 8 lanes at a time (std::max's NaN order keeps GCC from vectorizing
// the plain loop, which took ~7% of the attention kernel's samples at 1,000 tokens of context); max is exact in any
// order.
inline float RowMax(const float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t j = 0;
#if defined(__AVX__)
  if (n >= 8) {
    __m256 mv = _mm256_loadu_ps(row);
    for (j = 8; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + j));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mv);
    for (float x : lanes) m = std::max(m, x);
  }
#endif
  for (; j < n; ++j) m = std::max(m, row[j]);
  return m;
}

// Causal, and inside a tree's window only the keys its mask row allows.
inline bool Visible(int64_t key, int64_t pos, const uint8_t* tree_row, int64_t window0) {
  return key <= pos && (tree_row == nullptr || key < window0 || tree_row[key - window0] != 0);
}

struct Dims {
  int64_t S, Q, H, D, KVH, NP, PS, W, G, M;  // M: tree-mask window (0: none)
  int64_t NE;  // pages of the extension pool (elastic memory): page ids NP .. NP + NE - 1 address it
};

// Page `page` of KV head h: ids below NP in the base pool, the rest in the extension pool.
template <typename T>
inline const T* PageAt(const T* pool, const T* ext, const Dims& n, int64_t h, int64_t page) {
  return page < n.NP ? pool + (h * n.NP + page) * n.PS * n.D : ext + (h * n.NE + (page - n.NP)) * n.PS * n.D;
}

// Keys are split at fixed positions into chunks of whole pages (about kChunkKeys keys): one work item per (sequence,
// KV head, block of query rows, chunk), so a long context spreads over every thread even at batch 1 (with 3 KV heads
// on 2 threads one item per head left a thread idle a third of the time, and a 1,000-token context took 41% of a
// SmolLM2 batch-1 step). The chunks of a row are merged in chunk order (flash-decoding's rescaled sums). Positions,
// not the batch, set the chunks, so a row's result does not depend on the other rows of its call.
#ifndef NIGHTJAR_ATTN_CHUNK_KEYS
#define NIGHTJAR_ATTN_CHUNK_KEYS 256
#endif
constexpr int64_t kChunkKeys = NIGHTJAR_ATTN_CHUNK_KEYS;

inline int64_t ChunkKeys(int64_t page_size) { return std::max<int64_t>(1, kChunkKeys / page_size) * page_size; }

// What a chunk leaves for the merge, per query row: the row's largest score in the chunk (-inf: it sees no key
// there), the sum of exp(score - max) and the value rows weighted by those terms [D].
struct Partial {
  float* base;  // [rows][chunks][2 + D]
  int64_t chunks, D;
  float* at(int64_t row, int64_t c) const { return base + (row * chunks + c) * (2 + D); }
};

// Keys the rows r0 .. r1 of (s, h) see: the block's last row has the largest query position.
inline int64_t BlockKeys(const Dims& n, int64_t ctx, int64_t r1) {
  const int64_t last_pos = ctx - n.Q + (r1 - 1) / n.G;
  return std::max<int64_t>(0, std::min<int64_t>(ctx, last_pos + 1));
}

// Rows r0 .. r1 of (sequence s, KV head h) over the keys of chunk c. With `part` null (the block's keys fit one
// chunk) it writes the rows' outputs, acc / sum; else each row's partial (merged by MergeChunks).
template <typename TQ, typename T>  // TQ: q and out, T: the pools (float, or bfloat16 bits)
void AttendChunk(const TQ* q, const T* k, const T* v, const T* ke, const T* ve, const int32_t* bt, const int32_t* cl, const uint8_t* tm,
                 TQ* out, const Dims& n, float scale, int64_t s, int64_t h, int64_t r0, int64_t r1, int64_t c,
                 int64_t chunk_keys, const Partial* part, std::vector<float>& scratch, std::atomic<bool>& bad_page) {
  const int64_t R = r1 - r0, D = n.D, G = n.G;
  const int64_t ctx = cl[s];
  const int64_t num_keys = BlockKeys(n, ctx, r1);
  const int64_t key_lo = c * chunk_keys, key_hi = std::min(num_keys, key_lo + chunk_keys);
  const int64_t CK = std::max<int64_t>(key_hi - key_lo, 1);  // the chunk's keys (a row of scores)
  scratch.resize(static_cast<size_t>(R * D * 2 + R * CK + n.PS * D + 8 * D));
  float* qf = scratch.data();          // [R, D] scaled queries
  float* acc = qf + R * D;             // [R, D]
  float* sc = acc + R * D;             // [R, CK] scores, then exp(score - the row's max)
  float* pagebuf = sc + R * CK;        // [PS, D] a widened bf16 page
  float* tailbuf = pagebuf + n.PS * D;  // [8, D] a page's last keys (fewer than 8), zero-padded
  const bool vec = D % 8 == 0;         // the vector paths; any other head size takes the scalar loops
  int64_t pos[kRowBlock];
  const uint8_t* tree_row[kRowBlock];  // this row's tree-mask row (keys from window0 on), or null
  const int64_t window0 = ctx - n.M;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r0 + r, i = row / G, g = row % G;
    pos[r] = ctx - n.Q + i;
    tree_row[r] = n.M > 0 ? tm + i * n.M : nullptr;
    const TQ* src = q + ((s * n.Q + i) * n.H + h * G + g) * D;
    for (int64_t j = 0; j < D; ++j) qf[r * D + j] = ToFloat(src[j]) * scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // pass 1: scores (each key row read once for the block), page by page (chunks start on a page)
  for (int64_t key0 = key_lo, lp = key_lo / n.PS; key0 < key_hi; key0 += n.PS, ++lp) {
    const int32_t page = bt[s * n.W + lp];
    if (page < 0 || page >= n.NP + n.NE) {
      bad_page.store(true, std::memory_order_relaxed);
      return;
    }
    const T* base = PageAt(k, ke, n, h, page);
    const int64_t nk = std::min<int64_t>(n.PS, key_hi - key0);
    // Pages are scattered, so the hardware prefetcher restarts at each one: fetch the next key page, and this
    // page's values (read again in pass 3, from L2), while this page's scores are computed.
    const int64_t page_bytes = nk * D * static_cast<int64_t>(sizeof(T));
    const char* vpage = reinterpret_cast<const char*>(PageAt(v, ve, n, h, page));
    for (int64_t off = 0; off < page_bytes; off += 64) __builtin_prefetch(vpage + off, 0, 2);
    if (key0 + n.PS < key_hi) {
      const int32_t next = bt[s * n.W + lp + 1];
      if (next >= 0 && next < n.NP + n.NE) {
        const char* kn = reinterpret_cast<const char*>(PageAt(k, ke, n, h, next));
        for (int64_t off = 0; off < n.PS * D * static_cast<int64_t>(sizeof(T)); off += 64) {
          __builtin_prefetch(kn + off, 0, 2);
        }
      }
    }
    const float* kp = PageRows(base, pagebuf, nk * D);
    int64_t t = 0;
    if (vec) {
      // Every key's score comes from Dot8Rows, the last (fewer than 8) from a zero-padded copy: how many keys the
      // block reads (its widest row) must not decide a key's arithmetic, or a row's scores would depend on the
      // other query rows of its call (a verify step's rows differed from one-row decoding in their last bits, and
      // w4a8's int8 rounding of the next products turned those into different greedy tokens).
      for (; t < nk; t += 8) {
        const int64_t keys = std::min<int64_t>(8, nk - t);
        const float* k8 = kp + t * D;
        if (keys < 8) {
          std::copy(k8, k8 + keys * D, tailbuf);
          std::fill(tailbuf + keys * D, tailbuf + 8 * D, 0.0f);
          k8 = tailbuf;
        }
        for (int64_t g0 = 0; g0 < R; g0 += kRowGroup) {
          const int rg = static_cast<int>(std::min<int64_t>(kRowGroup, R - g0));
          float d8[kRowGroup][8];
          if (rg == 3) Dot8Rows<3>(qf + g0 * D, k8, D, d8);
          else if (rg == 2) Dot8Rows<2>(qf + g0 * D, k8, D, d8);
          else Dot8Rows<1>(qf + g0 * D, k8, D, d8);
          for (int g = 0; g < rg; ++g) {
            const int64_t r = g0 + g;
            for (int u = 0; u < keys; ++u) {
              const int64_t key = key0 + t + u;
              sc[r * CK + key - key_lo] = Visible(key, pos[r], tree_row[r], window0) ? d8[g][u] : neg_inf;
            }
          }
        }
      }
    }
    for (; t < nk; ++t) {
      const int64_t key = key0 + t;
      const float* kr = kp + t * D;
      for (int64_t r = 0; r < R; ++r) {
        float dot = 0.0f;
        const float* qr = qf + r * D;
        for (int64_t j = 0; j < D; ++j) dot += qr[j] * kr[j];
        sc[r * CK + key - key_lo] = Visible(key, pos[r], tree_row[r], window0) ? dot : neg_inf;
      }
    }
  }
  // pass 2: per row, exp(score - the row's max over the chunk) and their sum; a row that sees no key here (left
  // padding, a chunk past its position, or every key masked by its tree) keeps zeros and a max of -inf
  float row_max[kRowBlock], row_sum[kRowBlock];
  for (int64_t r = 0; r < R; ++r) {
    float* row = sc + r * CK;
    const int64_t visible = std::max<int64_t>(0, std::min<int64_t>(key_hi, pos[r] + 1) - key_lo);
    const float m = RowMax(row, visible);
    float total = 0.0f;
    if (m == neg_inf) {
      std::fill(row, row + CK, 0.0f);
    } else {
      for (int64_t j = 0; j < visible; ++j) {
        row[j] = nightjar::ExpNonPositive(row[j] - m);
        total += row[j];
      }
      std::fill(row + visible, row + CK, 0.0f);  // pass 3 runs a row group's widest
    }
    row_max[r] = m;
    row_sum[r] = total;
  }
  // pass 3: weighted sum of value rows (each read once for the block)
  for (int64_t key0 = key_lo, lp = key_lo / n.PS; key0 < key_hi; key0 += n.PS, ++lp) {
    const T* base = PageAt(v, ve, n, h, bt[s * n.W + lp]);
    const int64_t nk = std::min<int64_t>(n.PS, key_hi - key0);
    const float* vp = PageRows(base, pagebuf, nk * D);
    for (int64_t g0 = 0; g0 < R; g0 += kRowGroup) {
      const int rg = static_cast<int>(std::min<int64_t>(kRowGroup, R - g0));
      int64_t last = pos[g0];  // the group's widest row: keys past a row's own position have weight 0
      for (int g = 1; g < rg; ++g) last = std::max(last, pos[g0 + g]);
      const int64_t visible = std::min<int64_t>(nk, last - key0 + 1);  // this page's keys the group sees
      if (visible <= 0) continue;
      const float* pr = sc + g0 * CK + key0 - key_lo;
      int64_t j = 0;
      if (vec) {
        for (; j + 32 <= D; j += 32) {  // four independent accumulators per row over the page's keys
          if (rg == 3) AccumulateRows<3>(pr, CK, vp + j, D, visible, acc + g0 * D + j);
          else if (rg == 2) AccumulateRows<2>(pr, CK, vp + j, D, visible, acc + g0 * D + j);
          else AccumulateRows<1>(pr, CK, vp + j, D, visible, acc + g0 * D + j);
        }
      }
      for (int g = 0; g < rg; ++g) {
        float* a = acc + (g0 + g) * D;
        const float* pg = pr + g * CK;
        // Over this row's own keys, not the group's widest: -fassociative-math vectorizes this sum, and the split
        // of its terms into vector lanes and a remainder follows the loop's length, so running the group's length
        // gave a row other last bits with other rows beside it (a 5-row verify pass differed from one-row decoding
        // on AVX-512, where rows go three to a group; the zero weights past a row's position add nothing either way).
        const int64_t own = std::min<int64_t>(visible, pos[g0 + g] - key0 + 1);
        for (int64_t jj = j; jj < D; ++jj) {
          float x = a[jj];
          for (int64_t t = 0; t < own; ++t) x += pg[t] * vp[t * D + jj];
          a[jj] = x;
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    if (part != nullptr) {
      float* dst = part->at(row, c);
      dst[0] = row_max[r];
      dst[1] = row_sum[r];
      std::copy(acc + r * D, acc + (r + 1) * D, dst + 2);
      continue;
    }
    const int64_t i = row / G, g = row % G;
    TQ* dst = out + ((s * n.Q + i) * n.H + h * G + g) * D;
    const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;  // no key seen: zeros
    for (int64_t j = 0; j < D; ++j) FromFloat(acc[r * D + j] * inv, dst + j);
  }
}

// A row's output from its chunks' partials, in chunk order: sum_c acc_c w_c / sum_c l_c w_c with w_c =
// exp(max_c - max); w = 1 exactly for the chunk holding the max, so one chunk gives AttendChunk's acc / sum.
template <typename T>
void MergeChunks(const Partial& part, int64_t chunks, T* dst, int64_t row) {
  const int64_t D = part.D;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part.at(row, c)[0]);
  float num[512];  // D <= 512 (checked by the caller)
  std::fill(num, num + D, 0.0f);
  float den = 0.0f;
  if (m != -std::numeric_limits<float>::infinity()) {
    for (int64_t c = 0; c < chunks; ++c) {
      const float* p = part.at(row, c);
      if (p[1] == 0.0f) continue;  // no key of this chunk seen
      const float w = p[0] == m ? 1.0f : nightjar::ExpNonPositive(p[0] - m);
      den += p[1] * w;
      for (int64_t j = 0; j < D; ++j) num[j] += p[2 + j] * w;
    }
  }
  const float inv = den > 0.0f ? 1.0f / den : 0.0f;
  for (int64_t j = 0; j < D; ++j) FromFloat(num[j] * inv, dst + j);
}

// DQ: q and the output; DK: the K/V pools (float32 q over bfloat16 pools: kv_cache_dtype="bfloat16" under a
// float32 model, q kept at full precision)
template <ffi::DataType DQ, ffi::DataType DK>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<DQ> q, ffi::Buffer<DK> k_pages,
                              ffi::Buffer<DK> v_pages, ffi::Buffer<DK> k_ext, ffi::Buffer<DK> v_ext,
                              ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> context_lens, ffi::Buffer<ffi::U8> tree_mask,
                              ffi::ResultBuffer<DQ> out, float scale, int64_t layer) {
  using TQ = ffi::NativeType<DQ>;
  using T = ffi::NativeType<DK>;
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto vd = v_pages.dimensions();
  auto bd = block_tables.dimensions();
  const T* kp = k_pages.typed_data();
  const T* vp = v_pages.typed_data();
  // the extension pool: the base pools' layout with its own page count (NE = 0: none)
  auto ed = k_ext.dimensions();
  if (ed.size() != kd.size() || v_ext.dimensions().size() != kd.size()) {
    return ffi::Error::InvalidArgument("paged attention: the extension pools must have the base pools' rank");
  }
  const int64_t NE = ed[ed.size() - 3];
  for (size_t i = 0; i < kd.size(); ++i) {
    if ((i != kd.size() - 3 && ed[i] != kd[i]) || v_ext.dimensions()[i] != ed[i]) {
      return ffi::Error::InvalidArgument("paged attention: the extension pools must match the base pools in every "
                                         "dimension but the pages");
    }
  }
  const T* kep = k_ext.typed_data();
  const T* vep = v_ext.typed_data();
  if (layer >= 0) {  // one layer of pools stacked over the layers [L, KVH, NP, PS, D] (the engine's stacked cache)
    if (kd.size() != 5 || vd.size() != 5 || vd[0] != kd[0] || layer >= kd[0]) {
      return ffi::Error::InvalidArgument("paged attention: layer " + std::to_string(layer) +
                                         " needs pools stacked over the layers [L, KVH, NP, PS, D] with layer < L");
    }
    kd = kd.last(4);
    vd = vd.last(4);
    const int64_t per_layer = kd[0] * kd[1] * kd[2] * kd[3];
    kp += layer * per_layer;
    vp += layer * per_layer;
    if (NE > 0) {
      kep += layer * kd[0] * NE * kd[2] * kd[3];
      vep += layer * kd[0] * NE * kd[2] * kd[3];
    }
  } else if (layer != -1) {
    return ffi::Error::InvalidArgument("paged attention: layer must be -1 (one layer's pools) or >= 0");
  }
  if (qd.size() != 4 || kd.size() != 4 || bd.size() != 2 || context_lens.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("paged attention: expected q [S,Q,H,D], pools [KVH,NP,PS,D], "
                                       "block tables [S,W], context lengths [S]");
  }
  Dims n{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], bd[1], 0, 0, NE};
  auto td = tree_mask.dimensions();
  if (td.size() != 2 || (td[1] != 0 && (td[0] != n.Q || td[1] < n.Q))) {
    return ffi::Error::InvalidArgument("paged attention: tree mask must be [Q, M >= Q] (M = 0: none)");
  }
  n.M = td[1];
  if (vd.size() != 4 || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || vd[3] != kd[3]) {
    return ffi::Error::InvalidArgument("paged attention: v_pages must have k_pages' shape [KVH,NP,PS,D]");
  }
  if (kd[3] != n.D || n.KVH == 0 || n.H % n.KVH != 0 || bd[0] != n.S || context_lens.dimensions()[0] != n.S) {
    return ffi::Error::InvalidArgument("paged attention: inconsistent shapes");
  }
  n.G = n.H / n.KVH;
  const int32_t* cl = context_lens.typed_data();
  for (int64_t s = 0; s < n.S; ++s) {
    if (cl[s] < 0 || cl[s] > n.W * n.PS) {
      return ffi::Error::InvalidArgument("paged attention: context length " + std::to_string(cl[s]) +
                                         " outside [0, block-table width * page size = " +
                                         std::to_string(n.W * n.PS) + "]");
    }
  }
  if (n.D > 512) {
    return ffi::Error::InvalidArgument("paged attention: head_dim " + std::to_string(n.D) + " above 512");
  }
  const int64_t rows = n.Q * n.G;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t chunk_keys = ChunkKeys(n.PS);
  // chunks of the call's longest row block; a block with fewer runs only its own (the rest are empty items)
  int64_t chunks = 1;
  for (int64_t s = 0; s < n.S; ++s) {
    chunks = std::max(chunks, (BlockKeys(n, cl[s], rows) + chunk_keys - 1) / chunk_keys);
  }
  const TQ* qp = q.typed_data();
  const int32_t* btp = block_tables.typed_data();
  const uint8_t* tmp = tree_mask.typed_data();
  TQ* op = out->typed_data();
  auto block_chunks = [&, cl](int64_t s, int64_t b) {
    return (BlockKeys(n, cl[s], std::min(rows, (b + 1) * kRowBlock)) + chunk_keys - 1) / chunk_keys;
  };
  // partials of the blocks with more than one chunk: [S][KVH][rows][chunks][2 + D] (thread_local: the calls of a
  // step reuse it, and concurrent calls on other threads have their own)
  thread_local std::vector<float> partials;
  const bool merge = chunks > 1;
  if (merge) partials.resize(static_cast<size_t>(n.S * n.KVH * rows * chunks * (2 + n.D)));
  float* pbase = partials.data();
  auto part_of = [=](int64_t s, int64_t h) {
    return Partial{pbase + (s * n.KVH + h) * rows * chunks * (2 + n.D), chunks, n.D};
  };
  std::atomic<bool> bad_page{false};
  std::atomic<bool>* bad = &bad_page;
  // the items: every (sequence, KV head, row block) with each of its own chunks (a block with no key still runs
  // one, which writes its zeros), chunk innermost so a row block's chunks go to different threads
  struct Item {
    int32_t s, h, b, c;
  };
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(n.S * n.KVH * blocks));
  for (int64_t s = 0; s < n.S; ++s) {
    for (int64_t h = 0; h < n.KVH; ++h) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t own = std::max<int64_t>(1, block_chunks(s, b));
        for (int64_t c = 0; c < own; ++c) {
          items.push_back(Item{static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(b),
                               static_cast<int32_t>(c)});
        }
      }
    }
  }
  std::vector<nightjar::Phase> phases = {
      {static_cast<int64_t>(items.size()), [&, bad](int64_t it) {
         thread_local std::vector<float> scratch;
         const Item& e = items[it];
         const bool split = block_chunks(e.s, e.b) > 1;
         const Partial part = part_of(e.s, e.h);
         AttendChunk<TQ, T>(qp, kp, vp, kep, vep, btp, cl, tmp, op, n, scale, e.s, e.h, e.b * kRowBlock,
                        std::min(rows, (e.b + 1) * kRowBlock), e.c, chunk_keys, split ? &part : nullptr, scratch,
                        *bad);
       }},
  };
  if (merge) {
    phases.push_back({n.S * n.KVH * blocks, [&](int64_t it) {
                        const int64_t b = it % blocks, sh = it / blocks, h = sh % n.KVH, s = sh / n.KVH;
                        const int64_t own = block_chunks(s, b);
                        if (own <= 1 || bad_page.load(std::memory_order_relaxed)) return;
                        const Partial part = part_of(s, h);
                        for (int64_t row = b * kRowBlock; row < std::min(rows, (b + 1) * kRowBlock); ++row) {
                          const int64_t i = row / n.G, g = row % n.G;
                          MergeChunks<TQ>(part, own, op + ((s * n.Q + i) * n.H + h * n.G + g) * n.D, row);
                        }
                      }});
  }
  nightjar::ParallelPhases(pool, phases);
  if (bad_page.load()) {
    return ffi::Error::InvalidArgument("paged attention: a block-table entry is outside [0, num_pages + extension pages)");
  }
  return ffi::Error::Success();
}

}  // namespace

#define NJ_BIND(DQ, DK)                               \
  ffi::Ffi::Bind()                                    \
      .Ctx<ffi::ThreadPool>()                         \
      .Arg<ffi::Buffer<DQ>>()                         \
      .Arg<ffi::Buffer<DK>>()                         \
      .Arg<ffi::Buffer<DK>>()                         \
      .Arg<ffi::Buffer<DK>>()                         \
      .Arg<ffi::Buffer<DK>>()                         \
      .Arg<ffi::Buffer<ffi::S32>>()                   \
      .Arg<ffi::Buffer<ffi::S32>>()                   \
      .Arg<ffi::Buffer<ffi::U8>>()                    \
      .Ret<ffi::Buffer<DQ>>()                         \
      .Attr<float>("scale")                           \
      .Attr<int64_t>("layer")

XLA_FFI_DEFINE_HANDLER_SYMBOL(NjPagedAttentionF32, (PagedAttentionImpl<ffi::F32, ffi::F32>), NJ_BIND(ffi::F32, ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjPagedAttentionBF16, (PagedAttentionImpl<ffi::BF16, ffi::BF16>),
                              NJ_BIND(ffi::BF16, ffi::BF16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjPagedAttentionF32Bf16Kv, (PagedAttentionImpl<ffi::F32, ffi::BF16>),
                              NJ_BIND(ffi::F32, ffi::BF16));
// pools of bfloat16 bit patterns as uint16 (the engine's bfloat16 pools on CPU, whose scatters XLA:CPU would
// otherwise run by copying the pool): the same code as bfloat16 pools
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjPagedAttentionF32Bf16BitsKv, (PagedAttentionImpl<ffi::F32, ffi::U16>),
                              NJ_BIND(ffi::F32, ffi::U16));
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjPagedAttentionBf16Bf16BitsKv, (PagedAttentionImpl<ffi::BF16, ffi::U16>),
                              NJ_BIND(ffi::BF16, ffi::U16));
