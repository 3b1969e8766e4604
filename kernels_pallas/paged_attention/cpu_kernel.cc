// Paged attention for the CPU backend, as an XLA FFI custom call (the CPU counterpart of the Pallas bodies).
//
// Same contract as reference.py: q [S, Q, H, D], one layer's K/V pools [KVH, NP, PS, D], block tables [S, W] int32,
// context lengths [S] int32 that include the Q new tokens; query i of sequence s sits at position
// ctx - Q + i and attends keys 0..that position; a query at a negative position (left padding) outputs zeros.
//
// Why a custom call: XLA:CPU lowers the reference's page gather to a scalar loop (~2 GB/s) and the per-sequence
// batched dots poorly; at batch 32 the reference attention cost more than half of a SmolLM2 decode step. This
// kernel reads each key row once per block of query rows, straight from its page (no gathered copy), and only the
// keys below the context length (a page slot past it is never read, so stale or NaN data cannot leak).
//
// Work split: one item = (sequence, KV head, block of up to kRowBlock query rows, rows ordered (query, group)).
// Items run on XLA's intra-op thread pool through nightjar::ParallelFor (../cpu_parallel.h).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

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

// exp(x) for x <= 0 (a score minus its row maximum), Cephes' expf polynomial (~1 ulp): branch-free so the softmax
// loop vectorizes (std::exp is a scalar libm call, which dominated decode at batch 32). x < -87 (incl. -inf) -> 0.
inline float ExpNonPositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : e * scale;
}

// A key/value row as float: float rows are used in place, bf16 rows are widened into buf.
inline const float* Row(const float* src, float*, int64_t) { return src; }
inline const float* Row(const uint16_t* src, float* buf, int64_t d) {
  for (int64_t j = 0; j < d; ++j) buf[j] = ToFloat(src[j]);
  return buf;
}

struct Dims {
  int64_t S, Q, H, D, KVH, NP, PS, W, G;
};

template <typename T>
void AttendBlock(const T* q, const T* k, const T* v, const int32_t* bt, const int32_t* cl, T* out, const Dims& n,
                 float scale, int64_t s, int64_t h, int64_t r0, int64_t r1, std::vector<float>& scratch,
                 std::atomic<bool>& bad_page) {
  const int64_t R = r1 - r0, D = n.D, G = n.G;
  const int64_t ctx = cl[s];
  // the last row of the block has the largest query position; keys past it are masked for every row
  const int64_t last_pos = ctx - n.Q + (r1 - 1) / G;
  const int64_t num_keys = std::max<int64_t>(0, std::min<int64_t>(ctx, last_pos + 1));
  scratch.resize(static_cast<size_t>(R * D * 2 + R * std::max<int64_t>(num_keys, 1) + 2 * D));
  float* qf = scratch.data();          // [R, D] scaled queries
  float* acc = qf + R * D;             // [R, D]
  float* sc = acc + R * D;             // [R, num_keys] scores, then probabilities
  float* rowbuf = sc + R * std::max<int64_t>(num_keys, 1);  // [2 * D] widened bf16 rows
  int64_t pos[kRowBlock];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r0 + r, i = row / G, g = row % G;
    pos[r] = ctx - n.Q + i;
    const T* src = q + ((s * n.Q + i) * n.H + h * G + g) * D;
    for (int64_t j = 0; j < D; ++j) qf[r * D + j] = ToFloat(src[j]) * scale;
    std::fill(acc + r * D, acc + (r + 1) * D, 0.0f);
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // pass 1: scores (each key row read once for the block)
  for (int64_t key = 0; key < num_keys; ++key) {
    const int32_t page = bt[s * n.W + key / n.PS];
    if (page < 0 || page >= n.NP) {
      bad_page.store(true, std::memory_order_relaxed);
      return;
    }
    const float* kr = Row(k + ((h * n.NP + page) * n.PS + key % n.PS) * D, rowbuf, D);
    for (int64_t r = 0; r < R; ++r) {
      float dot = 0.0f;
      const float* qr = qf + r * D;
      for (int64_t j = 0; j < D; ++j) dot += qr[j] * kr[j];
      sc[r * num_keys + key] = key <= pos[r] ? dot : neg_inf;
    }
  }
  // pass 2: softmax per row (a row with no visible key, i.e. left padding, keeps zeros)
  for (int64_t r = 0; r < R; ++r) {
    if (pos[r] < 0) continue;
    float* row = sc + r * num_keys;
    const int64_t visible = std::min<int64_t>(num_keys, pos[r] + 1);
    float m = neg_inf;
    for (int64_t key = 0; key < visible; ++key) m = std::max(m, row[key]);
    float total = 0.0f;
    for (int64_t key = 0; key < visible; ++key) {
      row[key] = ExpNonPositive(row[key] - m);
      total += row[key];
    }
    const float inv = 1.0f / total;
    for (int64_t key = 0; key < visible; ++key) row[key] *= inv;
  }
  // pass 3: weighted sum of value rows (each read once for the block)
  for (int64_t key = 0; key < num_keys; ++key) {
    const int32_t page = bt[s * n.W + key / n.PS];
    const float* vr = Row(v + ((h * n.NP + page) * n.PS + key % n.PS) * D, rowbuf + D, D);
    for (int64_t r = 0; r < R; ++r) {
      if (key > pos[r]) continue;
      const float p = sc[r * num_keys + key];
      float* a = acc + r * D;
      for (int64_t j = 0; j < D; ++j) a[j] += p * vr[j];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t row = r0 + r, i = row / G, g = row % G;
    T* dst = out + ((s * n.Q + i) * n.H + h * G + g) * D;
    for (int64_t j = 0; j < D; ++j) FromFloat(pos[r] >= 0 ? acc[r * D + j] : 0.0f, dst + j);
  }
}

template <ffi::DataType DT>
ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<DT> q, ffi::Buffer<DT> k_pages,
                              ffi::Buffer<DT> v_pages, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> context_lens, ffi::ResultBuffer<DT> out, float scale) {
  using T = ffi::NativeType<DT>;
  auto qd = q.dimensions();
  auto kd = k_pages.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || bd.size() != 2 || context_lens.dimensions().size() != 1) {
    return ffi::Error::InvalidArgument("paged attention: expected q [S,Q,H,D], pools [KVH,NP,PS,D], "
                                       "block tables [S,W], context lengths [S]");
  }
  Dims n{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], bd[1], 0};
  auto vd = v_pages.dimensions();
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
  const int64_t rows = n.Q * n.G;
  const int64_t blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t items = n.S * n.KVH * blocks;
  const T* qp = q.typed_data();
  const T* kp = k_pages.typed_data();
  const T* vp = v_pages.typed_data();
  const int32_t* btp = block_tables.typed_data();
  T* op = out->typed_data();

  std::atomic<bool> bad_page{false};
  std::atomic<bool>* bad = &bad_page;
  nightjar::ParallelFor(pool, items, [=, scratch = std::vector<float>()](int64_t it) mutable {
    const int64_t b = it % blocks, sh = it / blocks, h = sh % n.KVH, s = sh / n.KVH;
    AttendBlock<T>(qp, kp, vp, btp, cl, op, n, scale, s, h, b * kRowBlock, std::min(rows, (b + 1) * kRowBlock),
                   scratch, *bad);
  });
  if (bad_page.load()) {
    return ffi::Error::InvalidArgument("paged attention: a block-table entry is outside [0, num_pages)");
  }
  return ffi::Error::Success();
}

}  // namespace

#define NJ_BIND(DT)                                   \
  ffi::Ffi::Bind()                                    \
      .Ctx<ffi::ThreadPool>()                         \
      .Arg<ffi::Buffer<DT>>()                         \
      .Arg<ffi::Buffer<DT>>()                         \
      .Arg<ffi::Buffer<DT>>()                         \
      .Arg<ffi::Buffer<ffi::S32>>()                   \
      .Arg<ffi::Buffer<ffi::S32>>()                   \
      .Ret<ffi::Buffer<DT>>()                         \
      .Attr<float>("scale")

XLA_FFI_DEFINE_HANDLER_SYMBOL(NjPagedAttentionF32, PagedAttentionImpl<ffi::F32>, NJ_BIND(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjPagedAttentionBF16, PagedAttentionImpl<ffi::BF16>, NJ_BIND(ffi::BF16));
