// Split-K decode attention over PQ codes (flash-decoding), GQA-aware, on tensor cores.
//
// CTA = (KV head x group of <= 8 query heads, one of num_ctas): it loads the head's
// codebooks into shared memory once, then takes the (request, split) items blockIdx.x,
// + num_ctas, ... in turn (num_ctas CTAs per head group fill the GPU once; a CTA per item
// reloaded the codebooks, as many bytes as a 1K-token split's codes, for every item). Its
// warps take 32-token chunks of the item's split. The codes of a KV head are read once
// for all its query heads: scores are S = K^ Q^T with K^ dequantized from the codebook
// straight into mma.m16n8k16 A fragments (16 tokens x 16 dims, 8 query heads as N), and
// O^T += V^T P with V^ dequantized into A fragments through the transposed V page layout.
// With LUT (one query head per KV head only) scores are instead sums of M entries of a
// per-query table q_m . centroid, built in shared memory in place of the K codebook:
// M 4-byte lookups per token instead of M (D/M)-element lookups and idle MMA columns.
//
// Fragment bookkeeping (lane = 4 r + c):
// * Head dims are permuted for Q.K (a sum over dims): in k-step j thread c holds logical
//   dims c*D/4 + 4j + {0..3}, i.e. whole subspaces c*M/4 .. of one token, read with one
//   vector load of its M/4 codes.
// * Tokens are permuted inside a 32-token chunk (a sum over tokens): PV k-index kk of
//   half h is token 8*(kk%8/2) + 4h + 2*(kk/8) + kk%2, so a thread's PV columns are 4
//   consecutive tokens: one 32-bit load of V codes per owned subspace (8q + r).
// * Output dims are permuted back at the end: tile (q, u) rows r / r+8 are dims
//   (8q + r) * D/M + 2u + {0, 1}.
// Scores go through exp2 with scale*log2(e); partial results are normalized with their
// log2-sum-exp and merged by reduce_kernel. The last split with codes also reads the
// full-precision window store (its own CTAs would each reserve the codebooks' shared memory
// for nothing).
#pragma once

#include <math_constants.h>

#include <type_traits>

#include "pq_common.cuh"

namespace pq {

constexpr int kChunk = 32;
constexpr int kHeadsPerCta = 8;
constexpr float kLog2e = 1.4426950408889634f;

// MK / MV: K and V subspaces per head (K and V may have different bit rates).
template <typename T, int D, int MK, int MV>
struct DecodeCfg {
  static constexpr int DSK = D / MK;  // dims per K subspace
  static constexpr int DSV = D / MV;  // dims per V subspace
  static constexpr int KQ = D / 4;    // K dims per lane quarter
  static constexpr int KW = KQ / 2;   // 32-bit words per token for K
  static constexpr int MQ = MK / 4;   // K subspaces (code bytes) per lane quarter
  static constexpr int VSUB = MV / 8; // V subspaces owned per lane (8q + r)
  static constexpr int DWK = DSK / 2; // words per K centroid
  static constexpr int DWV = DSV / 2; // words per V centroid
  static constexpr int NT = D / 16;   // m16 tiles of output dims
  static constexpr bool kCbSmem = D <= 128;
  // 12 warps without prefetching the next chunk's codes (<= 168 registers) hide latency
  // better than 8 with it (246-251 registers): at 4 bits 0.86x FA3 instead of 0.85x at
  // 1K x 64, 1.33x instead of 1.16x at 32K x 8; 16 warps (128 registers, small spills)
  // were within 2% of 12 (eval/results/decode_variants_h200.json). head_dim 256 keeps 8:
  // its codebooks stay in global memory and its fragments need the registers.
  static constexpr int kWarps = D <= 128 ? 12 : 8;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr bool kPrefetch = false;
  static constexpr int kCbBytes = 2 * kCentroids * D * (int)sizeof(T);
  static constexpr int kRedBytes = kWarps * kHeadsPerCta * (D + 2) * (int)sizeof(float);
  // the codebooks stay for the next item: the cross-warp reduction has its own region
  static constexpr int kRedOffset = kCbSmem ? kCbBytes : 0;
  static constexpr int kSmem = kRedOffset + kRedBytes;
  static_assert(DSK >= 2 && DSK <= 8 && DSV >= 2 && DSV <= 8 && D % 16 == 0 && MK % 8 == 0 &&
                MV % 8 == 0, "unsupported D/M");
  static_assert(VSUB * DWV == NT, "tiles");
};

// Shared-memory codebook layouts, in units of UW 32-bit words (a centroid, or one LUT
// entry). Random codes make lookups land on random banks; confining the lanes that look
// up together to a few banks lowers the expected conflict degree. K and LUT: lane quarter
// c reads subspaces c*MQ .., so quarter c gets a quarter of each 128-byte row. V (DS = 2
// only): lane row r reads subspaces 8q + r, so r gets an eighth. Both are permutations of
// [subspace][code].
template <int UW, int MQ>
__device__ __forceinline__ int quarter_unit(int sub, int code) {
  constexpr int row_units = 32 / UW, g = row_units / 4;
  return ((sub % MQ) * (kCentroids / g) + code / g) * row_units + (sub / MQ) * g + code % g;
}

template <class C>
__device__ __forceinline__ int k_unit(int sub, int code) {
  return quarter_unit<C::DWK, C::MQ>(sub, code);
}

template <class C>
__device__ __forceinline__ int v_unit(int sub, int code) {
  if constexpr (C::DWV > 1) {
    return sub * kCentroids + code;
  } else {
    constexpr int g = 4;  // 32 units a row, 8 groups
    return ((sub / 8) * (kCentroids / g) + code / g) * 32 + (sub % 8) * g + code % g;
  }
}

// The code bytes a lane needs for one 32-token chunk.
template <class C>
struct ChunkCodes {
  uint32_t k[2][2][(C::MQ + 3) / 4];  // [half][row r | r+8][bytes]
  uint32_t v[2][C::VSUB];             // [half][owned subspace]: tokens 8c+4h .. +3
};

__device__ __forceinline__ int k_token(int half, int r) { return 8 * (r >> 1) + 4 * half + (r & 1); }

// Dynamic shared memory: the codebooks while scoring, then the cross-warp reduction.
// Lookups address it through this symbol so that they compile to shared-memory loads
// (through a pointer that may also be global they would be generic loads).
extern __shared__ __align__(16) uint8_t pq_smem[];

template <typename T, int D, int MK, int MV>
struct DecodeCta {
  using C = DecodeCfg<T, D, MK, MV>;
  const DecodeArgs& a;
  int req, hkv, r, c;
  const int32_t* bt;
  const T* kcb;  // this head's codebooks in global memory, [MK][256][DSK], [MV][256][DSV]
  const T* vcb;
  const T* wk;   // this request's window rows [W][D]
  const T* wv;
  int win_base;  // position of window slot 0

  __device__ const uint8_t* region(int t0) const {
    const int page = bt[t0 / a.pages.block_size];
    return a.pages.base + (int64_t)page * a.pages.block_stride + (int64_t)hkv * a.pages.head_stride;
  }

  __device__ void load_codes(int t0, ChunkCodes<C>& cc) const {
    const uint8_t* reg = region(t0);
    const int off0 = t0 % a.pages.block_size;
    const PageLayout& L = a.pages.lay;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = off0 + k_token(h, r) + 2 * e;
        load_bytes<C::MQ>(reg + L.k_off + tok * L.k_tok + c * C::MQ, cc.k[h][e]);
      }
#pragma unroll
      for (int q = 0; q < C::VSUB; ++q)
        cc.v[h][q] = *reinterpret_cast<const uint32_t*>(
            reg + L.v_off + (8 * q + r) * L.v_sub + off0 + 8 * c + 4 * h);
    }
  }

  // K of one token, this lane's quarter of the dims, as packed pairs.
  template <bool WIN>
  __device__ void fetch_k(const ChunkCodes<C>& cc, int h, int e, int pos, uint32_t (&w)[C::KW]) const {
    if constexpr (WIN) {
      load_words<C::KW>(wk + (int64_t)win_slot(pos) * D + c * C::KQ, w);
    } else {
#pragma unroll
      for (int mm = 0; mm < C::MQ; ++mm) {
        const int code = byte_of(cc.k[h][e], mm);
        uint32_t cw[C::DWK];
        const int sub = c * C::MQ + mm;
        load_words<C::DWK>(k_book() + (C::kCbSmem ? k_unit<C>(sub, code) : sub * kCentroids + code) * C::DSK, cw);
#pragma unroll
        for (int u = 0; u < C::DWK; ++u) w[mm * C::DWK + u] = cw[u];
      }
    }
  }

  // V of token `pos` in owned subspace q (dims (8q + r) * DS ..): byte k of `codes`, or
  // its window row; zero for a window position that does not count (`valid`), whose row
  // may hold anything.
  template <bool WIN>
  __device__ void fetch_v(uint32_t codes, int q, int k, int pos, bool valid, uint32_t (&w)[C::DWV]) const {
    const int s = 8 * q + r;
    if constexpr (WIN) {
      if (valid) {
        load_words<C::DWV>(wv + (int64_t)win_slot(pos) * D + s * C::DSV, w);
      } else {
#pragma unroll
        for (int u = 0; u < C::DWV; ++u) w[u] = 0u;
      }
    } else {
      const int code = (codes >> (8 * k)) & 0xff;
      load_words<C::DWV>(v_book() + (C::kCbSmem ? v_unit<C>(s, code) : s * kCentroids + code) * C::DSV, w);
    }
  }

  // The codebooks into shared memory in the lookup layouts. A 16-byte piece of the global
  // [sub][code][DS] array is whole centroids of one subspace that k_unit / v_unit keep
  // contiguous and 16-byte aligned, so every piece is one asynchronous copy, all in flight
  // at once (the caller waits). With LUT the K part is each request's Q.centroid table
  // (build_lut) instead.
  template <bool LUT>
  __device__ void load_books() const {
    T* s = reinterpret_cast<T*>(pq_smem);
    if constexpr (!LUT) {
      constexpr int per = 16 / (2 * C::DSK);  // centroids per piece
      for (int u = threadIdx.x * per; u < MK * kCentroids; u += C::kThreads * per)
        cp_async16(s + k_unit<C>(u / kCentroids, u % kCentroids) * C::DSK, kcb + u * C::DSK);
    }
    constexpr int per = 16 / (2 * C::DSV);
    for (int u = threadIdx.x * per; u < MV * kCentroids; u += C::kThreads * per)
      cp_async16(s + kCentroids * D + v_unit<C>(u / kCentroids, u % kCentroids) * C::DSV, vcb + u * C::DSV);
  }

  __device__ void build_lut(const T* qh) const {
    for (int u = threadIdx.x; u < MK * kCentroids; u += C::kThreads) {
      const int sub = u / kCentroids, code = u % kCentroids;
      uint32_t w[C::DWK];
      load_words<C::DWK>(kcb + u * C::DSK, w);
      const T* cen = reinterpret_cast<const T*>(w);
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < C::DSK; ++i) dot += Elem<T>::to_float(qh[sub * C::DSK + i]) * Elem<T>::to_float(cen[i]);
      reinterpret_cast<float*>(pq_smem)[quarter_unit<1, C::MQ>(sub, code)] = dot;
    }
  }

  __device__ const T* k_book() const {
    if constexpr (C::kCbSmem) return reinterpret_cast<const T*>(pq_smem);
    else return kcb;
  }
  __device__ const T* v_book() const {
    if constexpr (C::kCbSmem) return reinterpret_cast<const T*>(pq_smem) + kCentroids * D;
    else return vcb;
  }

  __device__ int win_slot(int pos) const {
    const int slot = pos - win_base;
    return (slot >= 0 && slot < a.window) ? slot : 0;  // out-of-range rows are masked
  }
};

// Where a request's keys go.
// Codes [lo, n_codes) in `used` splits of `per` tokens from `first`, and the window
// [max(n_codes, lo), L) (layout.window_start of the query at L - 1) in split used - 1,
// where lo = L - sliding_window on sliding-window layers (else 0). Pages wholly before lo
// are never touched: vLLM frees them, and the block table may still name their old blocks.
// `per` is at least min_split: a request with at most min_split codes has one split
// whatever num_splits is. Splits past `used` are empty (their items write -inf).
struct SplitPlan {
  int n_codes, lo, first, per, used;
};

__device__ __forceinline__ SplitPlan split_plan(const DecodeArgs& a, int len) {
  SplitPlan p;
  p.n_codes = a.window > 0 ? ((max(len, 1) - 1) / a.window) * a.window : len;
  p.lo = a.sliding_window > 0 ? max(0, len - a.sliding_window) : 0;
  p.first = (p.lo / kChunk) * kChunk;  // splits stay 32-token aligned
  p.per = kChunk, p.used = 1;          // (no codes: the window's split only)
  if (p.n_codes > p.lo) {
    const int even = ceil_div(p.n_codes - p.first, a.num_splits);
    p.per = max(a.min_split, ceil_div(even, kChunk) * kChunk);
    p.used = ceil_div(p.n_codes - p.first, p.per);
  }
  return p;
}

template <typename T, int D, int MK, int MV, bool LUT>
__global__ void __launch_bounds__(DecodeCfg<T, D, MK, MV>::kThreads, 1) decode_kernel(DecodeArgs a) {
  using C = DecodeCfg<T, D, MK, MV>;
  static_assert(!LUT || C::kCbSmem, "the LUT takes the shared-memory codebook's place");
  const int group = a.num_heads / a.num_kv_heads;
  const int hgroups = ceil_div(group, kHeadsPerCta);
  const int hkv = blockIdx.y / hgroups, hg = blockIdx.y % hgroups;
  const int h0 = hkv * group + hg * kHeadsPerCta;
  const int nh = min(kHeadsPerCta, group - hg * kHeadsPerCta);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane >> 2, c = lane & 3;
  const int slots = a.num_splits;
  // This head's codebooks in global memory (recomputed where used: registers are tight).
  auto books = [&](int i) {
    return static_cast<const T*>(i ? a.v_cb : a.k_cb) + (int64_t)hkv * kCentroids * D;
  };
  // The codebooks, once for all of this CTA's items, in flight while the first codes load.
  bool books_ready = !C::kCbSmem;
  if constexpr (C::kCbSmem) {
    DecodeCta<T, D, MK, MV>{a, 0, hkv, r, c, nullptr, books(0), books(1), nullptr, nullptr, 0}
        .template load_books<LUT>();
  }

  for (int item = blockIdx.x; item < a.num_reqs * slots; item += gridDim.x) {
    const int req = item / slots, slot = item % slots;
    const int len = a.seq_lens[req];
    const SplitPlan plan = split_plan(a, len);
    const int n_codes = plan.n_codes, lo = plan.lo;
    int t_begin = 0, t_end = 0, w_begin = 0, w_end = 0;
    if (len > 0) {
      if (n_codes > lo) {
        t_begin = min(plan.first + slot * plan.per, n_codes), t_end = min(t_begin + plan.per, n_codes);
        t_begin = max(t_begin, lo);
      }
      // (a window row outside the store, which the builder never gives, is not touched)
      const int wrow = a.window > 0 ? a.rows[req] : -1;
      if (wrow >= 0 && wrow < a.win_rows && slot == plan.used - 1) w_begin = max(n_codes, lo), w_end = len;
    }
    float* lse_out = a.ws_lse + ((int64_t)req * a.num_heads + h0) * slots + slot;
    const bool has_codes = t_begin < t_end, has_win = w_begin < w_end;
    if (!has_codes && !has_win) {
      if (threadIdx.x < nh) lse_out[threadIdx.x * slots] = -CUDART_INF_F;
      continue;
    }

    DecodeCta<T, D, MK, MV> cta{a, req, hkv, r, c, a.block_table + (int64_t)req * a.bt_stride,
                                books(0), books(1), nullptr, nullptr, n_codes};
    if (has_win) {
      const int64_t row = ((int64_t)a.rows[req] * a.num_kv_heads + hkv) * a.window * D;
      cta.wk = static_cast<const T*>(a.win_k) + row;
      cta.wv = static_cast<const T*>(a.win_v) + row;
      if (a.new_k != nullptr) {
        // This step's key and value into their window slot, which this item reads below
        // (a CTA of each head group writes the same bytes).
        const int64_t at = row + (int64_t)(len - 1 - n_codes) * D;
        const T* nk = static_cast<const T*>(a.new_k) + req * a.new_k_stride + (int64_t)hkv * D;
        const T* nv = static_cast<const T*>(a.new_v) + req * a.new_v_stride + (int64_t)hkv * D;
        for (int i = threadIdx.x; i < 2 * D; i += C::kThreads)
          (i < D ? static_cast<T*>(a.win_k) : static_cast<T*>(a.win_v))[at + i % D] = (i < D ? nk : nv)[i % D];
        __syncthreads();
      }
    }
    if constexpr (LUT) {
      if (has_codes) {
        __syncthreads();  // the previous item's lookups are over
        cta.build_lut(static_cast<const T*>(a.q) + req * a.q_stride + (int64_t)h0 * D);
      }
    }

    // Q^T as B fragments: head h0 + r, this lane's dims c*D/4 .. (zero for absent heads).
    uint32_t qf[C::KW];
    if (r < nh) {
      load_words<C::KW>(static_cast<const T*>(a.q) + req * a.q_stride + (int64_t)(h0 + r) * D + c * C::KQ, qf);
    } else {
#pragma unroll
      for (int i = 0; i < C::KW; ++i) qf[i] = 0u;
    }
    const float scale = a.scale * kLog2e;

    float o[C::NT][4];
#pragma unroll
    for (int i = 0; i < C::NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_run[2] = {0.f, 0.f};

    // Keys t0 .. t0 + 31, of which [k_lo, k_hi) count.
    auto chunk = [&](auto win_tag, int t0, const ChunkCodes<C>& cc, int k_lo, int k_hi) {
      constexpr bool WIN = decltype(win_tag)::value;
      float s[2][4];
  #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pa = t0 + k_token(h, r), pb = pa + 2;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if constexpr (LUT && !WIN) {
          // Partial sums over this lane's subspaces, then over the 4 lanes of the row;
          // every column (query head slot) gets the one head's score.
          const float* lut = reinterpret_cast<const float*>(pq_smem);
          float sa = 0.f, sb = 0.f;
  #pragma unroll
          for (int mm = 0; mm < C::MQ; ++mm) {
            sa += lut[quarter_unit<1, C::MQ>(c * C::MQ + mm, byte_of(cc.k[h][0], mm))];
            sb += lut[quarter_unit<1, C::MQ>(c * C::MQ + mm, byte_of(cc.k[h][1], mm))];
          }
          sa += __shfl_xor_sync(0xffffffffu, sa, 1);
          sb += __shfl_xor_sync(0xffffffffu, sb, 1);
          sa += __shfl_xor_sync(0xffffffffu, sa, 2);
          sb += __shfl_xor_sync(0xffffffffu, sb, 2);
          acc[0] = acc[1] = sa;
          acc[2] = acc[3] = sb;
        } else {
          uint32_t ka[C::KW], kb[C::KW];
          cta.template fetch_k<WIN>(cc, h, 0, pa, ka);
          cta.template fetch_k<WIN>(cc, h, 1, pb, kb);
  #pragma unroll
          for (int j = 0; j < D / 16; ++j) {
            const uint32_t fa[4] = {ka[2 * j], kb[2 * j], ka[2 * j + 1], kb[2 * j + 1]};
            mma<T>(acc, fa, qf[2 * j], qf[2 * j + 1]);
          }
        }
        const bool va = pa >= k_lo && pa < k_hi, vb = pb >= k_lo && pb < k_hi;
        s[h][0] = va ? acc[0] * scale : -CUDART_INF_F;
        s[h][1] = va ? acc[1] * scale : -CUDART_INF_F;
        s[h][2] = vb ? acc[2] * scale : -CUDART_INF_F;
        s[h][3] = vb ? acc[3] * scale : -CUDART_INF_F;
      }
      // Online softmax for this lane's heads 2c (e = 0) and 2c + 1 (e = 1).
      float p[2][4];
  #pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = fmaxf(fmaxf(s[0][e], s[0][e + 2]), fmaxf(s[1][e], s[1][e + 2]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m_run[e], mx);
        const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
        const float alpha = exp2f(m_run[e] - m_use);
  #pragma unroll
        for (int h = 0; h < 2; ++h) {
          p[h][e] = exp2f(s[h][e] - m_use);
          p[h][e + 2] = exp2f(s[h][e + 2] - m_use);
        }
        l_run[e] = l_run[e] * alpha + (p[0][e] + p[0][e + 2]) + (p[1][e] + p[1][e + 2]);
  #pragma unroll
        for (int i = 0; i < C::NT; ++i) o[i][e] *= alpha, o[i][e + 2] *= alpha;
        m_run[e] = m_new;
      }
      // O^T += V^T P per half: P^T fragments by transposing the score fragments.
  #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t pb0 = movmatrix_trans(Elem<T>::pack(p[h][0], p[h][1]));
        const uint32_t pb1 = movmatrix_trans(Elem<T>::pack(p[h][2], p[h][3]));
        const int tv = t0 + 8 * c + 4 * h;
        // P is 0 for keys outside [k_lo, k_hi), but 0 * NaN is NaN: such keys must not bring
        // in the NaN centroid of layout.NAN_CODE (subspace 0: q = 0, r = 0; stale page bytes,
        // keys before a sliding window), so their subspace-0 codes read centroid 0 instead.
        uint32_t v0 = 0u;
        if constexpr (!WIN) {
          v0 = cc.v[h][0];
          if (r == 0 && (t0 < k_lo || t0 + kChunk > k_hi)) {  // edge chunks only
  #pragma unroll
            for (int k = 0; k < 4; ++k)
              if (tv + k < k_lo || tv + k >= k_hi) v0 &= ~(0xffu << (8 * k));
          }
        }
  #pragma unroll
        for (int q = 0; q < C::VSUB; ++q) {
          uint32_t v[4][C::DWV];
  #pragma unroll
          for (int k = 0; k < 4; ++k)
            cta.template fetch_v<WIN>(q == 0 ? v0 : cc.v[h][q], q, k, tv + k, tv + k >= k_lo && tv + k < k_hi, v[k]);
  #pragma unroll
          for (int u = 0; u < C::DWV; ++u) {
            const uint32_t fa[4] = {__byte_perm(v[0][u], v[1][u], 0x5410), __byte_perm(v[0][u], v[1][u], 0x7632),
                                    __byte_perm(v[2][u], v[3][u], 0x5410), __byte_perm(v[2][u], v[3][u], 0x7632)};
            mma<T>(o[q * C::DWV + u], fa, pb0, pb1);
          }
        }
      }
    };

    constexpr int stride = C::kWarps * kChunk;
    int code_chunks = 0;
    if (has_codes) {
      const int first = (t_begin / kChunk) * kChunk;
      code_chunks = ceil_div(t_end - first, kChunk);
      int t0 = first + warp * kChunk;
      ChunkCodes<C> cur, nxt;
      if (t0 < t_end) cta.load_codes(t0, cur);  // in flight while the codebooks arrive
      if constexpr (C::kCbSmem) {
        if (LUT || !books_ready) {  // the copies (and this item's LUT) are visible after
          cp_async_wait_all();
          __syncthreads();
          books_ready = true;
        }
      }
      for (; t0 < t_end; t0 += stride) {
        if constexpr (C::kPrefetch) {
          if (t0 + stride < t_end) cta.load_codes(t0 + stride, nxt);
          chunk(std::false_type{}, t0, cur, t_begin, t_end);
          cur = nxt;
        } else {
          chunk(std::false_type{}, t0, cur, t_begin, t_end);
          if (t0 + stride < t_end) cta.load_codes(t0 + stride, cur);
        }
      }
    }
    if (has_win) {  // the window's chunks go on round the warps where the codes' stopped
      ChunkCodes<C> none;
      for (int i = (warp - code_chunks % C::kWarps + C::kWarps) % C::kWarps; w_begin + i * kChunk < w_end;
           i += C::kWarps)
        chunk(std::true_type{}, w_begin + i * kChunk, none, w_begin, w_end);
    }

    // Combine the warps: each lane's l covers its rows only; sum over r.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 4);
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 8);
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 16);
    }
    __syncthreads();  // the previous item's readers of the reduction region are done
    float* red = reinterpret_cast<float*>(pq_smem + C::kRedOffset);  // [warp][head][D + 2]
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float* dst = red + (warp * kHeadsPerCta + 2 * c + e) * (D + 2);
#pragma unroll
      for (int i = 0; i < C::NT; ++i) {
        const int dim = (8 * (i / C::DWV) + r) * C::DSV + 2 * (i % C::DWV);
        dst[dim] = o[i][e];
        dst[dim + 1] = o[i][e + 2];
      }
      if (r == 0) dst[D] = m_run[e], dst[D + 1] = l_run[e];
    }
    __syncthreads();
    float* o_out = a.ws_o + (((int64_t)req * a.num_heads + h0) * slots + slot) * D;
    for (int idx = threadIdx.x; idx < nh * D; idx += C::kThreads) {
      const int head = idx / D, dim = idx % D;
      float mstar = -CUDART_INF_F;
#pragma unroll
      for (int w = 0; w < C::kWarps; ++w) mstar = fmaxf(mstar, red[(w * kHeadsPerCta + head) * (D + 2) + D]);
      float num = 0.f, den = 0.f;
      if (mstar != -CUDART_INF_F) {
#pragma unroll
        for (int w = 0; w < C::kWarps; ++w) {
          const float* src = red + (w * kHeadsPerCta + head) * (D + 2);
          const float f = exp2f(src[D] - mstar);
          num += f * src[dim];
          den += f * src[D + 1];
        }
      }
      // den is 0 (no keys), positive, or NaN (a NaN-marked key, layout.py): NaN propagates
      o_out[(int64_t)head * slots * D + dim] = den != 0.f ? num / den : 0.f;
      if (dim == 0) lse_out[head * slots] = den != 0.f ? mstar + log2f(den) : -CUDART_INF_F;
    }
  }
  if constexpr (C::kCbSmem) cp_async_wait_all();  // no copy outlives the CTA (items all empty)
}

template <typename T, int D, int MK, int MV, bool LUT>
cudaError_t launch_kernel(const DecodeArgs& a, cudaStream_t stream) {
  using C = DecodeCfg<T, D, MK, MV>;
  // Set per call, not cached per process: the attribute belongs to the current device.
  const cudaError_t attr = cudaFuncSetAttribute(
      decode_kernel<T, D, MK, MV, LUT>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (attr != cudaSuccess) return attr;
  const int group = a.num_heads / a.num_kv_heads;
  const int items = a.num_reqs * a.num_splits;
  dim3 grid(a.num_ctas > 0 ? min(a.num_ctas, items) : items, a.num_kv_heads * ceil_div(group, kHeadsPerCta));
  decode_kernel<T, D, MK, MV, LUT><<<grid, C::kThreads, C::kSmem, stream>>>(a);
  return cudaGetLastError();
}

// a.lut asks for lookup-table scores; they exist for one query head per KV head with the
// codebooks in shared memory, else the MMA path runs.
template <typename T, int D, int MK, int MV>
cudaError_t launch_decode(const DecodeArgs& a, cudaStream_t stream) {
  if constexpr (DecodeCfg<T, D, MK, MV>::kCbSmem) {
    if (a.lut && a.num_heads == a.num_kv_heads) return launch_kernel<T, D, MK, MV, true>(a, stream);
  }
  return launch_kernel<T, D, MK, MV, false>(a, stream);
}

}  // namespace pq
