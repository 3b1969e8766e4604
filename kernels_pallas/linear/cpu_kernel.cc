// Skinny matrix products y = x @ W for the CPU backend, as XLA FFI custom calls: the decode-time linear layers.
//
// Why: at decode a linear layer multiplies a few rows (batch size x (γ + 1) query slots) by a large weight, so it
// is bound by reading the weight from memory. XLA:CPU's dot is fine for large M but poor for small M: on the
// project's 2-core machine SmolLM2-135M's 30 layers took ~21 ms at M = 1 (~20 GB/s of weights) and ~42 ms at
// M = 4 — twice M = 1, though both read the same bytes. These kernels read each weight element once per tile of
// rows and keep the tile's partial sums in registers.
//
//   nightjar_linear_f32     x [M, K] f32, W [K, N] f32 -> y [M, N] f32   (nnx.Linear's kernel layout)
//   nightjar_linear2_f32,   x and 2 or 3 weights [K, N_i] -> one y per weight (q/k/v, gate/up in one call)
//   nightjar_linear3_f32
//   nightjar_linear_nt_f32  x [M, K] f32, W [N, K] f32 -> y [M, N] f32   (a tied LM head: the embedding table)
//
// Fused forms for a decoder layer, so a decode step runs fewer thunks (XLA:CPU splits an RMSNorm into four small
// fusions; fusing took a one-row SmolLM2 step from 580 thunks to 257 and ~0.7 to ~0.3 ms outside the products):
//   nightjar_rms_linear2_f32,  x [M, K], gain [K], 2 or 3 weights [K, N_i] (attr eps) -> y_i = RMSNorm(x) @ W_i
//   nightjar_rms_linear3_f32     (the pre-attention norm + q/k/v)
//   nightjar_rms_swiglu_f32    x [M, K], gain [K], W_gate, W_up [K, N] (attr eps)
//                              -> h [M, N] = silu(RMSNorm(x) @ W_gate) * (RMSNorm(x) @ W_up)
//   nightjar_linear_residual_f32  x [M, K], W [K, N], r [M, N] -> y = r + x @ W   (o_proj, down_proj)
// RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * gain, in float32 (the model's RMSNorm).
//
// Every NN form also takes W packed as 16-column panels [N / 16, K, 16] (cpu.py pack; the engine packs a model's
// linear weights at load where this kernel runs them, with AVX-512): a work item is a group of whole panels, each
// one contiguous run of memory read front to back with the item's outputs in registers for all K (PackedProduct:
// one row, four panels at once; up to 8 rows, an R x 48 tile; more, 8-row groups over blocks of weight rows with the
// next block prefetched). No partial sums: the same result whichever thread takes an item, and items small enough
// that the threads finish together. SmolLM2-135M's whole decode step against the [K, N] paths below, the two in one
// process (AMD EPYC, 2026-12-03): 0.87 of the time at batch 1, 0.92 at 2, 0.93-0.96 at 4 and 8, 0.96-0.97 at 16
// and 32, 0.98-1.01 at 64; README.md.
//
// Work split for [K, N] weights, taken from XLA's intra-op pool by nightjar::ParallelFor (../cpu_parallel.h):
// - NN, up to kSplitKMaxRows rows (RunSplitK): one item = a contiguous run of a weight's rows, all N columns;
//   the weight streams front to back, 16 weight rows per pass for one x row, else kKUnroll rows with x rows in
//   pairs (RowsNN); partial sums per item added by the caller.
// - NN, more rows: one item = a block of output columns. With AVX-512 (`auto` up to 160 rows): 8 x 48 register
//   tiles straight from W's rows in blocks of kTileKBlock rows (Tile48, Block48), the columns past the last whole
//   48 as below. Without (only with linear_impl="cpu"): a kKBlock-row block of W is packed into 16-column panels
//   reused from L2 by every 6 x 16 register tile of x (PanelNN), and the next block is prefetched meanwhile.
// - NT (tied head): one item = a block of weight rows (contiguous); one x row: each weight row against x with
//   4 independent accumulators, a row of each of the item's halves in turn (RowNT2) without the CPU kernels' vectors;
//   with them, 1 to kNtFewRows (8) rows: a weight vector against every x row, two weight rows at once (BlockNTFew,
//   one order of sums at every row count); past that, from
//   kNtTileMinRows rows with AVX-512 (`auto` up to 32 rows, 160 on AMD EPYC): y^T = W @ x^T in 12 x 32 tiles
//   (BlockNTx); otherwise 4 weight rows x up to 3 x-rows of partial sums per tile (TileNT), weight rows blocked by
//   kNtRows so every x tile reuses them from L2.
//
// Two compact layouts hold weights that a GGUF checkpoint stored quantized, losslessly (cpu.py pack_q4 / pack_q8
// keep them only if every float32 element comes back bit for bit; the kernels rebuild each element exactly and sum
// in the float32 layouts' order, so the results are the same to the bit):
//   uint8 [N / 16, K / 32, 384]  4-bit block panels of W [K, N] (Q4_1: d * q + m), every NN form (PackedProductCompact)
//   uint8 [N / 16, K / 32, 2432] the same followed by W's float32 panels, which more than 8 rows read instead
//   uint8 [N, K / 32, 36]        8-bit block rows of a tied head's W [N, K] (Q8_0: d * q), nightjar_linear_nt_f32
//   uint8 [N, K / 32, 164]       the same followed by the float32 W [N, K], which more than 8 rows read instead
//   bfloat16 [N / 16, K, 16]     bfloat16 panels of W [K, N] (a bfloat16 checkpoint upcast), every NN form
//   bfloat16 [N / 16, K, 48]     the same followed by W's float32 panels, which more than 8 rows read instead
// and one lossy layout, opt-in (weight_format="w4a8", cpu.py pack_w4a8; with AVX512-VNNI):
//   int8 [N / 16, K / 32, 320]   the Q4_1 blocks for int8 activations: x quantized per row and 32-element block,
//                                multiplied by vpdpbusd at every row count (PackedProductInt8)
//   uint8 [N, K / 32, 72]        a tied head's 8-bit rows, then panels of them for int8 activations, which its
//                                products read at every row count (PackedProductInt8); the embedding the rows

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "../cpu_math.h"
#include "../cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

typedef float v8 __attribute__((vector_size(32)));                       // 8 floats in one AVX register
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));  // the same, at any float address

inline v8 Load(const float* p) { return *reinterpret_cast<const v8u*>(p); }
inline void Store(float* p, v8 v) { *reinterpret_cast<v8u*>(p) = v; }
inline v8 Splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

constexpr int64_t kKUnroll = 4;   // weight rows consumed per pass over a column block
constexpr int64_t kKBlock = 64;   // weight rows per L2 block (reused by every row tile of x)
constexpr int64_t kPrefetchRows = 8;

#ifdef __AVX512F__
// 16-float (AVX-512) vectors where the CPU has them: half the load and FMA instructions per weight byte of the
// 8-float ones (SmolLM2-135M's products standalone on a 2-vCPU Xeon: 18.6 ms against 19.2 at one row, a plain read
// 17.9; at 5 rows, where the products are near the cores' FMA rate, see README.md).
#define NIGHTJAR_V16 1
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
inline v16 Load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void Store16(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }
inline v16 Splat16(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
// A value of its own: -fassociative-math must not refold the arithmetic around it (the compact layouts' exact sums).
inline void Opaque(v16& v) { asm("" : "+v"(v)); }
inline void Opaque(v16& a, v16& b) { asm("" : "+v"(a), "+v"(b)); }
#elif defined(__AVX2__) && defined(__FMA__)
// Without AVX-512 (AMD Zen 3, Intel before Skylake-SP) the panel layouts' kernels take 16 floats as a pair of AVX
// registers, so one source serves both: the same sums lane by lane in the same order (each lane's FMA chain is the
// same; only the register width differs). A GCC vector of 64 bytes would do, but GCC 12 keeps it on the stack
// without AVX-512 (a load and a store around every FMA); a struct of two 8-float vectors stays in registers.
#define NIGHTJAR_V16 1
struct v16 {
  v8 lo, hi;
  float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};
inline v16 operator+(v16 a, v16 b) { return v16{a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator*(v16 a, v16 b) { return v16{a.lo * b.lo, a.hi * b.hi}; }
inline v16& operator+=(v16& a, v16 b) {
  a.lo += b.lo;
  a.hi += b.hi;
  return a;
}
inline v16 Load16(const float* p) { return v16{Load(p), Load(p + 8)}; }
inline void Store16(float* p, v16 v) {
  Store(p, v.lo);
  Store(p + 8, v.hi);
}
inline v16 Splat16(float x) { return v16{Splat(x), Splat(x)}; }
inline void Opaque(v16& v) { asm("" : "+x"(v.lo), "+x"(v.hi)); }
inline void Opaque(v16& a, v16& b) { asm("" : "+x"(a.lo), "+x"(a.hi), "+x"(b.lo), "+x"(b.hi)); }
#endif

// y[r, c_begin:c_end] += sum_{u < U} x[r, k + u] * W[k + u, c_begin:c_end] for the R rows starting at r0:
// U weight rows streamed left to right (U sequential streams), partial sums of y in L1; 16 columns at a time where
// the CPU has AVX-512, then 8, then one.
template <int R, int U>
inline void RowsNN(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t r0, int64_t k,
                   int64_t c_begin, int64_t c_end, bool prefetch = false) {
  const float* wk = w + k * N;
  int64_t c = c_begin;
#ifdef __AVX512F__
  {
    v16 xb[R][U];
    for (int r = 0; r < R; ++r) for (int u = 0; u < U; ++u) xb[r][u] = Splat16(x[(r0 + r) * K + k + u]);
    for (; c + 16 <= c_end; c += 16) {
      if (prefetch) {
        for (int u = 0; u < U; ++u) __builtin_prefetch(wk + (kPrefetchRows + u) * N + c, 0, 2);
      }
      v16 wv[U];
      for (int u = 0; u < U; ++u) wv[u] = Load16(wk + u * N + c);
      for (int r = 0; r < R; ++r) {
        v16 a = Load16(y + (r0 + r) * N + c);
        for (int u = 0; u < U; ++u) a += xb[r][u] * wv[u];
        Store16(y + (r0 + r) * N + c, a);
      }
    }
  }
#endif
  v8 xb[R][U];
  for (int r = 0; r < R; ++r) for (int u = 0; u < U; ++u) xb[r][u] = Splat(x[(r0 + r) * K + k + u]);
  for (; c + 8 <= c_end; c += 8) {
    if (prefetch && (c - c_begin) % 16 == 0) {
      for (int u = 0; u < U; ++u) __builtin_prefetch(wk + (kPrefetchRows + u) * N + c, 0, 2);
    }
    v8 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = Load(wk + u * N + c);
    for (int r = 0; r < R; ++r) {
      v8 a = Load(y + (r0 + r) * N + c);
      for (int u = 0; u < U; ++u) a += xb[r][u] * wv[u];
      Store(y + (r0 + r) * N + c, a);
    }
  }
  for (; c < c_end; ++c) {
    for (int r = 0; r < R; ++r) {
      float a = y[(r0 + r) * N + c];
      for (int u = 0; u < U; ++u) a += x[(r0 + r) * K + k + u] * wk[u * N + c];
      y[(r0 + r) * N + c] = a;
    }
  }
}

// More than kSplitKMaxRows rows: pack a kKBlock x width block of W into 16-column panels
// ([width / 16][kKBlock][16], zero-padded), then
// an R x 16 register tile (R <= 6: 12 accumulators) walks each panel contiguously; every row tile reuses the block
// from L2, so the product is bound by FMAs, not by memory.
constexpr int64_t kPanel = 16;

void PackBlock(const float* w, int64_t N, int64_t k0, int64_t k1, int64_t c_begin, int64_t c_end, float* panel) {
  const int64_t kc = k1 - k0;
  for (int64_t c0 = c_begin; c0 < c_end; c0 += kPanel) {
    float* dst = panel + (c0 - c_begin) * kc;
    const int64_t cols = std::min(kPanel, c_end - c0);
    for (int64_t k = k0; k < k1; ++k, dst += kPanel) {
      const float* src = w + k * N + c0;
      if (cols == kPanel) {
        Store(dst, Load(src));
        Store(dst + 8, Load(src + 8));
      } else {
        for (int64_t j = 0; j < kPanel; ++j) dst[j] = j < cols ? src[j] : 0.0f;
      }
    }
  }
}

template <int R>
inline void PanelNN(const float* x, const float* panel, float* y, int64_t K, int64_t N, int64_t r0, int64_t k0,
                    int64_t kc, int64_t c0, int64_t cols) {
  v8 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Splat(0.0f);
  const float* xr = x + r0 * K + k0;
  for (int64_t k = 0; k < kc; ++k, panel += kPanel) {
    const v8 w0 = Load(panel), w1 = Load(panel + 8);
    for (int r = 0; r < R; ++r) {
      const v8 xv = Splat(xr[r * K + k]);
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = y + (r0 + r) * N + c0;
    if (cols == kPanel) {
      Store(yr, Load(yr) + acc[r][0]);
      Store(yr + 8, Load(yr + 8) + acc[r][1]);
    } else {
      for (int64_t j = 0; j < cols; ++j) yr[j] += acc[r][j / 8][j % 8];
    }
  }
}

// `next`: W's next k-block (rows k0 + kc ..), prefetched into L2 one panel's columns at a time while this block
// computes, so the next PackBlock reads from cache (nullptr: none, or already done by an earlier row tile).
template <int R>
void PanelsNN(const float* x, const float* panel, float* y, int64_t K, int64_t N, int64_t r0, int64_t k0,
              int64_t kc, int64_t c_begin, int64_t c_end, const float* next, int64_t next_rows) {
  for (int64_t c0 = c_begin; c0 < c_end; c0 += kPanel) {
    if (next != nullptr) {
      for (int64_t k = 0; k < next_rows; ++k) __builtin_prefetch(next + k * N + c0, 0, 2);
    }
    PanelNN<R>(x, panel + (c0 - c_begin) * kc, y, K, N, r0, k0, kc, c0, std::min(kPanel, c_end - c0));
  }
}

void BlockNN(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t c_begin,
             int64_t c_end) {
  for (int64_t r = 0; r < M; ++r) std::fill(y + r * N + c_begin, y + r * N + c_end, 0.0f);
  {
    thread_local std::vector<float> panel;
    const int64_t padded = (c_end - c_begin + kPanel - 1) / kPanel * kPanel;
    panel.resize(padded * kKBlock);
    for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
      const int64_t k1 = std::min(K, k0 + kKBlock);
      PackBlock(w, N, k0, k1, c_begin, c_end, panel.data());
      const float* next = k1 < K ? w + k1 * N : nullptr;
      const int64_t next_rows = std::min(K, k1 + kKBlock) - k1;
      const float* p = panel.data();
      const int64_t kc = k1 - k0;
      int64_t r0 = 0;
      for (; r0 + 6 <= M; r0 += 6, next = nullptr) PanelsNN<6>(x, p, y, K, N, r0, k0, kc, c_begin, c_end, next, next_rows);
      switch (M - r0) {
        case 5: PanelsNN<5>(x, p, y, K, N, r0, k0, kc, c_begin, c_end, next, next_rows); break;
        case 4: PanelsNN<4>(x, p, y, K, N, r0, k0, kc, c_begin, c_end, next, next_rows); break;
        case 3: PanelsNN<3>(x, p, y, K, N, r0, k0, kc, c_begin, c_end, next, next_rows); break;
        case 2: PanelsNN<2>(x, p, y, K, N, r0, k0, kc, c_begin, c_end, next, next_rows); break;
        case 1: PanelsNN<1>(x, p, y, K, N, r0, k0, kc, c_begin, c_end, next, next_rows); break;
        default: break;
      }
    }
  }
}

// W rows per block of the register tiles (Block48's, and the packed weights' past kPanelRowGroup rows): a 48-column
// panel's block (18 KB) stays in L1 for every row tile of x after the first
constexpr int64_t kTileKBlock = 96;
// Past two row tiles (M > 16) the block is NIGHTJAR_TILE_K_BLOCK_WIDE rows (cpu.py's TILE_K_BLOCK_WIDE): 96 too, or
// 288 on AMD EPYC (Zen 4), where products alone measured 0.956 / 0.943 / 0.955 / 0.964 of the time at 24 / 32 / 48 /
// 64 rows with 288-row blocks (a block then comes from L2 for the row tiles after the first, and W's stream restarts
// a third as often), but 1.01-1.03 at 12-16 rows (the two in turn in one process, 2026-12-03); whole decode steps at
// batch 24 / 32 / 64 0.95 / 0.97 / 0.95 of the time.
#ifndef NIGHTJAR_TILE_K_BLOCK_WIDE
#define NIGHTJAR_TILE_K_BLOCK_WIDE 96
#endif
constexpr int64_t kTileKBlockWide = NIGHTJAR_TILE_K_BLOCK_WIDE;

#ifdef __AVX512F__
// More than kSplitKMaxRows rows with AVX-512: y[r0 .. r0 + R, c0 .. c0 + 48] (+)= x[r0 .. r0 + R, k0 .. k1] @
// W[k0 .. k1, c0 .. c0 + 48], an R x 48 register tile (R <= 8: 24 accumulators, 3 weight vectors and a broadcast of
// the 32 registers) straight from W's rows: per weight row 3 loads and R broadcasts feed 3R FMAs, so the FMA units,
// not the loads, set the pace. `first`: y starts at zero (else the tile adds to y: the k-blocks after the first).
// `prefetch` (the first row tile of a block, which brings W in from memory): W's rows are a full row apart, which
// the hardware does not stream, so the tile fetches kTilePrefetchRows rows ahead into L2.
constexpr int64_t kTilePrefetchRows = 16;

template <int R>
inline void Tile48(const float* x, const float* w, float* y, int64_t ldy, int64_t K, int64_t N, int64_t r0, int64_t c0,
                   int64_t k0, int64_t k1, bool first, bool prefetch, const float* next = nullptr, int64_t next_from = 0,
                   int64_t next_lines = 0) {
  v16 acc[R][3];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 3; ++j) acc[r][j] = first ? Splat16(0.0f) : Load16(y + (r0 + r) * ldy + 16 * j);
  }
  const float* xr = x + r0 * K;
  const float* wk = w + k0 * N + c0;
  int64_t line = next_from;
  const int64_t line_end = next_from + next_lines;
  // lines to prefetch per weight row: one when three or more row tiles share a block's lines, more with fewer (at 9-16
  // rows the one tile after the first fetches all 3 lines per row of the next block; with one per row it fetched a
  // third of them, and the tiles lost to split-K there)
  const int64_t per_row = k1 > k0 ? (next_lines + (k1 - k0) - 1) / (k1 - k0) : 0;
  for (int64_t k = k0; k < k1; ++k, wk += N) {
    if (prefetch) {
      __builtin_prefetch(wk + kTilePrefetchRows * N, 0, 2);
      __builtin_prefetch(wk + kTilePrefetchRows * N + 16, 0, 2);
      __builtin_prefetch(wk + kTilePrefetchRows * N + 32, 0, 2);
    }
    for (int64_t p = 0; p < per_row && line < line_end; ++p, ++line) {  // the next panel's block, spread over W's rows
      __builtin_prefetch(next + (line / 3) * N + (line % 3) * 16, 0, 2);
    }
    const v16 w0 = Load16(wk), w1 = Load16(wk + 16), w2 = Load16(wk + 32);
    for (int r = 0; r < R; ++r) {
      const v16 xb = Splat16(xr[r * K + k]);
      acc[r][0] += xb * w0;
      acc[r][1] += xb * w1;
      acc[r][2] += xb * w2;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 3; ++j) Store16(y + (r0 + r) * ldy + 16 * j, acc[r][j]);
  }
}


// Columns c_begin .. c_end (whole 48-column panels) of y = x @ W for any M, by blocks of kTileKBlock rows of W: each
// panel's block is read from memory once (by the first row tile) and from L1 by the others. y's element (r, c) is
// at y[r * ldy + c - y_col0] (y itself: ldy = N, y_col0 = 0; a buffer of the item's columns: ldy = its width).
void Block48(const float* x, const float* w, float* y, int64_t ldy, int64_t y_col0, int64_t M, int64_t K, int64_t N,
             int64_t c_begin, int64_t c_end) {
  const int64_t kb = M > 16 ? kTileKBlockWide : kTileKBlock;
  for (int64_t k0 = 0; k0 < K || k0 == 0; k0 += kb) {
    const int64_t k1 = std::min(K, k0 + kb);
    const bool first = k0 == 0;
    const int64_t tiles = (M + 7) / 8;
    for (int64_t c0 = c_begin; c0 < c_end; c0 += 48) {
      float* yc = y + c0 - y_col0;
      // the row tiles after the first bring the next panel's block (same rows; past the item's last panel, the
      // next block's first panel) into L2, a line per weight row, so its first tile does not wait on memory
      const bool last = c0 + 48 >= c_end;
      const int64_t nk0 = last ? k1 : k0, nk1 = last ? std::min(K, k1 + kb) : k1;
      const float* next = w + nk0 * N + (last ? c_begin : c0 + 48);
      const int64_t next_lines = 3 * (nk1 - nk0), share = tiles > 1 ? (next_lines + tiles - 2) / (tiles - 1) : 0;
      const bool pf = first && c0 == c_begin;  // the rest were prefetched by the tiles before them
      int64_t r0 = 0, t = 0;
      auto from = [&](int64_t tile) { return std::min(next_lines, (tile - 1) * share); };
      auto count = [&](int64_t tile) { return tile == 0 ? 0 : std::min(next_lines, tile * share) - from(tile); };
      for (; r0 + 8 <= M; r0 += 8, ++t) {
        Tile48<8>(x, w, yc, ldy, K, N, r0, c0, k0, k1, first, pf && t == 0, next, from(t), count(t));
      }
      const bool p0 = pf && t == 0;
      switch (M - r0) {
        case 7: Tile48<7>(x, w, yc, ldy, K, N, r0, c0, k0, k1, first, p0, next, from(t), count(t)); break;
        case 6: Tile48<6>(x, w, yc, ldy, K, N, r0, c0, k0, k1, first, p0, next, from(t), count(t)); break;
        case 5: Tile48<5>(x, w, yc, ldy, K, N, r0, c0, k0, k1, first, p0, next, from(t), count(t)); break;
        case 4: Tile48<4>(x, w, yc, ldy, K, N, r0, c0, k0, k1, first, p0, next, from(t), count(t)); break;
        case 3: Tile48<3>(x, w, yc, ldy, K, N, r0, c0, k0, k1, first, p0, next, from(t), count(t)); break;
        case 2: Tile48<2>(x, w, yc, ldy, K, N, r0, c0, k0, k1, first, p0, next, from(t), count(t)); break;
        case 1: Tile48<1>(x, w, yc, ldy, K, N, r0, c0, k0, k1, first, p0, next, from(t), count(t)); break;
        default: break;
      }
    }
    if (K == 0) break;
  }
}
#endif

#ifdef __AVX512F__
// The tied head (W [N, K]) past kSplitKMaxRows rows with AVX-512, as y^T = W @ x^T: rows n0 .. n0 + R of W times
// x^T's columns m0 .. m0 + 16V (xt [K][ldxt], x transposed and zero-padded to 16-column groups), an R x 16V tile
// (R = 12, V = 2: 24 accumulators) fed by one broadcast of W[n, k] per weight row and V loads of x^T's row k, so
// W streams along its rows (R contiguous streams) and needs no transposing; the tile is stored transposed into
// y [M, N] (its first `valid` columns of x^T: the real rows of x).
constexpr int64_t kNtTileRows = 12;

template <int R, int V>
inline void TileNTx(const float* xt, int64_t ldxt, const float* w, int64_t K, int64_t n0, float* y, int64_t N,
                    int64_t m0, int64_t valid) {
  v16 acc[R][V];
  for (int r = 0; r < R; ++r) for (int v = 0; v < V; ++v) acc[r][v] = Splat16(0.0f);
  const float* wr = w + n0 * K;
  const float* xk = xt + m0;
  for (int64_t k = 0; k < K; ++k, xk += ldxt) {
    if (k % 16 == 0) {  // the next tile's rows (R more rows of W, contiguous), a line of each per 16 k
      for (int r = 0; r < R; ++r) __builtin_prefetch(wr + (R + r) * K + k, 0, 2);
    }
    v16 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = Load16(xk + 16 * v);
    for (int r = 0; r < R; ++r) {
      const v16 b = Splat16(wr[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] += b * xv[v];
    }
  }
  for (int64_t j = 0; j < valid; ++j) {
    float* yj = y + (m0 + j) * N + n0;
    for (int r = 0; r < R; ++r) yj[r] = acc[r][j / 16][j % 16];
  }
}

template <int V>
void RowsNTx(const float* xt, int64_t ldxt, const float* w, int64_t K, int64_t n0, int64_t rows, float* y, int64_t N,
             int64_t m0, int64_t valid) {
  switch (rows) {
    case 12: TileNTx<12, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 11: TileNTx<11, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 10: TileNTx<10, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 9: TileNTx<9, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 8: TileNTx<8, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 7: TileNTx<7, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 6: TileNTx<6, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 5: TileNTx<5, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 4: TileNTx<4, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 3: TileNTx<3, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 2: TileNTx<2, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    case 1: TileNTx<1, V>(xt, ldxt, w, K, n0, y, N, m0, valid); break;
    default: break;
  }
}

// Rows n_begin .. n_end of W [N, K] against every row of x (xt: x^T padded to ldxt = a multiple of 16 columns),
// x's rows in groups of 32 (then one of 16): each weight row block is read from memory for the first group and
// from L2 for the others.
void BlockNTx(const float* xt, int64_t ldxt, const float* w, float* y, int64_t M, int64_t K, int64_t N,
              int64_t n_begin, int64_t n_end) {
  for (int64_t m0 = 0; m0 < M; m0 += 32) {
    const int64_t valid = std::min<int64_t>(32, M - m0);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kNtTileRows) {
      const int64_t rows = std::min(kNtTileRows, n_end - n0);
      if (valid > 16) RowsNTx<2>(xt, ldxt, w, K, n0, rows, y, N, m0, valid);
      else RowsNTx<1>(xt, ldxt, w, K, n0, rows, y, N, m0, valid);
    }
  }
}
#endif

inline float Sum(v8 v) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

// y[r, n] = dot(x[r, :], W[n, :]) for rows r in [r0, r0 + R) and weight rows n in [n0, n0 + 4).
template <int R>
inline void TileNT(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t r0, int64_t n0) {
  v8 acc[R][4];
  for (int r = 0; r < R; ++r) for (int j = 0; j < 4; ++j) acc[r][j] = Splat(0.0f);
  const int64_t kv = K / 8 * 8;
  const float* w0 = w + n0 * K;
  for (int64_t k = 0; k < kv; k += 8) {
    const v8 a = Load(w0 + k), b = Load(w0 + K + k), c = Load(w0 + 2 * K + k), d = Load(w0 + 3 * K + k);
    for (int r = 0; r < R; ++r) {
      const v8 xv = Load(x + (r0 + r) * K + k);
      acc[r][0] += xv * a;
      acc[r][1] += xv * b;
      acc[r][2] += xv * c;
      acc[r][3] += xv * d;
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) {
      float s = Sum(acc[r][j]);
      for (int64_t k = kv; k < K; ++k) s += x[(r0 + r) * K + k] * w0[j * K + k];
      y[(r0 + r) * N + n0 + j] = s;
    }
  }
}

// One x row: y[n] = dot(x, W[n, :]) one weight row at a time with 4 independent accumulators. With 4 weight rows
// per pass (TileNT<1>) every accumulator is one dependent FMA chain per row, and for K = 576 the chains, not
// memory, set the pace (~30 GB/s on one core against ~37 here, standalone, 2026-12-01).
inline void RowNT1(const float* x, const float* w, float* y, int64_t K, int64_t n) {
  const float* wn = w + n * K;
  int64_t k = 0;
  float s = 0.0f;
#ifdef __AVX512F__
  v16 b0 = Splat16(0.0f), b1 = b0, b2 = b0, b3 = b0;
  for (; k + 64 <= K; k += 64) {
    b0 += Load16(x + k) * Load16(wn + k);
    b1 += Load16(x + k + 16) * Load16(wn + k + 16);
    b2 += Load16(x + k + 32) * Load16(wn + k + 32);
    b3 += Load16(x + k + 48) * Load16(wn + k + 48);
  }
  for (; k + 16 <= K; k += 16) b0 += Load16(x + k) * Load16(wn + k);
  const v16 b = (b0 + b1) + (b2 + b3);
  for (int i = 0; i < 16; ++i) s += b[i];
#endif
  v8 a0 = Splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    a0 += Load(x + k) * Load(wn + k);
    a1 += Load(x + k + 8) * Load(wn + k + 8);
    a2 += Load(x + k + 16) * Load(wn + k + 16);
    a3 += Load(x + k + 24) * Load(wn + k + 24);
  }
  for (; k + 8 <= K; k += 8) a0 += Load(x + k) * Load(wn + k);
  s += Sum((a0 + a1) + (a2 + a3));
  for (; k < K; ++k) s += x[k] * wn[k];
  y[n] = s;
}

#ifdef NIGHTJAR_V16
// BlockNTFew's vectors: 16 floats with AVX-512, else 8 (a pair of AVX registers would leave too few registers)
#ifdef __AVX512F__
typedef v16 vrow;
constexpr int kRowWidth = 16;
inline vrow LoadRow(const float* p) { return Load16(p); }
inline vrow SplatRow(float x) { return Splat16(x); }
#else
typedef v8 vrow;
constexpr int kRowWidth = 8;
inline vrow LoadRow(const float* p) { return Load(p); }
inline vrow SplatRow(float x) { return Splat(x); }
#endif
#endif

// Two weight rows (na, nb) against one x row: BlockNT's two streams, a row of each in turn. Reached only without the
// CPU kernels' vectors (NIGHTJAR_V16): with them one x row takes BlockNTFew, whose sums every row count shares. (Until
// 2026-12-04 RowNT2 read both rows in one loop body with four sums per row: 1.5-2.5% less time for SmolLM2's one-row
// products, but another order of sums than 2+ rows.)
inline void RowNT2(const float* x, const float* w, float* y, int64_t K, int64_t na, int64_t nb) {
  RowNT1(x, w, y, K, na);
  RowNT1(x, w, y, K, nb);
}

constexpr int64_t kNtRows = 64;  // weight rows per L2 block (64 x K floats)

// noinline: one compiled copy for the float32 table and the 8-bit rows' dequantized chunks (BlockNTQ8), so both sum in
// the same order (-fassociative-math may reassociate each inlined copy's reductions differently)
__attribute__((noinline)) void BlockNT(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                                       int64_t n_begin, int64_t n_end) {
  if (M == 1) {
    // two streams per thread: the block's halves, a row of each together (RowNT2). One front-to-back stream per
    // thread read 24.6 GB/s from memory where two read 29.1 (SmolLM2's head cold from memory, 2 threads,
    // standalone; a 2-vCPU Xeon whose plain read is ~30 GB/s, 2026-12-02)
    const int64_t half = (n_end - n_begin) / 2;
    for (int64_t i = 0; i < half; ++i) RowNT2(x, w, y, K, n_begin + i, n_begin + half + i);
    for (int64_t n = n_begin + 2 * half; n < n_end; ++n) RowNT1(x, w, y, K, n);
    return;
  }
  for (int64_t b0 = n_begin; b0 < n_end; b0 += kNtRows) {
    const int64_t b1 = std::min(n_end, b0 + kNtRows);
    const int64_t full_end = b0 + (b1 - b0) / 4 * 4;
    for (int64_t r0 = 0; r0 < M; r0 += 3) {
      const int64_t rows = std::min<int64_t>(3, M - r0);
      for (int64_t n0 = b0; n0 < full_end; n0 += 4) {
        if (rows == 3) TileNT<3>(x, w, y, K, N, r0, n0);
        else if (rows == 2) TileNT<2>(x, w, y, K, N, r0, n0);
        else TileNT<1>(x, w, y, K, N, r0, n0);
      }
      for (int64_t r = r0; r < r0 + rows; ++r) {
        for (int64_t n = full_end; n < b1; ++n) {
          float s = 0.0f;
          for (int64_t k = 0; k < K; ++k) s += x[r * K + k] * w[n * K + k];
          y[r * N + n] = s;
        }
      }
    }
  }
}

// ---- 8-bit block rows (the tied head) ----------------------------------------------------------------------------
// W [N, K] (an embedding table used as the LM head) whose every 32-element block of a row is W[n, k] = d * q[n, k]
// exactly (q in -127 .. 127, d a 16-bit float: a GGUF Q8_0 table dequantized; cpu.py pack_q8 keeps the layout only
// if every element comes back bit for bit). Stored as [N, K / 32, 36] bytes: per block d (float32), then the 32 q
// (int8). Each element is rebuilt as the float32 d * q (exact: 11 bits times 8) in registers for up to kNtFewRows x
// rows (BlockNTFew), or a chunk of rows at a time into a per-thread buffer that the float32 tiles then read
// (BlockNTx / TileNT): the same sums as the float32 table's to the bit, from 1.125 bytes per weight instead of 4.
constexpr int64_t kQ8Rows = 32;
constexpr int64_t kQ8BlockBytes = 36;
// 8-bit rows with the float32 table beside them: [N, K / 32, 36 + 32 * 4] bytes, all 8-bit blocks first, then the
// float32 [N, K]; more than kNtFewRows rows read the second
constexpr int64_t kQ8DualBlockBytes = kQ8BlockBytes + 32 * 4;

inline float Q8Scale(const uint8_t* block) {
  float d;
  std::memcpy(&d, block, sizeof(float));
  return d;
}

#ifdef __AVX512F__
// Elements k .. k + 16 of an 8-bit row (k a multiple of 16: within one block) as float32 weights.
inline v16 LoadQ8(const uint8_t* row, int64_t k) {
  const uint8_t* block = row + k / kQ8Rows * kQ8BlockBytes;
  const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4 + k % kQ8Rows)));
  v16 w = Splat16(Q8Scale(block)) * reinterpret_cast<v16>(_mm512_cvtepi32_ps(q));
  // the weight as a value of its own: -fassociative-math must not fold d into the product with x (the rounding of
  // x * (d * q) is the float32 table's; (x * d) * q is not)
  asm("" : "+v"(w));
  return w;
}
#elif defined(NIGHTJAR_V16)
// Elements k .. k + 8 of an 8-bit row (k a multiple of 8) as float32 weights: BlockNTFew's 8-float vectors.
inline v8 LoadQ8(const uint8_t* row, int64_t k) {
  const uint8_t* block = row + k / kQ8Rows * kQ8BlockBytes;
  const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 4 + k % kQ8Rows)));
  v8 w = Splat(Q8Scale(block)) * reinterpret_cast<v8>(_mm256_cvtepi32_ps(q));
  asm("" : "+x"(w));  // a value of its own (as above)
  return w;
}
#endif

#ifdef NIGHTJAR_V16
// 2 .. kNtFewRows x rows against two weight rows (na, nb) at once: 2R accumulators, each weight vector loaded (or
// dequantized) once for all R rows, x's rows from L1. `load(n, k)`: elements k .. k + kRowWidth of weight row n;
// K % kRowWidth elements past the last vector are summed in scalars (`tail(n, k)`: one element).
template <int R, typename LoadW, typename TailW>
inline void RowsNT2(const float* x, int64_t K, int64_t na, int64_t nb, float* y, int64_t N, LoadW load, TailW tail) {
  constexpr int W = kRowWidth;
  vrow a[R], b[R];
  for (int r = 0; r < R; ++r) a[r] = b[r] = SplatRow(0.0f);
  const int64_t kv = K / W * W;
  for (int64_t k = 0; k < kv; k += W) {
    const vrow wa = load(na, k), wb = load(nb, k);
    for (int r = 0; r < R; ++r) {
      const vrow xv = LoadRow(x + r * K + k);
      a[r] += xv * wa;
      b[r] += xv * wb;
    }
  }
  for (int r = 0; r < R; ++r) {
    float sa = 0.0f, sb = 0.0f;
    for (int i = 0; i < W; ++i) {
      sa += a[r][i];
      sb += b[r][i];
    }
    for (int64_t k = kv; k < K; ++k) {
      sa += x[r * K + k] * tail(na, k);
      sb += x[r * K + k] * tail(nb, k);
    }
    y[r * N + na] = sa;
    y[r * N + nb] = sb;
  }
}

#ifdef __AVX512F__
constexpr int64_t kFewRowGroup = 12;  // x rows per RowsNT2 (2 x 12 sums of 32 registers)
#else
constexpr int64_t kFewRowGroup = 6;  // 2 x 6 sums of 16 registers; more rows load the weights again (from L1)
#endif

template <typename LoadW, typename TailW>
void BlockNTFew(const float* x, int64_t M, int64_t K, int64_t N, int64_t n_begin, int64_t n_end, float* y, LoadW load,
                TailW tail) {
  const int64_t half = (n_end - n_begin) / 2;  // two streams: the item's halves, a row of each together
  auto rows = [&](int64_t na, int64_t nb) {
    for (int64_t r0 = 0; r0 < M; r0 += kFewRowGroup) {  // each row's sums are the same in any group
      const float* xr = x + r0 * K;
      float* yr = y + r0 * N;
      switch (std::min(kFewRowGroup, M - r0)) {
        case 12: RowsNT2<12>(xr, K, na, nb, yr, N, load, tail); break;
        case 11: RowsNT2<11>(xr, K, na, nb, yr, N, load, tail); break;
        case 10: RowsNT2<10>(xr, K, na, nb, yr, N, load, tail); break;
        case 9: RowsNT2<9>(xr, K, na, nb, yr, N, load, tail); break;
        case 8: RowsNT2<8>(xr, K, na, nb, yr, N, load, tail); break;
        case 7: RowsNT2<7>(xr, K, na, nb, yr, N, load, tail); break;
        case 6: RowsNT2<6>(xr, K, na, nb, yr, N, load, tail); break;
        case 5: RowsNT2<5>(xr, K, na, nb, yr, N, load, tail); break;
        case 4: RowsNT2<4>(xr, K, na, nb, yr, N, load, tail); break;
        case 3: RowsNT2<3>(xr, K, na, nb, yr, N, load, tail); break;
        case 2: RowsNT2<2>(xr, K, na, nb, yr, N, load, tail); break;
        default: RowsNT2<1>(xr, K, na, nb, yr, N, load, tail); break;
      }
    }
  };
  for (int64_t i = 0; i < half; ++i) rows(n_begin + i, n_begin + half + i);
  if (n_begin + 2 * half < n_end) rows(n_end - 1, n_end - 1);  // an odd row: computed twice, stored twice
}
#endif


void DequantRowsQ8(const uint8_t* wq, int64_t K, int64_t n0, int64_t n1, float* buf) {
  const int64_t nb = K / kQ8Rows;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * nb * kQ8BlockBytes;
    float* out = buf + (n - n0) * K;
#ifdef __AVX512F__
    for (int64_t k = 0; k < K; k += 16) Store16(out + k, LoadQ8(row, k));
#else
    for (int64_t b = 0; b < nb; ++b) {
      const float d = Q8Scale(row + b * kQ8BlockBytes);
      const int8_t* q = reinterpret_cast<const int8_t*>(row + b * kQ8BlockBytes + sizeof(float));
      for (int64_t i = 0; i < kQ8Rows; ++i) out[b * kQ8Rows + i] = d * static_cast<float>(q[i]);
    }
#endif
  }
}

// Rows n_begin .. n_end of an 8-bit W against every row of x (xt: x^T for the BlockNTx tiles, ldxt = 0: none):
// chunks of rows dequantized in turn into a buffer the float32 kernels read (16 rows for one x row, which reaches
// here only without the CPU kernels' vectors: the buffer stays in L1; 48 for the 12-row tiles).
void BlockNTQ8(const float* xp, const float* xt, int64_t ldxt, const uint8_t* wq, float* y, int64_t M, int64_t K,
               int64_t N, int64_t n_begin, int64_t n_end) {
  const int64_t chunk = M == 1 ? 16 : 48;
  thread_local std::vector<float> buf;
  buf.resize(chunk * K);
  for (int64_t c0 = n_begin; c0 < n_end; c0 += chunk) {
    const int64_t rows = std::min(chunk, n_end - c0);
    DequantRowsQ8(wq, K, c0, c0 + rows, buf.data());
#ifdef __AVX512F__
    if (ldxt > 0) {
      BlockNTx(xt, ldxt, buf.data(), y + c0, M, K, N, 0, rows);  // y + c0: the chunk's columns of y [M, N]
      continue;
    }
#endif
    BlockNT(xp, buf.data(), y + c0, M, K, N, 0, rows);
  }
}

// Column blocks: a multiple of `align`, about `per_thread` per thread (several, so dynamic item taking balances
// uneven blocks; one for the register tiles, whose items are faster the wider they are: README.md).
int64_t BlockWidth(int64_t N, int64_t threads, int64_t align, int64_t cap, int64_t per_thread = 4) {
  const int64_t want = (N + per_thread * threads - 1) / (per_thread * threads);
  return std::min(cap, std::max(align, (want + align - 1) / align * align));
}

#ifdef __AVX512F__
// The 8 x 48 tiles' items: one column block per thread, uncapped. A tile item restarts its stream of W (its first
// panel block waits on memory; the tiles after it prefetch the next panel's), so the fewer and wider the items,
// the less waiting: products alone at 32 rows 54.4-56.0 ms with ~4 items per thread (at most 480 or 240 columns)
// against 51.9-52.9 with one (2026-12-02; standalone, cold [576, 1536] weights 0.41 ns per weight in 96-column
// items, 0.31 in 384, 0.30 in 768).
int64_t TileBlockWidth(int64_t N, int64_t threads) { return BlockWidth(N, threads, 48, N, 1); }
#endif

// One product of a call: W, its output and its width N (a call may take several weights that share x).
struct Segment {
  const float* w;
  float* y;
  int64_t N;
  bool packed = false;  // w is [N / 16, K, 16] (PackedProduct)
  const uint8_t* q = nullptr;  // 4-bit blocks [N / 16, K / 32, 384] (PackedProductCompact); w: none, or float32
                               // panels beside them (past kPanelRowGroup rows)
  const uint8_t* q8 = nullptr;  // a transposed W [N, K] as 8-bit blocks [N, K / 32, 36] instead (BlockNTQ8)
  const uint16_t* bf = nullptr;  // packed as bfloat16 panels [N / 16, K, 16] instead (w unused; PackedProductCompact)
  const uint8_t* qa = nullptr;  // 4-bit blocks for int8 activations, int8 [N / 16, K / 32, 320] (PackedProductInt8)
  const uint8_t* qh = nullptr;  // a tied head's 8-bit panels for int8 activations, [N / 16, K / 32, 576] (W8A8)
};

// x [M, K] quantized per row and 32-element block for the int8-activation weights (PackedProductInt8): q [M, K]
// int8, d [M, K / 32] (the scale d_x), s [M, K / 32] (the block's sum of x).
struct QuantX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> qs;  // [M, K / 32]: each block's sum of q (the 8-bit head's offset correction)
  void Resize(int64_t M, int64_t K) {
    q.resize(M * K);
    d.resize(M * K / 32);
    s.resize(M * K / 32);
    qs.resize(M * K / 32);
  }
};

// x quantized once for all the items of one phase (one x): the first item to need it quantizes, the others wait.
struct SharedQuant {
  std::atomic<int> state{0};  // 0: not started, 1: being made, 2: ready
  QuantX qx;
  const QuantX& Get(const float* x, int64_t M, int64_t K);  // with AVX512-VNNI only
};

// ---- packed weights ----------------------------------------------------------------------------------------------
// W [K, N] stored as 16-column panels [N / 16, K, 16] (cpu.py pack): a panel is one contiguous run of memory, so a
// work item of whole panels reads its weights front to back and keeps its outputs in registers for all K (no
// partial sums, no reduction: the same sums whichever thread takes the item, and items can be small, so the
// threads finish together). The [K, N] layout read the same way strides over every row (a 16-column slab per
// row: 1.3-1.5x the time of split-K, 2026-12-03); its split-K passes were 1.13x (one row) the time of panels.
#ifdef __AVX512F__
constexpr int64_t kPanelRowGroup = 8;   // x rows per register tile (8 x 48: 24 sums, 3 panel loads, 1 broadcast)
constexpr int64_t kTilePanels = 3;      // panels per register tile (and per block of the tiles' work)
constexpr int64_t kPanelRowPanels = 4;  // panels per one-row pass and per one-row work item
#else
// 16 AVX registers instead of 32: a 6 x 16 tile (12 sums, 2 loads, 1 broadcast), one row over 2 panels (8 sums)
constexpr int64_t kPanelRowGroup = 6;
constexpr int64_t kTilePanels = 1;
constexpr int64_t kPanelRowPanels = 2;
#endif
// One-row products over compact weights (4-bit panels, the w4a8 tiles, the head's 8-bit rows for int8 x) fetch
// their stream kOneRowPrefetch bytes ahead. Without AVX-512 (AMD EPYC Zen 3) each stream's hardware prefetch left
// the one-row layer products at ~12 GB/s against ~17 GB/s for a plain read; 16 KB ahead took SmolLM2's batch-1
// decode step to 0.94x (w4a8, the exact 4-bit panels alike; the step replayed with and without, interleaved in one
// process). Float32 panels were slower with it (1.05x: their plain stream is what the hardware prefetcher follows
// best); AVX-512 CPUs keep their measured code (0: none).
#ifdef __AVX512F__
constexpr int64_t kOneRowPrefetch = 0;
#else
constexpr int64_t kOneRowPrefetch = 16384;
#endif
// Prefetches (non-temporal hint: read once) the `bytes` at p + kOneRowPrefetch.
inline void PrefetchAhead(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + kOneRowPrefetch + o, 0, 0);
}
// bytes per panel and 32-row block of a 4-bit weight: 64 of d, 64 of m, 256 of nibbles (below)
constexpr int64_t kQ4BlockBytes = 384;
// bytes per panel and block of a weight for int8 activations (weight_format="w4a8"): 16 float16 d, 16 float16 m,
// then 4 groups of 64 bytes of nibbles (PackedProductInt8)
constexpr int64_t kW4A8BlockBytes = 320;
// A tied head's 8-bit rows with panels for int8 activations beside them (weight_format="w4a8"): uint8
// [N, K / 32, 72], the 8-bit rows [N, K / 32, 36] first (the embedding gathers them), then as many bytes of panels
// [N / 16, K / 32, 576]: per panel and block 16 float32 d, then 8 groups of 64 bytes, group g holding k = 4g .. 4g + 3
// of the 16 rows as q + 128 (unsigned, for vpdpbusd; PackedProductInt8)
constexpr int64_t kQ8HeadBlockBytes = 72;
constexpr int64_t kW8A8BlockBytes = 576;
constexpr int64_t kInt8PanelChunk = 8;  // panels per chunk of the int8-activation products (46-123 KB: L2)
// A 4-bit weight with its float32 panels beside it: [N / 16, K / 32, 384 + 32 * 16 * 4] bytes, all 4-bit blocks
// first (the [N / 16, K / 32, 384] layout), then the float32 panels ([N / 16, K, 16]); up to kDualCompactMaxRows
// rows read the first, more rows the second (where the products are bound by FMAs, not bytes: rebuilding each
// block per call cost 21-31% at 9-12 rows)
constexpr int64_t kQ4DualBlockBytes = kQ4BlockBytes + 32 * 16 * 4;
// Where both are held, the compact bytes serve up to this many rows (the register tiles, kPanelRowGroup): SmolLM2's
// layer products (two layers, AMD EPYC Zen 4, 2026-12-03 15:10 UTC, medians of 15 alternating rounds in one process;
// the float32 panels of two layers, 28 MB, mostly held in L3 there) from 4-bit panels took 0.74 / 0.86 / 0.83 / 0.96 /
// 0.93 / 0.90 / 0.90 of the float32 panels' time at 2 / 3 / 4 / 5 / 6 / 7 / 8 rows, 1.21 at 9 and 1.31 at 12 (the
// block buffer). Before PanelTileCompact kept its sums in registers (the same day), 6 rows took 1.02 and 8 rows 1.18.
constexpr int64_t kDualCompactMaxRows = 8;

#ifdef NIGHTJAR_V16
constexpr bool kPackedSupported = true;

// One x row: P panels at once (P streams), two sums each (even and odd k). Four panels at once measured 0.95-0.96
// of the whole decode step's time with two (six 0.95, eight 0.96-0.97; 2026-12-03, in one process, run in turn).
// 16 weights of a float32 or bfloat16 panel row as float32 (bfloat16: the 16-bit pattern in a float32's high half)
#ifdef __AVX512F__
inline v16 LoadBf16(const uint16_t* p) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<v16>(_mm512_slli_epi32(h, 16));
}
#else
inline v8 LoadBf16x8(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<v8>(_mm256_slli_epi32(h, 16));
}
inline v16 LoadBf16(const uint16_t* p) { return v16{LoadBf16x8(p), LoadBf16x8(p + 8)}; }
#endif

// y[r0 .. r0 + R, panels p .. p + P] (=, or += with `add`) x[r0 .. r0 + R, k0 .. k1] @ those panels' rows k0 .. k1:
// an R x 16P register tile (R broadcasts of x and P panel loads per k).
// Prefetch: lines i in [pf_from, pf_to) of `next` (a PrefetchPlan), spread over the k loop.
struct PrefetchPlan {
  const float* run[3];  // up to 3 contiguous runs (a panel's rows), `lines` 64-byte lines each
  int64_t runs = 0, lines = 0;
  const float* line(int64_t i) const { return run[i / lines] + (i % lines) * 16; }
};

template <int R, int P>
inline void PanelTile(const float* x, const float* w0, int64_t ld, float* y, int64_t K, int64_t N, int64_t r0,
                      int64_t p, int64_t k0, int64_t k1, bool add, const PrefetchPlan* pf = nullptr,
                      int64_t pf_from = 0, int64_t pf_to = 0) {
  v16 acc[R][P];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < P; ++j) acc[r][j] = add ? Load16(y + (r0 + r) * N + (p + j) * 16) : Splat16(0.0f);
  }
  const float* w[P];
  for (int j = 0; j < P; ++j) w[j] = w0 + j * ld;
  const float* xr = x + r0 * K;
  const int64_t per_k = pf != nullptr && k1 > k0 ? (pf_to - pf_from + (k1 - k0) - 1) / (k1 - k0) : 0;
  int64_t pi = pf_from;
  for (int64_t k = k0; k < k1; ++k) {
    for (int64_t q = 0; q < per_k && pi < pf_to; ++q, ++pi) __builtin_prefetch(pf->line(pi), 0, 2);
    v16 wv[P];
    for (int j = 0; j < P; ++j) wv[j] = Load16(w[j] + (k - k0) * 16);
    for (int r = 0; r < R; ++r) {
      const v16 xb = Splat16(xr[r * K + k]);
      for (int j = 0; j < P; ++j) acc[r][j] += xb * wv[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < P; ++j) Store16(y + (r0 + r) * N + (p + j) * 16, acc[r][j]);
  }
}

// w0: panel p's row k0 (float32 panels, `ld` floats from one panel to the next: 16 K for a packed weight)
template <int P>
inline void PanelTileRows(const float* x, const float* w0, int64_t ld, float* y, int64_t K, int64_t N, int64_t r0,
                          int64_t rows, int64_t p, int64_t k0, int64_t k1, bool add, const PrefetchPlan* pf = nullptr,
                          int64_t pf_from = 0, int64_t pf_to = 0) {
  switch (rows) {
    case 8: PanelTile<8, P>(x, w0, ld, y, K, N, r0, p, k0, k1, add, pf, pf_from, pf_to); break;
    case 7: PanelTile<7, P>(x, w0, ld, y, K, N, r0, p, k0, k1, add, pf, pf_from, pf_to); break;
    case 6: PanelTile<6, P>(x, w0, ld, y, K, N, r0, p, k0, k1, add, pf, pf_from, pf_to); break;
    case 5: PanelTile<5, P>(x, w0, ld, y, K, N, r0, p, k0, k1, add, pf, pf_from, pf_to); break;
    case 4: PanelTile<4, P>(x, w0, ld, y, K, N, r0, p, k0, k1, add, pf, pf_from, pf_to); break;
    case 3: PanelTile<3, P>(x, w0, ld, y, K, N, r0, p, k0, k1, add, pf, pf_from, pf_to); break;
    case 2: PanelTile<2, P>(x, w0, ld, y, K, N, r0, p, k0, k1, add, pf, pf_from, pf_to); break;
    default: PanelTile<1, P>(x, w0, ld, y, K, N, r0, p, k0, k1, add, pf, pf_from, pf_to); break;
  }
}

// PanelTileRows for 1-3 panels
inline void PanelGroupRows(int64_t panels, const float* x, const float* w0, int64_t ld, float* y, int64_t K,
                           int64_t N, int64_t r0, int64_t rows, int64_t p, int64_t k0, int64_t k1, bool add,
                           const PrefetchPlan* pf = nullptr, int64_t pf_from = 0, int64_t pf_to = 0) {
  if (panels == 3) PanelTileRows<3>(x, w0, ld, y, K, N, r0, rows, p, k0, k1, add, pf, pf_from, pf_to);
  else if (panels == 2) PanelTileRows<2>(x, w0, ld, y, K, N, r0, rows, p, k0, k1, add, pf, pf_from, pf_to);
  else PanelTileRows<1>(x, w0, ld, y, K, N, r0, rows, p, k0, k1, add, pf, pf_from, pf_to);
}

// ---- 4-bit block panels ------------------------------------------------------------------------------------------
// W [K, N] whose every 32-row block of a column holds W[k, c] = d * q[k, c] + m exactly (q in 0 .. 15; d and m one
// pair per block and column: a checkpoint quantized as GGUF Q4_1, whose dequantized float32 weights the model
// holds). cpu.py pack_q4 finds d and m from the float32 weights and keeps the layout only if every element is
// reproduced bit for bit. Stored as [N / 16, K / 32, 384] bytes: for each panel (16 columns) and block, the 16
// columns' d (float32), their m (float32), then 16 row pairs of 16 bytes (row 2i in the low nibbles, 2i + 1 in
// the high). Each weight is rebuilt as the float32 fma(d, q, m) (= the float32 d * q + m: d * q is exact, a 16-bit
// float times 4 bits), so every product equals the float32 panels' to the bit, from 0.75 bytes per weight instead
// of 4. One row: dequantized in registers (PanelRowQ4); more rows: a block of up to 3 panels dequantized into a
// per-thread buffer, then the float32 register tiles over it.
constexpr int64_t kQ4Rows = 32;        // weight rows per block

inline v16 LoadQ4Scale(const uint8_t* p) { return Load16(reinterpret_cast<const float*>(p)); }

// Rows 2i and 2i + 1 of a block (the 16 bytes at `pair`) as float32 weights.
#ifdef __AVX512F__
inline void Nibbles(const uint8_t* pair, v16& lo, v16& hi) {  // the 16 bytes' low and high nibbles as float32
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
  lo = reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))));
  hi = reinterpret_cast<v16>(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)));
}
#else
inline void Nibbles8(const uint8_t* bytes, v8& lo, v8& hi) {
  const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  lo = reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15))));
  hi = reinterpret_cast<v8>(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)));
}
inline void Nibbles(const uint8_t* pair, v16& lo, v16& hi) {
  Nibbles8(pair, lo.lo, hi.lo);
  Nibbles8(pair + 8, lo.hi, hi.hi);
}
#endif
inline void DequantPair(const uint8_t* pair, v16 d, v16 m, v16& w0, v16& w1) {
  v16 lo, hi;
  Nibbles(pair, lo, hi);
  w0 = d * lo + m;
  w1 = d * hi + m;
  Opaque(w0, w1);  // values of their own (-fassociative-math must not fold d or m into x's product)
}

// One x row on 4-bit panels, the scales loaded once per block: PanelTileCompact's arithmetic (each weight pair rebuilt
// as DequantPair does, one sum per column, row 2i added before row 2i + 1), so the same bits as any number of rows.
template <int P>
inline void PanelRowQ4(const float* x, const uint8_t* wq, float* y, int64_t K, int64_t p) {
  const int64_t nb = K / kQ4Rows;
  const uint8_t* w[P];
  for (int j = 0; j < P; ++j) w[j] = wq + (p + j) * nb * kQ4BlockBytes;
  v16 a[P];
  for (int j = 0; j < P; ++j) a[j] = Splat16(0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    v16 d[P], m[P];
    if (kOneRowPrefetch > 0) {
      for (int j = 0; j < P; ++j) PrefetchAhead(w[j] + b * kQ4BlockBytes, kQ4BlockBytes);
    }
    for (int j = 0; j < P; ++j) {
      const uint8_t* blk = w[j] + b * kQ4BlockBytes;
      d[j] = LoadQ4Scale(blk);
      m[j] = LoadQ4Scale(blk + 64);
    }
    const float* xb = x + b * kQ4Rows;
    for (int64_t i = 0; i < kQ4Rows / 2; ++i) {
      const v16 x0 = Splat16(xb[2 * i]), x1 = Splat16(xb[2 * i + 1]);
      for (int j = 0; j < P; ++j) {
        v16 w0, w1;
        DequantPair(w[j] + b * kQ4BlockBytes + 128 + i * 16, d[j], m[j], w0, w1);
        a[j] += x0 * w0;
        Opaque(a[j]);
        a[j] += x1 * w1;
      }
    }
  }
  for (int j = 0; j < P; ++j) Store16(y + (p + j) * 16, a[j]);
}

// bfloat16 panels: W [K, N] whose every element is a bfloat16 value (a checkpoint stored in bfloat16, upcast),
// held as its 16-bit patterns (cpu.py pack_bf16) and widened exactly (the pattern shifted into a float32's high
// half): the float32 panels' products to the bit from half the bytes.

// Panels p .. p + panels of bfloat16 panels, rows k0 .. k1 -> buf [panels][k1 - k0][16] float32.
void DequantPanels(const uint16_t* wp, int64_t K, int64_t p, int64_t panels, int64_t k0, int64_t k1, float* buf) {
  for (int64_t j = 0; j < panels; ++j) {
    const uint16_t* src = wp + ((p + j) * K + k0) * 16;
    float* out = buf + j * (k1 - k0) * 16;
    for (int64_t r = 0; r < k1 - k0; ++r) Store16(out + r * 16, LoadBf16(src + r * 16));
  }
}

// Panels p .. p + panels of a 4-bit weight, rows k0 .. k1 (whole blocks) -> buf [panels][k1 - k0][16] float32.
void DequantPanels(const uint8_t* wq, int64_t K, int64_t p, int64_t panels, int64_t k0, int64_t k1, float* buf) {
  const int64_t nb = K / kQ4Rows, rows = k1 - k0;
  for (int64_t j = 0; j < panels; ++j) {
    for (int64_t b = k0 / kQ4Rows; b < k1 / kQ4Rows; ++b) {
      const uint8_t* blk = wq + ((p + j) * nb + b) * kQ4BlockBytes;
      const v16 d = LoadQ4Scale(blk), m = LoadQ4Scale(blk + 64);
      float* out = buf + (j * rows + b * kQ4Rows - k0) * 16;
      for (int64_t i = 0; i < kQ4Rows / 2; ++i) {
        v16 w0, w1;
        DequantPair(blk + 128 + i * 16, d, m, w0, w1);
        Store16(out + 2 * i * 16, w0);
        Store16(out + (2 * i + 1) * 16, w1);
      }
    }
  }
}

// Rows k and k + 1 of panel p of a compact weight as float32 (k even), and one row k (bfloat16's odd K only).
inline void PanelPair(const uint8_t* wq, int64_t K, int64_t p, int64_t k, v16& w0, v16& w1) {
  const uint8_t* blk = wq + (p * (K / kQ4Rows) + k / kQ4Rows) * kQ4BlockBytes;
  DequantPair(blk + 128 + (k % kQ4Rows) / 2 * 16, LoadQ4Scale(blk), LoadQ4Scale(blk + 64), w0, w1);
}
inline void PanelPair(const uint16_t* wb, int64_t K, int64_t p, int64_t k, v16& w0, v16& w1) {
  w0 = LoadBf16(wb + (p * K + k) * 16);
  w1 = LoadBf16(wb + (p * K + k + 1) * 16);
}
inline v16 PanelOne(const uint8_t*, int64_t, int64_t, int64_t) { return Splat16(0.0f); }  // K % 32 == 0: unused
inline v16 PanelOne(const uint16_t* wb, int64_t K, int64_t p, int64_t k) { return LoadBf16(wb + (p * K + k) * 16); }

// 2-8 x rows on a compact weight: PanelTile's R x 16P register tile over all of K, each pair of weight rows rebuilt
// in registers once for all R rows (no buffer); PanelTile's order of sums, so the float32 panels' results.
template <int R, int P, typename T>
__attribute__((noinline)) void PanelTileCompact(const float* x, const T* w, float* y, int64_t K, int64_t N, int64_t r0,
                                                int64_t p) {
  // The body runs inside a loop of one pass, and each instantiation is compiled on its own (noinline): GCC 12 then
  // keeps acc in registers. Without both it kept the sums in memory, a load and a store around every multiply-add
  // (2-8 rows 1.2-1.6x the time; check with the assembly: no vfmadd with a stack operand but in the 7-8 x 3 tiles,
  // which have more sums and weights than registers).
  for (int once = 0; once < 1; ++once) {
    v16 acc[R][P];
    for (int r = 0; r < R; ++r) for (int j = 0; j < P; ++j) acc[r][j] = Splat16(0.0f);
    const float* xr = x + r0 * K;
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
      v16 w0[P], w1[P];
      for (int j = 0; j < P; ++j) PanelPair(w, K, p + j, k, w0[j], w1[j]);
      for (int r = 0; r < R; ++r) {
        const v16 xb = Splat16(xr[r * K + k]);
        for (int j = 0; j < P; ++j) {
          acc[r][j] += xb * w0[j];
          Opaque(acc[r][j]);  // row k's sum first: -fassociative-math must not add rows k and k + 1 first
        }
      }
      for (int r = 0; r < R; ++r) {
        const v16 xb = Splat16(xr[r * K + k + 1]);
        for (int j = 0; j < P; ++j) acc[r][j] += xb * w1[j];
      }
    }
    for (; k < K; ++k) {
      v16 wv[P];
      for (int j = 0; j < P; ++j) wv[j] = PanelOne(w, K, p + j, k);
      for (int r = 0; r < R; ++r) {
        const v16 xb = Splat16(xr[r * K + k]);
        for (int j = 0; j < P; ++j) acc[r][j] += xb * wv[j];
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < P; ++j) Store16(y + (r0 + r) * N + (p + j) * 16, acc[r][j]);
    }
  }
}

template <int P, typename T>
inline void PanelTileCompactRows(const float* x, const T* w, float* y, int64_t K, int64_t N, int64_t r0, int64_t rows,
                                 int64_t p) {
  switch (rows) {
    case 8: PanelTileCompact<8, P>(x, w, y, K, N, r0, p); break;
    case 7: PanelTileCompact<7, P>(x, w, y, K, N, r0, p); break;
    case 6: PanelTileCompact<6, P>(x, w, y, K, N, r0, p); break;
    case 5: PanelTileCompact<5, P>(x, w, y, K, N, r0, p); break;
    case 4: PanelTileCompact<4, P>(x, w, y, K, N, r0, p); break;
    case 3: PanelTileCompact<3, P>(x, w, y, K, N, r0, p); break;
    case 2: PanelTileCompact<2, P>(x, w, y, K, N, r0, p); break;
    default: PanelTileCompact<1, P>(x, w, y, K, N, r0, p); break;
  }
}

// One x row over panels p0 .. p1, kPanelRowPanels at a time: the several-row tiles' order of sums (one sum per column,
// row k added before row k + 1), so a row's result never depends on how many rows its call has and a speculative
// verify step's rows equal one-row decoding to the bit. (Until 2026-12-04 one row summed even and odd k apart and
// added the two at the end: more FMA chains in flight, another rounding; greedy SD could then differ from plain
// decoding where the target's two best logits tied to ~1e-5. The 4-bit one-row pass, with the scales hoisted per
// block, measured no slower: 0.968x / 0.993x the whole batch-1 step.)
inline void PanelRows(const float* x, const uint8_t* w, float* y, int64_t K, int64_t, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + kPanelRowPanels <= p1; p += kPanelRowPanels) PanelRowQ4<kPanelRowPanels>(x, w, y, K, p);
  for (; p < p1; ++p) PanelRowQ4<1>(x, w, y, K, p);
}
inline void PanelRows(const float* x, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + kPanelRowPanels <= p1; p += kPanelRowPanels) PanelTileCompact<1, kPanelRowPanels>(x, w, y, K, N, 0, p);
  for (; p < p1; ++p) PanelTileCompact<1, 1>(x, w, y, K, N, 0, p);
}
inline void PanelRows(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  int64_t p = p0;
  for (; p + kPanelRowPanels <= p1; p += kPanelRowPanels) {
    PanelTile<1, kPanelRowPanels>(x, w + p * K * 16, K * 16, y, K, N, 0, p, 0, K, false);
  }
  for (; p < p1; ++p) PanelTile<1, 1>(x, w + p * K * 16, K * 16, y, K, N, 0, p, 0, K, false);
}

// A compact panel weight (T: uint8_t 4-bit blocks, uint16_t bfloat16): one row, or up to kPanelRowGroup rows,
// rebuilt in registers; more rows by blocks of kb weight rows (whole 4-bit blocks): each 3-panel group's block
// rebuilt once into a per-thread buffer, then every row group's register tile over it (the float32 panels' order of
// sums throughout: the same results).
template <typename T>
void PackedProductCompact(const float* x, int64_t M, int64_t K, const T* w, const Segment& s, int64_t p0,
                          int64_t p1) {
  if (M == 1) {
    PanelRows(x, w, s.y, K, s.N, p0, p1);
    return;
  }
  if (M <= kPanelRowGroup) {
    for (int64_t p = p0; p < p1; p += kTilePanels) {
      const int64_t panels = std::min<int64_t>(kTilePanels, p1 - p);
      if (panels == 3) PanelTileCompactRows<3>(x, w, s.y, K, s.N, 0, M, p);
      else if (panels == 2) PanelTileCompactRows<2>(x, w, s.y, K, s.N, 0, M, p);
      else PanelTileCompactRows<1>(x, w, s.y, K, s.N, 0, M, p);
    }
    return;
  }
  const int64_t kb = (M > 16 ? kTileKBlockWide : kTileKBlock) / kQ4Rows * kQ4Rows;
  thread_local std::vector<float> buf;
  buf.resize(kTilePanels * kb * 16);
  for (int64_t k0 = 0; k0 < K; k0 += kb) {
    const int64_t k1 = std::min(K, k0 + kb);
    for (int64_t p = p0; p < p1; p += kTilePanels) {
      const int64_t panels = std::min<int64_t>(kTilePanels, p1 - p);
      DequantPanels(w, K, p, panels, k0, k1, buf.data());
      for (int64_t r0 = 0; r0 < M; r0 += kPanelRowGroup) {
        const int64_t rows = std::min(kPanelRowGroup, M - r0);
        PanelGroupRows(panels, x, buf.data(), (k1 - k0) * 16, s.y, K, s.N, r0, rows, p, k0, k1, k0 > 0);
      }
    }
  }
}

// ---- 4-bit weights with int8 activations (weight_format="w4a8"; lossy in the activation) -------------------------
// The same Q4_1 blocks as the 4-bit panels (w = d * q + m per 32 rows of a column), laid out for AVX512-VNNI's
// vpdpbusd (unsigned 8-bit times signed 8-bit, four products summed into each 32-bit lane), and x quantized per
// row and 32-element block to int8 (d_x = max |x| / 127, q_x = round(x / d_x); llama.cpp's Q8 activations). Per
// block and column: sum_k w x ~= d * d_x * (sum_k q q_x) + m * (sum_k x), the integer sum exact, the m term over
// the float32 x itself. So only x's rounding is lost (~0.4% of a block's largest |x| per element); the products
// are no longer the float32 model's to the bit, which is why this layout is opt-in.
// Layout int8 [N / 16, K / 32, 320] per panel and block: 16 float16 d, 16 float16 m (as the GGUF stores them: 0.625
// bytes per weight, against 0.75 with float32 scales: one-row steps read 17% fewer bytes), then 4 groups of 64 bytes,
// group g holding rows 8g .. 8g + 7: lane c (4 bytes) of the group is column c, byte i of it row 8g + i in the low
// nibble and row 8g + 4 + i in the high. Each row's result depends only on that row of x (integer sums, then per
// block two multiply-adds in block order, the same in every variant below), so any number of rows, any tile and
// any thread give a row the same bits: speculative verify steps and batches agree with one-row decoding.
// Without AVX-512 (AVX2, F16C; NIGHTJAR_INT8 256) the same layout and the same integer sums: vpdpbusd's four
// u8 x s8 products per lane are vpmaddubsw's pairs (s16, saturating, but 4-bit weights times |q_x| <= 127 stay
// under 4,096) then vpmaddwd's pairs (s32), exact: the AVX512-VNNI kernel's integer sums (each block's sum of x,
// for the m term, is added in another order, so a result may differ from an AVX-512 CPU's in its last bits; within
// one CPU every row count, tile and thread still gives a row the same bits). A tied head's
// 8-bit panels (q + 128 up to 255: a pair could reach 64,770 and saturate) are AVX512-VNNI's: without it the head
// reads its 8-bit rows instead (W8A8Rows, below).
#if defined(__AVX512VNNI__)
#define NIGHTJAR_INT8 512
#elif !defined(__AVX512F__) && defined(NIGHTJAR_V16) && defined(__F16C__)
#define NIGHTJAR_INT8 256
#endif

#ifdef NIGHTJAR_INT8
constexpr bool kW4A8Supported = true;
constexpr bool kW8A8HeadSupported = true;

#if NIGHTJAR_INT8 == 512
void QuantizeRows(const float* x, int64_t M, int64_t K, QuantX& out) {
  const int64_t nb = K / kQ4Rows;
  out.Resize(M, K);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kQ4Rows;
      const v16 x0 = Load16(xb), x1 = Load16(xb + 16);
      const __m512 a = _mm512_max_ps(_mm512_abs_ps(reinterpret_cast<__m512>(x0)),
                                     _mm512_abs_ps(reinterpret_cast<__m512>(x1)));
      const float amax = _mm512_reduce_max_ps(a);
      const float d = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512i q0 = _mm512_cvtps_epi32(reinterpret_cast<__m512>(x0 * Splat16(inv)));  // round to nearest even
      const __m512i q1 = _mm512_cvtps_epi32(reinterpret_cast<__m512>(x1 * Splat16(inv)));
      int8_t* qb = out.q.data() + r * K + b * kQ4Rows;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(q1));
      v16 sum = x0 + x1;
      asm("" : "+v"(sum));
      out.qs[r * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      out.d[r * nb + b] = d;
      out.s[r * nb + b] = _mm512_reduce_add_ps(reinterpret_cast<__m512>(sum));
    }
  }
}
#else
inline float MaxLane(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// QuantizeRows with 8-float vectors: the same q and d per block (round to nearest even); s summed in its own order.
void QuantizeRows(const float* x, int64_t M, int64_t K, QuantX& out) {
  const int64_t nb = K / kQ4Rows;
  out.Resize(M, K);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kQ4Rows;
      v8 xv[4];
      for (int i = 0; i < 4; ++i) xv[i] = Load(xb + 8 * i);
      __m256 a = _mm256_and_ps(reinterpret_cast<__m256>(xv[0]), abs_mask);
      for (int i = 1; i < 4; ++i) a = _mm256_max_ps(a, _mm256_and_ps(reinterpret_cast<__m256>(xv[i]), abs_mask));
      const float amax = MaxLane(a);
      const float d = amax / 127.0f;
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      alignas(32) int32_t qi[32];
      __m256i qsum = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {
        const __m256i q = _mm256_cvtps_epi32(reinterpret_cast<__m256>(xv[i] * Splat(inv)));  // round to nearest even
        _mm256_store_si256(reinterpret_cast<__m256i*>(qi + 8 * i), q);
        qsum = _mm256_add_epi32(qsum, q);
      }
      int8_t* qb = out.q.data() + r * K + b * kQ4Rows;
      for (int i = 0; i < 32; ++i) qb[i] = static_cast<int8_t>(qi[i]);  // |q| <= 127
      v8 sum = (xv[0] + xv[1]) + (xv[2] + xv[3]);
      asm("" : "+x"(sum));
      alignas(32) int32_t qs[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(qs), qsum);
      int32_t qt = 0;
      for (int i = 0; i < 8; ++i) qt += qs[i];
      out.qs[r * nb + b] = qt;
      out.d[r * nb + b] = d;
      out.s[r * nb + b] = Sum(sum);
    }
  }
}
#endif

const QuantX& SharedQuant::Get(const float* x, int64_t M, int64_t K) {
  int expected = 0;
  if (state.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    QuantizeRows(x, M, K, qx);
    state.store(2, std::memory_order_release);
  } else {
    while (state.load(std::memory_order_acquire) != 2) nightjar::CpuRelax();
  }
  return qx;
}

#if NIGHTJAR_INT8 == 512
typedef __m512i vi16;  // 16 int32 lanes: a panel's 16 columns
inline vi16 ZeroI16() { return _mm512_setzero_si512(); }

// The block's 16 columns of rows 8g .. 8g + 3 (lo) and 8g + 4 .. 8g + 7 (hi), each lane 4 unsigned bytes.
inline void UnpackW4A8(const uint8_t* group, vi16& lo, vi16& hi) {
  const __m512i v = _mm512_loadu_si512(group);
  const __m512i mask = _mm512_set1_epi8(15);
  lo = _mm512_and_si512(v, mask);
  hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), mask);
}

// isum += lo . xa + hi . xb per lane (4 u8 x s8 products each; xa, xb: 4 bytes of x broadcast to every lane).
inline vi16 Dot2(vi16 isum, vi16 lo, int32_t xa, vi16 hi, int32_t xb) {
  isum = _mm512_dpbusd_epi32(isum, lo, _mm512_set1_epi32(xa));
  return _mm512_dpbusd_epi32(isum, hi, _mm512_set1_epi32(xb));
}

// acc += d * d_x * isum (a block's integer sums scaled), in this order in every variant.
inline v16 Int8ScaledAdd(v16 acc, vi16 isum, v16 d, float dx) {
  const v16 f = reinterpret_cast<v16>(_mm512_cvtepi32_ps(isum));
  v16 scale = d * Splat16(dx);
  asm("" : "+v"(scale));
  acc = reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(f), reinterpret_cast<__m512>(scale),
                                              reinterpret_cast<__m512>(acc)));
  asm("" : "+v"(acc));
  return acc;
}

// The 4-bit blocks' epilogue: acc += d * d_x * isum, then acc += m * s_x.
inline v16 W4A8Epilogue(v16 acc, vi16 isum, v16 d, v16 m, float dx, float sx) {
  acc = Int8ScaledAdd(acc, isum, d, dx);
  acc = reinterpret_cast<v16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(m), reinterpret_cast<__m512>(Splat16(sx)),
                                              reinterpret_cast<__m512>(acc)));
  asm("" : "+v"(acc));
  return acc;
}

// 16 float16 values (a block's d or m) as float32 (exact).
inline v16 LoadHalf16(const uint8_t* p) {
  return reinterpret_cast<v16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#else
struct vi16 {  // 16 int32 lanes as a pair of AVX registers
  __m256i lo, hi;
};
inline vi16 ZeroI16() { return vi16{_mm256_setzero_si256(), _mm256_setzero_si256()}; }

inline void UnpackW4A8(const uint8_t* group, vi16& lo, vi16& hi) {
  const __m256i mask = _mm256_set1_epi8(15);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 32 * h));
    (h ? lo.hi : lo.lo) = _mm256_and_si256(v, mask);
    (h ? hi.hi : hi.lo) = _mm256_and_si256(_mm256_srli_epi32(v, 4), mask);
  }
}

// Dot2 without VNNI: vpmaddubsw (pairs, s16: each |lo . xa| <= 2 * 15 * 127, the two sums together < 7,700) then
// vpmaddwd against ones (s32): the same integers as vpdpbusd.
inline vi16 Dot2(vi16 isum, vi16 lo, int32_t xa, vi16 hi, int32_t xb) {
  const __m256i a = _mm256_set1_epi32(xa), b = _mm256_set1_epi32(xb), ones = _mm256_set1_epi16(1);
  const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(lo.lo, a), _mm256_maddubs_epi16(hi.lo, b));
  const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(lo.hi, a), _mm256_maddubs_epi16(hi.hi, b));
  return vi16{_mm256_add_epi32(isum.lo, _mm256_madd_epi16(pl, ones)),
              _mm256_add_epi32(isum.hi, _mm256_madd_epi16(ph, ones))};
}

inline v16 Int8ScaledAdd(v16 acc, vi16 isum, v16 d, float dx) {
  const v16 f{reinterpret_cast<v8>(_mm256_cvtepi32_ps(isum.lo)), reinterpret_cast<v8>(_mm256_cvtepi32_ps(isum.hi))};
  v16 scale = d * Splat16(dx);
  Opaque(scale);
  acc.lo = reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(f.lo), reinterpret_cast<__m256>(scale.lo),
                                                reinterpret_cast<__m256>(acc.lo)));
  acc.hi = reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(f.hi), reinterpret_cast<__m256>(scale.hi),
                                                reinterpret_cast<__m256>(acc.hi)));
  Opaque(acc);
  return acc;
}

inline v16 W4A8Epilogue(v16 acc, vi16 isum, v16 d, v16 m, float dx, float sx) {
  acc = Int8ScaledAdd(acc, isum, d, dx);
  const __m256 s = _mm256_set1_ps(sx);
  acc.lo = reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(m.lo), s, reinterpret_cast<__m256>(acc.lo)));
  acc.hi = reinterpret_cast<v8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(m.hi), s, reinterpret_cast<__m256>(acc.hi)));
  Opaque(acc);
  return acc;
}

inline v16 LoadHalf16(const uint8_t* p) {
  return v16{reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))),
             reinterpret_cast<v8>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))))};
}
#endif

inline int32_t Word(const int8_t* q) {
  int32_t v;
  std::memcpy(&v, q, 4);
  return v;
}

// R x rows (r0 ..) on P panels (p ..) over all K: each group's weights unpacked once for all R rows.
template <int R, int P>
__attribute__((noinline)) void W4A8Tile(const QuantX& qx, const uint8_t* wq, float* y, int64_t K, int64_t N,
                                        int64_t r0, int64_t p) {
  for (int once = 0; once < 1; ++once) {  // as PanelTileCompact: keeps the sums in registers with GCC 12
    const int64_t nb = K / kQ4Rows;
    v16 acc[R][P];
    for (int r = 0; r < R; ++r) for (int j = 0; j < P; ++j) acc[r][j] = Splat16(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk[P];
      for (int j = 0; j < P; ++j) blk[j] = wq + ((p + j) * nb + b) * kW4A8BlockBytes;
      if (R == 1 && kOneRowPrefetch > 0) {
        for (int j = 0; j < P; ++j) PrefetchAhead(blk[j], kW4A8BlockBytes);
      }
      vi16 isum[R][P];
      for (int r = 0; r < R; ++r) for (int j = 0; j < P; ++j) isum[r][j] = ZeroI16();
      for (int g = 0; g < 4; ++g) {
        vi16 lo[P], hi[P];
        for (int j = 0; j < P; ++j) UnpackW4A8(blk[j] + 64 + 64 * g, lo[j], hi[j]);
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = qx.q.data() + (r0 + r) * K + b * kQ4Rows + 8 * g;
          const int32_t xa = Word(xq), xb = Word(xq + 4);
          for (int j = 0; j < P; ++j) isum[r][j] = Dot2(isum[r][j], lo[j], xa, hi[j], xb);
        }
      }
      for (int j = 0; j < P; ++j) {
        const v16 d = LoadHalf16(blk[j]), m = LoadHalf16(blk[j] + 32);
        for (int r = 0; r < R; ++r) {
          const int64_t at = (r0 + r) * nb + b;
          acc[r][j] = W4A8Epilogue(acc[r][j], isum[r][j], d, m, qx.d[at], qx.s[at]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < P; ++j) Store16(y + (r0 + r) * N + (p + j) * 16, acc[r][j]);
    }
  }
}

#if NIGHTJAR_INT8 == 512
// A tied head's 8-bit panels (kQ8HeadBlockBytes) times int8 x: per block the 16 rows' integer sums of (q + 128) q_x,
// less 128 * sum q_x, times d * d_x. R rows on P panels, as W4A8Tile.
template <int R, int P>
__attribute__((noinline)) void W8A8Tile(const QuantX& qx, const uint8_t* wq, float* y, int64_t K, int64_t N,
                                        int64_t r0, int64_t p) {
  for (int once = 0; once < 1; ++once) {
    const int64_t nb = K / kQ4Rows;
    v16 acc[R][P];
    for (int r = 0; r < R; ++r) for (int j = 0; j < P; ++j) acc[r][j] = Splat16(0.0f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk[P];
      for (int j = 0; j < P; ++j) blk[j] = wq + ((p + j) * nb + b) * kW8A8BlockBytes;
      __m512i isum[R][P];
      for (int r = 0; r < R; ++r) for (int j = 0; j < P; ++j) isum[r][j] = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) {
        __m512i w[P];
        for (int j = 0; j < P; ++j) w[j] = _mm512_loadu_si512(blk[j] + 64 + 64 * g);
        for (int r = 0; r < R; ++r) {
          const __m512i xa = _mm512_set1_epi32(Word(qx.q.data() + (r0 + r) * K + b * kQ4Rows + 4 * g));
          for (int j = 0; j < P; ++j) isum[r][j] = _mm512_dpbusd_epi32(isum[r][j], w[j], xa);
        }
      }
      for (int j = 0; j < P; ++j) {
        const v16 d = LoadQ4Scale(blk[j]);
        for (int r = 0; r < R; ++r) {
          const int64_t at = (r0 + r) * nb + b;
          const __m512i exact = _mm512_sub_epi32(isum[r][j], _mm512_set1_epi32(128 * qx.qs[at]));
          acc[r][j] = Int8ScaledAdd(acc[r][j], exact, d, qx.d[at]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < P; ++j) Store16(y + (r0 + r) * N + (p + j) * 16, acc[r][j]);
    }
  }
}

template <int R, int P>
struct W8A8 {
  static void Run(const QuantX& qx, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t r0, int64_t p) {
    W8A8Tile<R, P>(qx, w, y, K, N, r0, p);
  }
};
#endif

// The int8-activation tiles as types (Int8Product takes either).
template <int R, int P>
struct W4A8 {
  static void Run(const QuantX& qx, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t r0, int64_t p) {
    W4A8Tile<R, P>(qx, w, y, K, N, r0, p);
  }
};

#if NIGHTJAR_INT8 == 512
constexpr int64_t kInt8RowGroup = 4;   // x rows per int8 tile
constexpr int64_t kInt8RowPanels = 4;  // panels per one-row tile
constexpr int64_t kInt8Panels = 2;     // panels per tile of more rows
#else
// 16 AVX registers: a tile's sums and integer sums take 4 per row and panel
constexpr int64_t kInt8RowGroup = 2;
constexpr int64_t kInt8RowPanels = 2;
constexpr int64_t kInt8Panels = 1;
#endif

template <template <int, int> class Tile, int P>
void Int8TileRows(const QuantX& qx, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t r0, int64_t rows,
                  int64_t p) {
  switch (rows) {
    case 4: Tile<4, P>::Run(qx, w, y, K, N, r0, p); break;
    case 3: Tile<3, P>::Run(qx, w, y, K, N, r0, p); break;
    case 2: Tile<2, P>::Run(qx, w, y, K, N, r0, p); break;
    default: Tile<1, P>::Run(qx, w, y, K, N, r0, p); break;
  }
}

// Panels p0 .. p1 of an int8-activation weight (W4A8: 4-bit layer weights; W8A8: a tied head's 8-bit panels) for
// x [M, K]: one row 4 panels at a time; more rows in groups of up to 4 rows over 2 panels, every group over a chunk
// of kInt8PanelChunk panels before the next chunk, so the groups after the first read the chunk from cache (an item
// may hold thousands of panels: a 49,152-row head's 3,072 over 2 threads; with all row groups over the whole item
// its 16 MB streamed from memory once per 4 rows).
template <template <int, int> class Tile>
void Int8Product(const QuantX& qx, const uint8_t* w, const Segment& s, int64_t M, int64_t K, int64_t p0,
                 int64_t p1) {
  for (int64_t c0 = p0; c0 < p1; c0 += kInt8PanelChunk) {
    const int64_t c1 = std::min(p1, c0 + kInt8PanelChunk);
    for (int64_t r0 = 0; r0 < M; r0 += kInt8RowGroup) {
      const int64_t rows = std::min<int64_t>(kInt8RowGroup, M - r0);
      int64_t p = c0;
      if (rows == 1) {
        for (; p + kInt8RowPanels <= c1; p += kInt8RowPanels) Tile<1, kInt8RowPanels>::Run(qx, w, s.y, K, s.N, r0, p);
      }
      for (; p + kInt8Panels <= c1; p += kInt8Panels) Int8TileRows<Tile, kInt8Panels>(qx, w, s.y, K, s.N, r0, rows, p);
      if (p < c1) Int8TileRows<Tile, 1>(qx, w, s.y, K, s.N, r0, rows, p);
    }
  }
}

#if NIGHTJAR_INT8 == 256
// A tied head for int8 x without VNNI: its 8-bit rows (the layout's first half; the panels after them are
// vpdpbusd's, whose q + 128 bytes would saturate vpmaddubsw), each weight row against each x row per 32-element
// block: vpsignb moves q_x's sign onto q_w so vpmaddubsw takes |q_x| unsigned (pairs |q_w q_x| <= 2 * 127 * 127,
// under 32,768), vpmaddwd sums pairs: the block's integer sum of q_w q_x exactly (8 lanes of it), then
// acc += float(isum) * (d_w * d_x) per lane and the lanes summed at the end. A row's result depends only on its x.
inline __m256i DotQ8(__m256i w, __m256i x) {
  const __m256i ax = _mm256_sign_epi8(x, x);  // |q_x| (q_x in -127 .. 127)
  const __m256i sw = _mm256_sign_epi8(w, x);  // q_w with q_x's sign (0 where q_x is 0)
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
}

// Weight rows a0 + i and b0 + i (i < count) against x rows r0 .. r0 + R: a row of each of two streams at a time
// (two streams per thread read faster than one here, as BlockNT's), each block's weights loaded once for the R rows.
template <int R>
void W8A8RowsTile(const QuantX& qx, const uint8_t* rows, float* y, int64_t K, int64_t N, int64_t r0, int64_t a0,
                  int64_t b0, int64_t count) {
  const int64_t nb = K / kQ8Rows, row_bytes = nb * kQ8BlockBytes;
  for (int64_t i = 0; i < count; ++i) {
    v8 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Splat(0.0f);
    const uint8_t* wa = rows + (a0 + i) * row_bytes;
    const uint8_t* wb = rows + (b0 + i) * row_bytes;
    if (R == 1 && kOneRowPrefetch > 0) {
      PrefetchAhead(wa, row_bytes);
      PrefetchAhead(wb, row_bytes);
    }
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* ba = wa + b * kQ8BlockBytes;
      const uint8_t* bb = wb + b * kQ8BlockBytes;
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ba + 4));
      const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bb + 4));
      const float da = Q8Scale(ba), db = Q8Scale(bb);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * nb + b;
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.q.data() + at * kQ8Rows));
        const v8 fa = reinterpret_cast<v8>(_mm256_cvtepi32_ps(DotQ8(qa, xq)));
        const v8 fb = reinterpret_cast<v8>(_mm256_cvtepi32_ps(DotQ8(qb, xq)));
        acc[r][0] += fa * Splat(da * qx.d[at]);
        acc[r][1] += fb * Splat(db * qx.d[at]);
      }
    }
    for (int r = 0; r < R; ++r) {
      y[(r0 + r) * N + a0 + i] = Sum(acc[r][0]);
      y[(r0 + r) * N + b0 + i] = Sum(acc[r][1]);
    }
  }
}

// Weight rows n0 .. n1 (a multiple of 16) for x [M, K]: one x row over the range's two halves (two streams); more
// rows by chunks of 64 weight rows (41 KB: L2), every group of up to 4 x rows over a chunk's halves before the next.
void W8A8Rows(const QuantX& qx, const uint8_t* rows, float* y, int64_t M, int64_t K, int64_t N, int64_t n0,
              int64_t n1) {
  const int64_t chunk = M == 1 ? n1 - n0 : 64;
  for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
    const int64_t half = (std::min(n1, c0 + chunk) - c0) / 2;
    for (int64_t r0 = 0; r0 < M; r0 += 4) {
      switch (std::min<int64_t>(4, M - r0)) {
        case 4: W8A8RowsTile<4>(qx, rows, y, K, N, r0, c0, c0 + half, half); break;
        case 3: W8A8RowsTile<3>(qx, rows, y, K, N, r0, c0, c0 + half, half); break;
        case 2: W8A8RowsTile<2>(qx, rows, y, K, N, r0, c0, c0 + half, half); break;
        default: W8A8RowsTile<1>(qx, rows, y, K, N, r0, c0, c0 + half, half); break;
      }
    }
  }
}
#endif

// A segment of either int8-activation layout; sq: x quantized once for the phase (else this call's own copy).
void PackedProductInt8(const float* x, int64_t M, int64_t K, const Segment& s, int64_t p0, int64_t p1,
                       SharedQuant* sq) {
  QuantX own;
  if (sq == nullptr) QuantizeRows(x, M, K, own);
  const QuantX& qx = sq != nullptr ? sq->Get(x, M, K) : own;
  if (s.qh != nullptr) {
#if NIGHTJAR_INT8 == 512
    Int8Product<W8A8>(qx, s.qh, s, M, K, p0, p1);
#else
    W8A8Rows(qx, s.q8, s.y, M, K, s.N, 16 * p0, 16 * p1);
#endif
    return;
  }
  Int8Product<W4A8>(qx, s.qa, s, M, K, p0, p1);
}
#else
constexpr bool kW4A8Supported = false;
constexpr bool kW8A8HeadSupported = false;
void PackedProductInt8(const float*, int64_t, int64_t, const Segment&, int64_t, int64_t, SharedQuant*) {}
#endif

// Panels p0 .. p1 of a packed segment: y[:, 16 p0 .. 16 p1] = x [M, K] @ W[:, those columns].
// sq: x quantized once for the phase (int8-activation weights; without one, each call quantizes its own copy).
void PackedProduct(const float* x, int64_t M, int64_t K, const Segment& s, int64_t p0, int64_t p1,
                   SharedQuant* sq = nullptr) {
  if (s.qa != nullptr || s.qh != nullptr) {
    PackedProductInt8(x, M, K, s, p0, p1, sq);
    return;
  }
  if (s.q != nullptr && (s.w == nullptr || M <= kDualCompactMaxRows)) {  // s.w: the float32 panels beside them
    PackedProductCompact(x, M, K, s.q, s, p0, p1);
    return;
  }
  if (s.bf != nullptr && (s.w == nullptr || M <= kDualCompactMaxRows)) {
    PackedProductCompact(x, M, K, s.bf, s, p0, p1);
    return;
  }
  if (M == 1) {
    PanelRows(x, s.w, s.y, K, s.N, p0, p1);
    return;
  }
  if (M > kPanelRowGroup && K > 0) {
    // several row groups: blocks of kb weight rows, each block's 3-panel groups in turn, every row group over a
    // group's block (the first from memory, the others from cache); the row groups after the first prefetch the
    // next group's block (past the last group, the first group's next block), so the first does not wait on memory
    const int64_t kb = M > 16 ? kTileKBlockWide : kTileKBlock;
    const int64_t groups = (M + kPanelRowGroup - 1) / kPanelRowGroup;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
      const int64_t k1 = std::min(K, k0 + kb);
      for (int64_t p = p0; p < p1; p += kTilePanels) {
        const int64_t panels = std::min<int64_t>(kTilePanels, p1 - p);
        const bool last = p + kTilePanels >= p1;
        const int64_t np = last ? p0 : p + kTilePanels, nk0 = last ? k1 : k0;
        const int64_t nk1 = last ? std::min(K, k1 + kb) : k1;
        PrefetchPlan next;
        next.runs = nk1 > nk0 ? std::min<int64_t>(kTilePanels, p1 - np) : 0;
        next.lines = nk1 - nk0;
        for (int64_t j = 0; j < next.runs; ++j) next.run[j] = s.w + (np + j) * K * 16 + nk0 * 16;
        const int64_t total = next.runs * next.lines;
        const int64_t share = groups > 1 ? (total + groups - 2) / (groups - 1) : 0;
        for (int64_t t = 0; t < groups; ++t) {
          const int64_t r0 = t * kPanelRowGroup, rows = std::min(kPanelRowGroup, M - r0);
          const int64_t from = t == 0 ? 0 : std::min(total, (t - 1) * share), to = t == 0 ? 0 : std::min(total, t * share);
          PanelGroupRows(panels, x, s.w + (p * K + k0) * 16, K * 16, s.y, K, s.N, r0, rows, p, k0, k1, k0 > 0, &next,
                         from, to);
        }
      }
    }
    return;
  }
  // up to kPanelRowGroup rows (or K = 0): one register tile over all of K per kTilePanels-panel group
  for (int64_t p = p0; p < p1; p += kTilePanels) {
    const int64_t panels = std::min<int64_t>(kTilePanels, p1 - p);
    for (int64_t r0 = 0; r0 < M; r0 += kPanelRowGroup) {
      const int64_t rows = std::min(kPanelRowGroup, M - r0);
      PanelGroupRows(panels, x, s.w + p * K * 16, K * 16, s.y, K, s.N, r0, rows, p, 0, K, false);
    }
  }
}
#else
constexpr bool kPackedSupported = false;
constexpr bool kW4A8Supported = false;
constexpr bool kW8A8HeadSupported = false;
void PackedProduct(const float*, int64_t, int64_t, const Segment&, int64_t, int64_t, SharedQuant* = nullptr) {}
#endif

// One item of a packed SwiGLU: panels p0 .. p1 of gate and up (same shapes; outputs g.y, u.y [M, N]), then
// h [M, N] = silu(gate) * up on those columns, so the gate runs on every thread (rms_swiglu, attn_out_mlp).
void PackedSwiGluItem(const float* x, int64_t M, int64_t K, const Segment& g, const Segment& u, float* h, int64_t p0,
                      int64_t p1, SharedQuant* sq) {
  PackedProduct(x, M, K, g, p0, p1, sq);
  PackedProduct(x, M, K, u, p0, p1, sq);
  const int64_t N = g.N;
  for (int64_t row = 0; row < M; ++row) {
    for (int64_t c = p0 * 16; c < p1 * 16; ++c) h[row * N + c] = nightjar::Silu(g.y[row * N + c]) * u.y[row * N + c];
  }
}

// The work items over packed segments: one wide item per thread (whole 3-panel groups), each thread streaming one
// contiguous run of panels. With XLA's pool as the helpers (NIGHTJAR_CPU_SPIN_US=0), 1-8 rows take small groups
// dynamically (4 panels for one row, else 3): a helper woken from XLA's pool starts ~18 us into the call, and with
// wide items the caller would wait for its whole share. With the spinning team the helper starts at once: in the
// engine's decode step, wide items against small ones with the team, interleaved in one process, 0.94-1.03x at
// batch 1, 0.94x at 2, 0.88x (w4a8) and 1.00x (exact) at 4 (docs/benchmarks.md).
struct PackedItem {
  const Segment* seg;
  int64_t p0, p1;
};

std::vector<PackedItem> PlanPacked(int64_t M, const std::vector<Segment>& segments, int64_t threads) {
  std::vector<PackedItem> items;
  int64_t group = M == 1 ? kPanelRowPanels : 3;
  if (M > kPanelRowGroup || nightjar::SpinTeam::Get().spin_us() > 0) {
    // wide items (one per thread, whole 3-panel groups): a new item's first block waits on memory
    int64_t panels = 0;
    for (const Segment& s : segments) panels = std::max(panels, s.N / 16);
    group = std::max<int64_t>(3, (panels + 3 * threads - 1) / (3 * threads) * 3);
  }
  for (const Segment& s : segments) {
    const int64_t panels = s.N / 16;
    for (int64_t p = 0; p < panels; p += group) items.push_back(PackedItem{&s, p, std::min(panels, p + group)});
  }
  return items;
}

std::string Dims2(const char* name, const ffi::Span<const int64_t>& d) {
  std::string s = std::string(name) + " [";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// A weight or a norm gain as a call reads it: a buffer, or one layer of a buffer stacked over the model's layers
// ([L, ...]: the engine's stacked state on the CPU backend, one array per weight kind instead of one per layer, so a
// decode step's call dispatches ~12 weight arrays instead of ~270; ModelHandle.stack_layers). The calls take an
// array attribute `layers`, one entry per weight / gain operand in order: -1 for the buffer itself, else the layer.
class View {
 public:
  View(const ffi::AnyBuffer& b, int64_t layer) : type_(b.element_type()), dims_(b.dimensions()) {
    data_ = static_cast<char*>(b.untyped_data());
    if (layer >= 0) {  // Views checked layer < dims[0]
      dims_ = dims_.last(dims_.size() - 1);
      int64_t n = 1;
      for (int64_t d : dims_) n *= d;
      data_ += layer * n * static_cast<int64_t>(ffi::ByteWidth(type_));
    }
  }
  ffi::DataType element_type() const { return type_; }
  ffi::Span<const int64_t> dimensions() const { return dims_; }
  void* untyped_data() const { return data_; }
  float* typed_data() const { return reinterpret_cast<float*>(data_); }  // float32 views (gains)

 private:
  ffi::DataType type_;
  ffi::Span<const int64_t> dims_;
  char* data_;
};

using Layers = ffi::Span<const int64_t>;

// The views of a call's weight / gain operands `bufs` at their `layers` entries, or an error naming what is wrong.
std::string Views(Layers layers, std::initializer_list<const ffi::AnyBuffer*> bufs, std::vector<View>& out) {
  if (layers.size() != bufs.size()) {
    return "linear: attribute layers must have one entry per weight / gain operand (" + std::to_string(bufs.size()) +
           "); got " + std::to_string(layers.size());
  }
  size_t i = 0;
  for (const ffi::AnyBuffer* b : bufs) {
    const int64_t layer = layers[i++];
    const auto d = b->dimensions();
    if (layer < -1 || (layer >= 0 && (d.size() < 2 || layer >= d[0]))) {
      return "linear: layer " + std::to_string(layer) + " of " + Dims2("a stacked operand", d) +
             " (allowed: -1 for the whole buffer, or 0 <= layer < its first dimension, with 2 or more dimensions)";
    }
    out.emplace_back(*b, layer);
  }
  return "";
}

// A norm gain: float32 [n].
std::string CheckGain(const View& g, int64_t n, const char* what) {
  const auto d = g.dimensions();
  if (g.element_type() != ffi::DataType::F32 || d.size() != 1 || d[0] != n) {
    return std::string(what) + ": gain must be float32 [" + std::to_string(n) + "]; got " + Dims2("gain", d);
  }
  return "";
}

using W = View;  // a weight: float32 [K, N] / [N, K] / packed panels, or uint8 4-bit panels, ...

// A weight's logical [K, N]: [K, N] itself, packed panels [N / 16, K, 16] or 4-bit panels [N / 16, K / 32, 384].
struct WeightDims {
  int64_t k = -1, n = -1;
  bool packed = false;  // either panel layout
  bool q4 = false;
};

WeightDims DimsOf(const W& w) {
  const auto d = w.dimensions();
  if (w.element_type() == ffi::DataType::F32) {
    if (d.size() == 2) return WeightDims{d[0], d[1], false};
    if (d.size() == 3 && d[2] == 16 && kPackedSupported) return WeightDims{d[1], d[0] * 16, true};
  } else if (w.element_type() == ffi::DataType::BF16 && d.size() == 3 && (d[2] == 16 || d[2] == 48) &&
             kPackedSupported) {  // 48: the float32 panels after the bfloat16 ones
    return WeightDims{d[1], d[0] * 16, true};
  } else if (w.element_type() == ffi::DataType::U8 && d.size() == 3 &&
             (d[2] == kQ4BlockBytes || d[2] == kQ4DualBlockBytes) && kPackedSupported) {
    return WeightDims{d[1] * 32, d[0] * 16, true, true};
  } else if (w.element_type() == ffi::DataType::S8 && d.size() == 3 && d[2] == kW4A8BlockBytes && kW4A8Supported) {
    return WeightDims{d[1] * 32, d[0] * 16, true, true};  // 4-bit blocks for int8 activations
  }
  return WeightDims{};  // k = -1: matches nothing
}

// The segment of a panel-layout weight (either format).
Segment PanelSegment(const W& w, float* y, int64_t N) {
  if (w.element_type() == ffi::DataType::S8) {  // DimsOf: int8 [N / 16, K / 32, 320], with AVX512-VNNI or AVX2
    Segment s{nullptr, y, N, true};
    s.qa = static_cast<const uint8_t*>(w.untyped_data());
    return s;
  }
  if (w.element_type() == ffi::DataType::U8) {
    const auto* q = static_cast<const uint8_t*>(w.untyped_data());
    const auto d = w.dimensions();
    const float* f32 = d[2] == kQ4DualBlockBytes ? reinterpret_cast<const float*>(q + d[0] * d[1] * kQ4BlockBytes)
                                                 : nullptr;
    return Segment{f32, y, N, true, q};
  }
  if (w.element_type() == ffi::DataType::BF16) {
    const auto* bf = static_cast<const uint16_t*>(w.untyped_data());
    const auto d = w.dimensions();
    const float* f32 = d[2] == 48 ? reinterpret_cast<const float*>(bf + d[0] * d[1] * 16) : nullptr;
    return Segment{f32, y, N, true, nullptr, nullptr, bf};
  }
  return Segment{static_cast<const float*>(w.untyped_data()), y, N, true};
}

const float* F32Data(const W& w) { return static_cast<const float*>(w.untyped_data()); }  // DimsOf: F32 [K, N]

// Checks shapes and collects the segment; returns an error message or "".
template <bool kTransposed>
std::string AddSegment(int64_t M, int64_t K, const W& w, ffi::Result<ffi::Buffer<ffi::F32>>& y,
                       std::vector<Segment>& out) {
  const auto wd = w.dimensions(), yd = y->dimensions();
  const WeightDims dims = DimsOf(w);
  if (!kTransposed && wd.size() == 3) {  // packed panels
    if (!kPackedSupported) return "linear: packed weights need a CPU with AVX-512, or AVX2 and FMA";
    if (dims.k < 0 || dims.k != K || yd.size() != 2 || yd[0] != M || yd[1] != dims.n) {
      return "linear: shapes do not match: x [" + std::to_string(M) + ", " + std::to_string(K) + "], packed " +
             Dims2("w", wd) + ", " + Dims2("y", yd) +
             " (w float32 / bfloat16 [N / 16, K, 16], uint8 [N / 16, K / 32, 384] or, with AVX512-VNNI or AVX2, int8 "
             "[N / 16, K / 32, 320]; y [M, N])";
    }
    out.push_back(PanelSegment(w, y->typed_data(), dims.n));
    return "";
  }
  if (kTransposed && w.element_type() == ffi::DataType::U8 && wd.size() == 3 && wd[2] == kQ8HeadBlockBytes) {
    // 8-bit rows with panels for int8 activations beside them [N, K / 32, 72] (weight_format="w4a8")
    if (!kW8A8HeadSupported || !kPackedSupported) {
      return "linear: 8-bit head panels for int8 x need AVX512-VNNI, or AVX2 and F16C";
    }
    if (wd[1] * kQ8Rows != K || wd[0] % 16 != 0 || yd.size() != 2 || yd[0] != M || yd[1] != wd[0]) {
      return "linear: shapes do not match: x [" + std::to_string(M) + ", " + std::to_string(K) + "], 8-bit " +
             Dims2("w", wd) + ", " + Dims2("y", yd) + " (w uint8 [N, K / 32, 72] with N a multiple of 16, y [M, N])";
    }
    const auto* q8 = static_cast<const uint8_t*>(w.untyped_data());
    Segment seg{nullptr, y->typed_data(), wd[0], true, nullptr, q8};
    seg.qh = q8 + wd[0] * wd[1] * kQ8BlockBytes;
    out.push_back(seg);
    return "";
  }
  if (kTransposed && w.element_type() == ffi::DataType::U8 && wd.size() == 3 &&
      (wd[2] == kQ8BlockBytes || wd[2] == kQ8DualBlockBytes)) {  // 8-bit rows [N, K / 32, 36] (or 164)
    if (wd[1] * kQ8Rows != K || yd.size() != 2 || yd[0] != M || yd[1] != wd[0]) {
      return "linear: shapes do not match: x [" + std::to_string(M) + ", " + std::to_string(K) + "], 8-bit " +
             Dims2("w", wd) + ", " + Dims2("y", yd) + " (w uint8 [N, K / 32, 36 or 164], y [M, N])";
    }
    const auto* q8 = static_cast<const uint8_t*>(w.untyped_data());
    const float* f32 = wd[2] == kQ8DualBlockBytes ? reinterpret_cast<const float*>(q8 + wd[0] * wd[1] * kQ8BlockBytes)
                                                  : nullptr;
    out.push_back(Segment{f32, y->typed_data(), wd[0], false, nullptr, q8});
    return "";
  }
  if (wd.size() != 2 || yd.size() != 2 || w.element_type() != ffi::DataType::F32) {
    return "linear: w must be float32 2-D (or packed) and y 2-D";
  }
  const int64_t N = kTransposed ? wd[0] : wd[1];
  if ((kTransposed ? wd[1] : wd[0]) != K || yd[0] != M || yd[1] != N) {
    return "linear: shapes do not match: x [" + std::to_string(M) + ", " + std::to_string(K) + "], " +
           Dims2("w", wd) + ", " + Dims2("y", yd) + (kTransposed ? " (w is [N, K])" : "");
  }
  out.push_back(Segment{F32Data(w), y->typed_data(), N});
  return "";
}

// y[0:n] += a[0:n] (split-K partials, the residual add).
inline void AddInto(float* y, const float* a, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) Store(y + j, Load(y + j) + Load(a + j));
  for (; j < n; ++j) y[j] += a[j];
}

// Up to kSplitKMaxRows rows (decode and verify): every item is a contiguous run of a weight's rows (all N
// columns), so each thread streams one unbroken range of memory, the access pattern that reaches the machine's
// read bandwidth; x rows go in pairs over each kKUnroll weight rows, which the later pairs find in L1. Column
// blocks striding over every weight row (the earlier design) left one row at 0.8-0.9x XLA's dot and a thread
// near one core's bandwidth. Each item sums into its own partial y (a segment's first chunk into y itself), and
// the caller adds the partials (M x N floats per extra chunk: small next to the weight).
// The limit is cpu.py's SPLIT_K_MAX_ROWS (built in as -DNIGHTJAR_SPLIT_K_MAX_ROWS): 12, where the 8 x 48 tiles
// past 12 rows measured faster than split-K's 6-row passes on a Xeon (whole step 16 rows 51.1-52.5 -> 46.5-47.6 ms,
// 24 rows 68.5-69.0 -> 56.6-56.9; 13 rows the same; README.md); 8 on AMD EPYC (Zen 4) CPUs with AVX-512, where the
// tiles measured faster from 9 rows (whole step, the two in one process: 10 rows 0.905, 12 rows 0.849 of the time).
#ifndef NIGHTJAR_SPLIT_K_MAX_ROWS
#define NIGHTJAR_SPLIT_K_MAX_ROWS 12
#endif
constexpr int64_t kSplitKMaxRows = NIGHTJAR_SPLIT_K_MAX_ROWS;
// With AVX-512 the tied head takes BlockNTx's tiles from this many rows (cpu.py's NT_TILE_MIN_ROWS): past the
// split-K rows, or from 2 rows on AMD EPYC (Zen 4), where they measured faster than TileNT at every row count from 2
// (products alone, the two in turn in one process: 2 rows 0.974, 3 rows 0.958, 5 rows 0.905, 8 rows 0.857 of the
// time; whole decode step at batch 2 / 4 / 8: 0.978 / 0.941 / 0.868; at one row 1.108, so one row kept RowNT2, and
// since 2026-12-04 takes BlockNTFew, whose order of sums 2-8 rows share).
#ifndef NIGHTJAR_NT_TILE_MIN_ROWS
#define NIGHTJAR_NT_TILE_MIN_ROWS (NIGHTJAR_SPLIT_K_MAX_ROWS + 1)
#endif
constexpr int64_t kNtTileMinRows = NIGHTJAR_NT_TILE_MIN_ROWS;
// 2 .. kNtFewRows rows of x take BlockNTFew (a weight vector per 16 elements, every x row against it; 8 elements
// without AVX-512) instead of the tiles: SmolLM2's head alone (AMD EPYC Zen 4, 2026-12-03, medians of 6 rounds in one process)
// float32 3.8 / 4.8 / 6.1 / 6.1 / 6.9 ms at 2 / 3 / 4 / 6 / 8 rows against 5.9 / 6.8 / 6.4 / 6.0 / 6.1 for BlockNTx,
// and from 8-bit rows 1.4 / 1.9 / 2.6 / 3.2 / 4.3 ms against 8.0-9.0 through a buffer for the tiles. One kernel for
// both formats keeps their sums identical.
constexpr int64_t kNtFewRows = 8;
constexpr int64_t kSplitKMinRows = 32;  // weight rows per item at least (a chunk must outweigh its wake-up)

// One split-K item: out [M, N] = x[:, k0:k1] @ W[k0:k1, :].
struct SplitKItem {
  const float* w;
  float* out;  // y itself for a segment's first chunk, else a partial in the plan's scratch
  int64_t N, k0, k1;
  size_t first;  // index of the segment's first item (the one that writes y)
};

// The items of one call over `segments` (all sharing x [M, K]) and the scratch their partials go to.
struct SplitKPlan {
  std::vector<SplitKItem> items;
  std::vector<float> scratch;
};

SplitKPlan PlanSplitK(int64_t M, int64_t K, const std::vector<Segment>& segments, int64_t threads) {
  SplitKPlan plan;
  if (segments.empty()) return plan;  // nothing to compute (M, N or K is 0: y already done)
  const int64_t chunks = std::max<int64_t>(1, std::min(threads, K / kSplitKMinRows));
  const int64_t rows = (K / chunks + kKUnroll - 1) / kKUnroll * kKUnroll;  // weight rows per item
  const int64_t per_segment = (K + rows - 1) / rows;
  int64_t scratch_size = 0;
  for (const Segment& s : segments) scratch_size += (per_segment - 1) * M * s.N;
  plan.scratch.resize(scratch_size);
  float* next = plan.scratch.data();
  for (const Segment& s : segments) {
    const size_t first = plan.items.size();
    for (int64_t k0 = 0; k0 < K; k0 += rows) {
      float* out = k0 == 0 ? s.y : next;
      if (k0 > 0) next += M * s.N;
      plan.items.push_back(SplitKItem{s.w, out, s.N, k0, std::min(K, k0 + rows), first});
    }
  }
  return plan;
}

// One x row over the item's weight rows k .. item.k1 in passes of U rows, two streams (the halves of what is left, a
// pass of each in turn); returns the first row not done (fewer than 2U rows remain).
template <int U>
int64_t OneRowTwoStreams(const float* xp, const SplitKItem& item, int64_t K, int64_t k) {
  const int64_t half = (item.k1 - k) / (2 * U) * U;
  for (const int64_t end = k + half; k < end; k += U) {
    RowsNN<1, U>(xp, item.w, item.out, K, item.N, 0, k, 0, item.N);
    RowsNN<1, U>(xp, item.w, item.out, K, item.N, 0, k + half, 0, item.N);
  }
  return k + half;
}

void ComputeSplitK(const float* xp, int64_t M, int64_t K, const SplitKItem& item) {
  const int64_t N = item.N;
  std::fill(item.out, item.out + M * N, 0.0f);
  int64_t k = item.k0;
  if (M == 1) {
    // 16 weight rows per pass (then 8 for the rest): a y load and store per 16 weight loads; two streams, the
    // remaining rows' halves, a pass of each in turn (as BlockNT's one-row head)
    k = OneRowTwoStreams<16>(xp, item, K, k);
    k = OneRowTwoStreams<8>(xp, item, K, k);
    for (; k + 8 <= item.k1; k += 8) RowsNN<1, 8>(xp, item.w, item.out, K, N, 0, k, 0, N);
  }
  // x rows in groups over the same kKUnroll weight rows (pairs, or up to 6 with AVX-512; the later groups find the
  // weight rows in L1); the first group prefetches 8 weight rows ahead: without it 4-5 rows measured 0.9x XLA's
  // step, with it 1.1x (one row did better without: the hardware streams a single pass on its own)
  for (; k + kKUnroll <= item.k1; k += kKUnroll) {
    bool pf = k + kPrefetchRows + kKUnroll <= item.k1;
    int64_t r0 = 0;
#ifdef __AVX512F__
    // up to 6 x rows per pass (32 vector registers hold their broadcasts): the weight rows and each y row are
    // touched once per pass instead of once per pair
    for (; r0 < M; r0 += 6, pf = false) {
      switch (std::min<int64_t>(6, M - r0)) {
        case 6: RowsNN<6, kKUnroll>(xp, item.w, item.out, K, N, r0, k, 0, N, pf); break;
        case 5: RowsNN<5, kKUnroll>(xp, item.w, item.out, K, N, r0, k, 0, N, pf); break;
        case 4: RowsNN<4, kKUnroll>(xp, item.w, item.out, K, N, r0, k, 0, N, pf); break;
        case 3: RowsNN<3, kKUnroll>(xp, item.w, item.out, K, N, r0, k, 0, N, pf); break;
        case 2: RowsNN<2, kKUnroll>(xp, item.w, item.out, K, N, r0, k, 0, N, pf); break;
        default: RowsNN<1, kKUnroll>(xp, item.w, item.out, K, N, r0, k, 0, N, pf); break;
      }
    }
#else
    for (; r0 + 2 <= M; r0 += 2, pf = false) RowsNN<2, kKUnroll>(xp, item.w, item.out, K, N, r0, k, 0, N, pf);
    if (r0 < M) RowsNN<1, kKUnroll>(xp, item.w, item.out, K, N, r0, k, 0, N, pf);
#endif
  }
  for (; k < item.k1; ++k) {
    int64_t r0 = 0;
    for (; r0 + 2 <= M; r0 += 2) RowsNN<2, 1>(xp, item.w, item.out, K, N, r0, k, 0, N);
    if (r0 < M) RowsNN<1, 1>(xp, item.w, item.out, K, N, r0, k, 0, N);
  }
}

// Adds each segment's partials into its y (written by the segment's first item).
void ReduceSplitK(int64_t M, const SplitKPlan& plan) {
  const auto& items = plan.items;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i != items[i].first) AddInto(items[items[i].first].out, items[i].out, M * items[i].N);
  }
}

ffi::Error RunSplitK(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K,
                     const std::vector<Segment>& segments, int64_t threads) {
  const SplitKPlan plan = PlanSplitK(M, K, segments, threads);
  const SplitKItem* ip = plan.items.data();
  nightjar::ParallelFor(pool, static_cast<int64_t>(plan.items.size()),
                        [=](int64_t it) { ComputeSplitK(xp, M, K, ip[it]); });
  ReduceSplitK(M, plan);
  return ffi::Error::Success();
}

// Column blocks over every segment, taken from one pool: a call with q/k/v (or gate/up) weights wakes the pool
// once, and XLA does not run the products as separate, concurrent custom calls that oversubscribe the cores.
template <bool kTransposed>
ffi::Error RunSegments(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K,
                       const std::vector<Segment>& segments) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());  // ParallelFor: helpers + the caller
  std::vector<Segment> work;  // the products with something to compute (K = 0: y is zeros)
  for (const Segment& s : segments) {
    if (M == 0 || s.N == 0) continue;
    if (K == 0) {
      std::fill(s.y, s.y + M * s.N, 0.0f);
      continue;
    }
    work.push_back(s);
  }
  // panel layouts (transposed: only a tied head's panels for int8 x) on their own items, the rest below
  std::vector<Segment> packed, plain;
  for (const Segment& s : work) (s.packed ? packed : plain).push_back(s);
  if (!packed.empty()) {
    const std::vector<PackedItem> items = PlanPacked(M, packed, threads);
    const PackedItem* ip = items.data();
    SharedQuant sq;
    SharedQuant* sqp = &sq;
    nightjar::ParallelFor(pool, static_cast<int64_t>(items.size()),
                          [=](int64_t it) { PackedProduct(xp, M, K, *ip[it].seg, ip[it].p0, ip[it].p1, sqp); });
    if (plain.empty()) return ffi::Error::Success();
    work = plain;
  }
  if (!kTransposed && M <= kSplitKMaxRows) return RunSplitK(pool, xp, M, K, work, threads);
  int64_t total = 0;
  for (const Segment& s : work) total += s.N;
  struct Item {
    Segment seg;
    int64_t c0, c1;
  };
  std::vector<Item> items;
#ifdef __AVX512F__
  const int64_t nn_width = TileBlockWidth(total, threads);  // Block48's panels (M > kSplitKMaxRows here)
#else
  const int64_t nn_width = BlockWidth(total, threads, 128, 480);
#endif
  const int64_t width = kTransposed ? BlockWidth(total, threads, 64, 4096) : nn_width;
  for (const Segment& s : work) {
    for (int64_t c0 = 0; c0 < s.N; c0 += width) items.push_back(Item{s, c0, std::min(s.N, c0 + width)});
  }
  const Item* ip = items.data();
#ifdef __AVX512F__
  // the transposed tiles past kNtFewRows rows: x^T once, zero-padded to 16-column groups (BlockNTx)
  const int64_t ldxt = kTransposed && M > kNtFewRows && M >= kNtTileMinRows ? (M + 15) / 16 * 16 : 0;
  std::vector<float> xt_store(ldxt * K, 0.0f);
  for (int64_t k = 0; k < (ldxt ? K : 0); ++k) {
    for (int64_t m = 0; m < M; ++m) xt_store[k * ldxt + m] = xp[m * K + k];
  }
  const float* xt = xt_store.data();
#endif
  nightjar::ParallelFor(pool, static_cast<int64_t>(items.size()), [=](int64_t it) {
    const Item& item = ip[it];
#ifdef NIGHTJAR_V16
    // 1 .. kNtFewRows rows: one sum per x row and weight row, so one row gets the bits of any other count (until
    // 2026-12-04 one row took four sums per weight row, RowNT2Q8: ~7e-6 apart in SmolLM2's logits; now the head's
    // two chains per pass cost the batch-1 step ~2-3%, measured interleaved)
    if (kTransposed && M <= kNtFewRows) {
      const int64_t K_ = K;
      if (item.seg.q8 != nullptr) {  // 8-bit rows (the float32 table beside them is for more rows)
        const uint8_t* wq = item.seg.q8;
        const int64_t row_bytes = K / kQ8Rows * kQ8BlockBytes;
        BlockNTFew(xp, M, K, item.seg.N, item.c0, item.c1, item.seg.y,
                   [=](int64_t n, int64_t k) { return LoadQ8(wq + n * row_bytes, k); },
                   [](int64_t, int64_t) { return 0.0f; });
      } else {
        const float* w = item.seg.w;
        BlockNTFew(xp, M, K, item.seg.N, item.c0, item.c1, item.seg.y,
                   [=](int64_t n, int64_t k) { return LoadRow(w + n * K_ + k); },
                   [=](int64_t n, int64_t k) { return w[n * K_ + k]; });
      }
      return;
    }
#endif
    if (kTransposed && item.seg.q8 != nullptr && (item.seg.w == nullptr || M <= kNtFewRows)) {
#ifdef __AVX512F__
      BlockNTQ8(xp, xt, ldxt, item.seg.q8, item.seg.y, M, K, item.seg.N, item.c0, item.c1);
#else
      BlockNTQ8(xp, nullptr, 0, item.seg.q8, item.seg.y, M, K, item.seg.N, item.c0, item.c1);
#endif
      return;
    }
#ifdef __AVX512F__
    if (kTransposed && ldxt > 0) {
      BlockNTx(xt, ldxt, item.seg.w, item.seg.y, M, K, item.seg.N, item.c0, item.c1);
      return;
    }
#endif
    if (kTransposed) BlockNT(xp, item.seg.w, item.seg.y, M, K, item.seg.N, item.c0, item.c1);
    else {
#ifdef __AVX512F__
      // whole 48-column panels on the register tile, the rest (N not a multiple of 48) on the packed path
      const int64_t c48 = item.c0 + (item.c1 - item.c0) / 48 * 48;
      Block48(xp, item.seg.w, item.seg.y, item.seg.N, 0, M, K, item.seg.N, item.c0, c48);
      if (c48 < item.c1) BlockNN(xp, item.seg.w, item.seg.y, M, K, item.seg.N, c48, item.c1);
#else
      BlockNN(xp, item.seg.w, item.seg.y, M, K, item.seg.N, item.c0, item.c1);
#endif
    }
  });
  return ffi::Error::Success();
}

using In = ffi::Buffer<ffi::F32>;
using Out = ffi::Result<ffi::Buffer<ffi::F32>>;

// xp [M, K] (checked by the caller) times each product's weight into its output, shapes checked.
template <bool kTransposed>
ffi::Error RunProducts(ffi::ThreadPool& pool, const float* xp, int64_t M, int64_t K,
                       std::initializer_list<std::pair<W*, Out*>> products) {
  std::vector<Segment> segments;
  for (const auto& [w, y] : products) {
    const std::string error = AddSegment<kTransposed>(M, K, *w, *y, segments);
    if (!error.empty()) return ffi::Error::InvalidArgument(error);
  }
  return RunSegments<kTransposed>(pool, xp, M, K, segments);
}

template <bool kTransposed>
ffi::Error Run(ffi::ThreadPool& pool, In& x, std::initializer_list<std::pair<W*, Out*>> products) {
  if (x.dimensions().size() != 2) return ffi::Error::InvalidArgument("linear: x must be 2-D");
  return RunProducts<kTransposed>(pool, x.typed_data(), x.dimensions()[0], x.dimensions()[1], products);
}

// xn [M, K] = RMSNorm(x) * gain row by row, with the model's float32 order of operations.
void RmsNormRows(const float* xp, const float* g, int64_t M, int64_t K, float eps, float* xn) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = xp + r * K;
    v8 acc = Splat(0.0f);
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) acc += Load(xr + k) * Load(xr + k);
    float ss = Sum(acc);
    for (; k < K; ++k) ss += xr[k] * xr[k];
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(K > 0 ? K : 1) + eps);
    for (k = 0; k < K; ++k) xn[r * K + k] = xr[k] * inv * g[k];
  }
}

// x [M, K] and gain [K] checked; xn = RMSNorm(x) * gain.
std::string RmsNorm(In& x, const W& gain, float eps, std::vector<float>& xn) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return "rms_linear: x must be 2-D";
  const int64_t M = xd[0], K = xd[1];
  if (std::string e = CheckGain(gain, K, "rms_linear (gain [K] for x [M, K])"); !e.empty()) return e;
  xn.resize(M * K);
  RmsNormRows(x.typed_data(), gain.typed_data(), M, K, eps, xn.data());
  return "";
}

ffi::Error RmsLinear(ffi::ThreadPool& pool, In& x, const W& gain, float eps,
                     std::initializer_list<std::pair<W*, Out*>> products) {
  std::vector<float> xn;
  std::string error = RmsNorm(x, gain, eps, xn);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  return RunProducts<false>(pool, xn.data(), x.dimensions()[0], x.dimensions()[1], products);
}

using B = ffi::AnyBuffer;  // a weight or gain operand as bound; Views makes its view

#define NJ_VIEWS(...)                                            \
  std::vector<View> v;                                           \
  if (std::string e = Views(layers, {__VA_ARGS__}, v); !e.empty()) \
    return ffi::Error::InvalidArgument(e);

ffi::Error RmsLinear2(ffi::ThreadPool pool, In x, B gain, B w1, B w2, Out y1, Out y2, float eps, Layers layers) {
  NJ_VIEWS(&gain, &w1, &w2)
  return RmsLinear(pool, x, v[0], eps, {{&v[1], &y1}, {&v[2], &y2}});
}
ffi::Error RmsLinear3(ffi::ThreadPool pool, In x, B gain, B w1, B w2, B w3, Out y1, Out y2, Out y3, float eps,
                      Layers layers) {
  NJ_VIEWS(&gain, &w1, &w2, &w3)
  return RmsLinear(pool, x, v[0], eps, {{&v[1], &y1}, {&v[2], &y2}, {&v[3], &y3}});
}

// h = silu(RMSNorm(x) @ W_gate) * (RMSNorm(x) @ W_up): both products in one pass over the pool, then the gate.
ffi::Error RmsSwiGluImpl(ffi::ThreadPool& pool, In& x, const W& gain, const W& wg, const W& wu, Out& h, float eps) {
  std::vector<float> xn;
  std::string error = RmsNorm(x, gain, eps, xn);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1];
  const auto gd = wg.dimensions(), ud = wu.dimensions(), hd = h->dimensions();
  const WeightDims gdims = DimsOf(wg), udims = DimsOf(wu);
  if (gd.size() == 3 || ud.size() == 3) {  // packed panels (either format)
    if (!kPackedSupported) return ffi::Error::InvalidArgument("rms_swiglu: packed weights need AVX-512");
    if (!gdims.packed || !udims.packed || hd.size() != 2 || gdims.n != udims.n || gdims.k != K || udims.k != K ||
        hd[0] != M || hd[1] != gdims.n) {
      return ffi::Error::InvalidArgument("rms_swiglu: shapes do not match: x [" + std::to_string(M) + ", " +
                                         std::to_string(K) + "], packed " + Dims2("w_gate", gd) + ", " +
                                         Dims2("w_up", ud) + ", " + Dims2("h", hd) +
                                         " (w_gate and w_up float32 / bfloat16 [N / 16, K, 16] or uint8 "
                                         "[N / 16, K / 32, 384], h [M, N])");
    }
    const int64_t N = gdims.n;
    float* hp = h->typed_data();
    if (M == 0 || N == 0) return ffi::Error::Success();
    std::vector<float> gate(M * N), up(M * N);
    // items of the same panels of both weights, each applying the gate to its columns
    const Segment sg = PanelSegment(wg, gate.data(), N), su = PanelSegment(wu, up.data(), N);
    const std::vector<PackedItem> items = PlanPacked(M, {sg}, std::max<int64_t>(1, pool.num_threads()));
    const PackedItem* ip = items.data();
    const float* xp = xn.data();
    SharedQuant sq;
    SharedQuant* sqp = &sq;
    nightjar::ParallelFor(pool, static_cast<int64_t>(items.size()), [=, &sg, &su](int64_t it) {
      PackedSwiGluItem(xp, M, K, sg, su, hp, ip[it].p0, ip[it].p1, sqp);  // K = 0: zero products, h = 0
    });
    return ffi::Error::Success();
  }
  if (gdims.k < 0 || udims.k < 0 || hd.size() != 2 || gd[0] != K || ud[0] != K || gd[1] != ud[1] ||
      hd[0] != M || hd[1] != gd[1]) {
    return ffi::Error::InvalidArgument("rms_swiglu: shapes do not match: x [" + std::to_string(M) + ", " +
                                       std::to_string(K) + "], " + Dims2("w_gate", gd) + ", " + Dims2("w_up", ud) +
                                       ", " + Dims2("h", hd) + " (w_gate and w_up [K, N], h [M, N])");
  }
  const int64_t N = gd[1];
#ifdef __AVX512F__
  if (M > kSplitKMaxRows && N % 48 == 0 && K > 0) {
    // 8 x 48 tiles: items of whole panels compute their columns of both products into per-thread buffers and
    // apply the gate there, so the gate runs on every thread and no M x N temporaries are filled (as a separate
    // step on the calling thread it cost ~0.25 ms of a ~1 ms layer at 32 rows)
    const int64_t threads = std::max<int64_t>(1, pool.num_threads());
    const int64_t width = TileBlockWidth(N, threads);
    const float* xp = xn.data();
    const float* gw = F32Data(wg);
    const float* uw = F32Data(wu);
    float* hp = h->typed_data();
    nightjar::ParallelFor(pool, (N + width - 1) / width, [=](int64_t it) {
      const int64_t c0 = it * width, c1 = std::min(N, c0 + width), cols = c1 - c0;
      thread_local std::vector<float> g, u;
      g.resize(M * cols);
      u.resize(M * cols);
      Block48(xp, gw, g.data(), cols, c0, M, K, N, c0, c1);
      Block48(xp, uw, u.data(), cols, c0, M, K, N, c0, c1);
      for (int64_t r = 0; r < M; ++r) {
        float* hr = hp + r * N + c0;
        const float* gr = g.data() + r * cols;
        const float* ur = u.data() + r * cols;
        for (int64_t c = 0; c < cols; ++c) hr[c] = nightjar::Silu(gr[c]) * ur[c];
      }
    });
    return ffi::Error::Success();
  }
#endif
  std::vector<float> gate(M * N), up(M * N);  // RunSegments skips empty products and zero-fills K = 0
  const std::vector<Segment> products = {Segment{F32Data(wg), gate.data(), N}, Segment{F32Data(wu), up.data(), N}};
  ffi::Error run = RunSegments<false>(pool, xn.data(), M, K, products);
  if (run.failure()) return run;
  float* hp = h->typed_data();
  for (int64_t i = 0; i < M * N; ++i) hp[i] = nightjar::Silu(gate[i]) * up[i];  // vectorizes (no libm call)
  return ffi::Error::Success();
}

ffi::Error RmsSwiGlu(ffi::ThreadPool pool, In x, B gain, B wg, B wu, Out h, float eps, Layers layers) {
  NJ_VIEWS(&gain, &wg, &wu)
  return RmsSwiGluImpl(pool, x, v[0], v[1], v[2], h, eps);
}

// y = r + x @ W (the residual add of o_proj and down_proj).
ffi::Error LinearResidual(ffi::ThreadPool pool, In x, B wb, In r, Out y, Layers layers) {
  NJ_VIEWS(&wb)
  W& w = v[0];
  if (x.dimensions().size() != 2) return ffi::Error::InvalidArgument("linear_residual: x must be 2-D");
  const auto rd = r.dimensions(), yd = y->dimensions();
  if (rd.size() != 2 || rd[0] != yd[0] || rd[1] != yd[1]) {
    return ffi::Error::InvalidArgument("linear_residual: r must have y's shape; got " + Dims2("r", rd) + ", " +
                                       Dims2("y", yd));
  }
  ffi::Error run = Run<false>(pool, x, {{&w, &y}});
  if (run.failure()) return run;
  AddInto(y->typed_data(), r.typed_data(), yd[0] * yd[1]);
  return ffi::Error::Success();
}

// The next layer's pre-attention norm and q/k/v, when a call also runs them (AttnOutMlpQkv).
struct NextQkv {
  const W* gain;
  W* w[3];
  Out* y[3];
  float eps;
};

// The rest of a decoder layer after attention, in one call:
//   r1 = r + a @ W_o;  y = r1 + W_down(silu(RMSNorm(r1) @ W_gate) * (RMSNorm(r1) @ W_up))
// and, with `next`, the next layer's q/k/v = RMSNorm'(y) @ W_q, W_k, W_v; as phases of one ParallelPhases
// (o_proj split-K items; the residual add and the norm; gate/up items; the gate; down_proj items and the residual
// add; [the next norm; q/k/v items; their partials]): the pool is woken once per layer instead of four times, and
// between the dependent products the threads spin instead of going back to the pool.
ffi::Error AttnOutMlpImpl(ffi::ThreadPool& pool, In& a, In& r, W& wo, const W& gain, W& wg, W& wu, W& wd, Out& y,
                          float eps, const NextQkv* next) {
  if (gain.element_type() != ffi::DataType::F32) {
    return ffi::Error::InvalidArgument("attn_out_mlp: gain must be float32; got " + Dims2("gain", gain.dimensions()));
  }
  const auto ad = a.dimensions(), rd = r.dimensions(), od = wo.dimensions(), gd = gain.dimensions(),
             gwd = wg.dimensions(), ud = wu.dimensions(), dd = wd.dimensions(), yd = y->dimensions();
  const WeightDims o = DimsOf(wo), g = DimsOf(wg), u = DimsOf(wu), dn = DimsOf(wd);
  const bool ranks = ad.size() == 2 && rd.size() == 2 && o.k >= 0 && gd.size() == 1 && g.k >= 0 && u.k >= 0 &&
                     dn.k >= 0 && yd.size() == 2;
  if (!ranks || o.k != ad[1] || rd[0] != ad[0] || rd[1] != o.n || gd[0] != rd[1] || g.k != rd[1] || u.k != g.k ||
      u.n != g.n || dn.k != g.n || dn.n != rd[1] || yd[0] != rd[0] || yd[1] != rd[1]) {
    return ffi::Error::InvalidArgument(
        "attn_out_mlp: shapes do not match: " + Dims2("a", ad) + ", " + Dims2("r", rd) + ", " + Dims2("w_o", od) +
        ", " + Dims2("gain", gd) + ", " + Dims2("w_gate", gwd) + ", " + Dims2("w_up", ud) + ", " +
        Dims2("w_down", dd) + ", " + Dims2("y", yd) +
        " (a [M, A], r and y [M, H], w_o [A, H], gain [H], w_gate and w_up [H, I], w_down [I, H]; a weight [K, N] "
        "may be packed as [N / 16, K, 16])");
  }
  const bool packed = o.packed;
  if (g.packed != packed || u.packed != packed || dn.packed != packed) {
    return ffi::Error::InvalidArgument("attn_out_mlp: the weights must be all packed [N / 16, K, 16] or all [K, N]");
  }
  const int64_t M = ad[0], A = ad[1], H = rd[1], I = g.n;
  std::vector<Segment> qkv;  // the next layer's products (x = RMSNorm'(y) [M, H])
  if (next != nullptr) {
    const auto nd = next->gain->dimensions();
    if (nd.size() != 1 || nd[0] != H || next->gain->element_type() != ffi::DataType::F32) {
      return ffi::Error::InvalidArgument("attn_out_mlp_qkv: the next norm's gain must be [H] = [" +
                                         std::to_string(H) + "]; got " + Dims2("gain", nd));
    }
    for (int i = 0; i < 3; ++i) {
      std::vector<Segment> one;
      const std::string error = AddSegment<false>(M, H, *next->w[i], *next->y[i], one);
      if (!error.empty()) return ffi::Error::InvalidArgument("attn_out_mlp_qkv: next q/k/v: " + error);
      if (one[0].packed != packed) {
        return ffi::Error::InvalidArgument(
            "attn_out_mlp_qkv: the next q/k/v must be packed [N / 16, K, 16] exactly when the layer's weights are");
      }
      if (one[0].N > 0) qkv.push_back(one[0]);
    }
  }
  float* yp = y->typed_data();
  if (M == 0 || H == 0) {
    for (const Segment& s : qkv) std::fill(s.y, s.y + M * s.N, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  std::vector<float> xn(M * H), gate(M * I), up(M * I), h(M * I), down(M * H), xn2(next ? M * H : 0);
  // A or I = 0: that plan has no items and its outputs stay zero (y then gets r alone); with H > 0 every q/k/v
  // output is written by its first item
  std::fill(yp, yp + M * H, 0.0f);
  if (packed) {
    // panel items (no partial sums): o_proj; the residual add and the norm; gate and up over the same panels, each
    // item applying the gate to its columns; down_proj; the residual add [and the next norm; q/k/v]
    const std::vector<Segment> so = {PanelSegment(wo, yp, H)};
    const std::vector<Segment> sg = {PanelSegment(wg, gate.data(), I)};
    const std::vector<Segment> su = {PanelSegment(wu, up.data(), I)};
    const std::vector<Segment> sd = {PanelSegment(wd, down.data(), H)};
    const std::vector<PackedItem> io = PlanPacked(M, so, threads), igu = PlanPacked(M, sg, threads),
                                  id = PlanPacked(M, sd, threads), iq = PlanPacked(M, qkv, threads);
    const float* ap = a.typed_data();
    const float* rp = r.typed_data();
    const float* gp = gain.typed_data();
    float* hp = h.data();
    SharedQuant quant[4];  // int8-activation weights: each product's x quantized once (a, norm, h, next norm)
    std::vector<nightjar::Phase> phases = {
        {A > 0 ? static_cast<int64_t>(io.size()) : 0,
         [&](int64_t it) { PackedProduct(ap, M, A, *io[it].seg, io[it].p0, io[it].p1, &quant[0]); }},
        {1, [&](int64_t) {
           AddInto(yp, rp, M * H);  // y = r1
           RmsNormRows(yp, gp, M, H, eps, xn.data());
         }},
        {I > 0 ? static_cast<int64_t>(igu.size()) : 0,
         [&](int64_t it) { PackedSwiGluItem(xn.data(), M, H, sg[0], su[0], hp, igu[it].p0, igu[it].p1, &quant[1]); }},
        {I > 0 ? static_cast<int64_t>(id.size()) : 0,
         [&](int64_t it) { PackedProduct(hp, M, I, *id[it].seg, id[it].p0, id[it].p1, &quant[2]); }},
        {1, [&](int64_t) {
           AddInto(yp, down.data(), M * H);
           if (next != nullptr) RmsNormRows(yp, next->gain->typed_data(), M, H, next->eps, xn2.data());
         }},
    };
    if (next != nullptr) {
      phases.push_back({static_cast<int64_t>(iq.size()),
                        [&](int64_t it) {
                          PackedProduct(xn2.data(), M, H, *iq[it].seg, iq[it].p0, iq[it].p1, &quant[3]);
                        }});
    }
    nightjar::ParallelPhases(pool, phases);
    return ffi::Error::Success();
  }
  auto plan_for = [&](int64_t K, std::vector<Segment> segments) {
    if (K == 0) segments.clear();
    return PlanSplitK(M, K, segments, threads);
  };
  const SplitKPlan po = plan_for(A, {Segment{F32Data(wo), yp, H}});
  const SplitKPlan pgu = plan_for(H, I == 0 ? std::vector<Segment>{}
                                             : std::vector<Segment>{Segment{F32Data(wg), gate.data(), I},
                                                                    Segment{F32Data(wu), up.data(), I}});
  const SplitKPlan pd = plan_for(I, {Segment{F32Data(wd), down.data(), H}});
  const SplitKPlan pq = plan_for(H, qkv);
  const float* ap = a.typed_data();
  const float* rp = r.typed_data();
  const float* gp = gain.typed_data();
  std::vector<nightjar::Phase> phases = {
      {static_cast<int64_t>(po.items.size()), [&](int64_t it) { ComputeSplitK(ap, M, A, po.items[it]); }},
      {1, [&](int64_t) {
         ReduceSplitK(M, po);
         AddInto(yp, rp, M * H);  // y = r1
         RmsNormRows(yp, gp, M, H, eps, xn.data());
       }},
      {static_cast<int64_t>(pgu.items.size()), [&](int64_t it) { ComputeSplitK(xn.data(), M, H, pgu.items[it]); }},
      {1, [&](int64_t) {
         ReduceSplitK(M, pgu);
         for (int64_t i = 0; i < M * I; ++i) h[i] = nightjar::Silu(gate[i]) * up[i];
       }},
      {static_cast<int64_t>(pd.items.size()), [&](int64_t it) { ComputeSplitK(h.data(), M, I, pd.items[it]); }},
      {1, [&](int64_t) {
         ReduceSplitK(M, pd);
         AddInto(yp, down.data(), M * H);
         if (next != nullptr) RmsNormRows(yp, next->gain->typed_data(), M, H, next->eps, xn2.data());
       }},
  };
  if (next != nullptr) {
    phases.push_back({static_cast<int64_t>(pq.items.size()),
                      [&](int64_t it) { ComputeSplitK(xn2.data(), M, H, pq.items[it]); }});
    phases.push_back({1, [&](int64_t) { ReduceSplitK(M, pq); }});
  }
  nightjar::ParallelPhases(pool, phases);
  return ffi::Error::Success();
}

ffi::Error AttnOutMlp(ffi::ThreadPool pool, In a, In r, B wo, B gain, B wg, B wu, B wd, Out y, float eps,
                      Layers layers) {
  NJ_VIEWS(&wo, &gain, &wg, &wu, &wd)
  return AttnOutMlpImpl(pool, a, r, v[0], v[1], v[2], v[3], v[4], y, eps, nullptr);
}

// AttnOutMlp, then the next layer's q/k/v from RMSNorm(y) with its gain (attr eps_next).
ffi::Error AttnOutMlpQkv(ffi::ThreadPool pool, In a, In r, B wo, B gain, B wg, B wu, B wd, B gain_next, B wq,
                         B wk, B wv, Out y, Out q, Out k, Out v_out, float eps, float eps_next, Layers layers) {
  NJ_VIEWS(&wo, &gain, &wg, &wu, &wd, &gain_next, &wq, &wk, &wv)
  const NextQkv next{&v[5], {&v[6], &v[7], &v[8]}, {&q, &k, &v_out}, eps_next};
  return AttnOutMlpImpl(pool, a, r, v[0], v[1], v[2], v[3], v[4], y, eps, &next);
}

template <bool kTransposed>
ffi::Error Linear1(ffi::ThreadPool pool, In x, B w, Out y, Layers layers) {
  NJ_VIEWS(&w)
  return Run<kTransposed>(pool, x, {{&v[0], &y}});
}
ffi::Error Linear2(ffi::ThreadPool pool, In x, B w1, B w2, Out y1, Out y2, Layers layers) {
  NJ_VIEWS(&w1, &w2)
  return Run<false>(pool, x, {{&v[0], &y1}, {&v[1], &y2}});
}
ffi::Error Linear3(ffi::ThreadPool pool, In x, B w1, B w2, B w3, Out y1, Out y2, Out y3, Layers layers) {
  NJ_VIEWS(&w1, &w2, &w3)
  return Run<false>(pool, x, {{&v[0], &y1}, {&v[1], &y2}, {&v[2], &y3}});
}

#undef NJ_VIEWS

}  // namespace

#define NJ_X .Arg<ffi::Buffer<ffi::F32>>()
#define NJ_W .Arg<ffi::AnyBuffer>()
#define NJ_Y .Ret<ffi::Buffer<ffi::F32>>()
#define NJ_LAYERS .Attr<ffi::Span<const int64_t>>("layers")

// NJ_W: a weight or gain operand (any dtype; a view of it per `layers`)
#define NJ_BIND ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjLinearF32, (Linear1<false>), NJ_BIND NJ_X NJ_W NJ_Y NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjLinearNtF32, (Linear1<true>), NJ_BIND NJ_X NJ_W NJ_Y NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjLinear2F32, Linear2, NJ_BIND NJ_X NJ_W NJ_W NJ_Y NJ_Y NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjLinear3F32, Linear3, NJ_BIND NJ_X NJ_W NJ_W NJ_W NJ_Y NJ_Y NJ_Y NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjRmsLinear2F32, RmsLinear2,
                              NJ_BIND NJ_X NJ_W NJ_W NJ_W NJ_Y NJ_Y.Attr<float>("eps") NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjRmsLinear3F32, RmsLinear3,
                              NJ_BIND NJ_X NJ_W NJ_W NJ_W NJ_W NJ_Y NJ_Y NJ_Y.Attr<float>("eps") NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjRmsSwiGluF32, RmsSwiGlu,
                              NJ_BIND NJ_X NJ_W NJ_W NJ_W NJ_Y.Attr<float>("eps") NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjAttnOutMlpF32, AttnOutMlp,
                              NJ_BIND NJ_X NJ_X NJ_W NJ_W NJ_W NJ_W NJ_W NJ_Y.Attr<float>("eps") NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjAttnOutMlpQkvF32, AttnOutMlpQkv,
                              NJ_BIND NJ_X NJ_X NJ_W NJ_W NJ_W NJ_W NJ_W NJ_W NJ_W NJ_W NJ_W NJ_Y NJ_Y NJ_Y NJ_Y
                                  .Attr<float>("eps").Attr<float>("eps_next") NJ_LAYERS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(NjLinearResidualF32, LinearResidual, NJ_BIND NJ_X NJ_W NJ_X NJ_Y NJ_LAYERS);
