// Quantize new K/V rows to their nearest centroids and write the codes into the pages.
//
// One CTA per (32-128 tokens, KV head, K|V, group of subspaces): the groups are spread
// over the grid, not looped over in one CTA, so that a decode step's few tokens still
// fill the GPU (64 tokens gave 16 CTAs before). K and V have their own subspace width DS,
// so they are one launch when the widths agree and two otherwise. A CTA stages its
// group's fp32 centroids in shared memory with each centroid's |c|^2 / 2; a warp's lanes
// take tokens of one subspace, so every centroid read is a broadcast. The nearest centroid
// minimises |c|^2 / 2 - x.c (DS fused multiply-adds and a compare per centroid, against
// 2 DS operations for |x - c|^2); the first minimum wins and a NaN score never does. In
// fp32 this may pick a centroid whose distance ties the nearest one's within rounding of
// |x|^2 + |c|^2 where reference.encode, summing squared differences, picks the other (the
// GPU tests bound it). Carrying the index in the score's low mantissa bits (one min
// instead of a compare and two selects) made such ties 2^-15 wide instead of 2^-23, and
// the attention tests, which expect the reference's codes, saw the difference. Subspace 0
// of a non-finite vector gets the layout's nan_code.
//
// 2-D subspaces (4 bits per element) with a grid record (vllm_pq_backend/nearest.py) skip
// most of the 256 centroids: a token's cell lists the few that can be nearest to it, in
// index order, and the same fp32 scores pick among them, so the code is the full search's
// (a token outside the record's box, or not finite, gets the full search). Large stores
// take that path, 128 tokens per CTA (4 a lane) as the full search's large stores have.
// A decode step's store (fewer than kManyTokens tokens) gives each (KV head, subspace) too
// few tokens to pay for staging: its warps read the record and the listed centroids
// through L1 instead (store_grid_l1_kernel).
#include <math_constants.h>

#include "pq_common.cuh"

namespace pq {
namespace {

constexpr int kStoreThreads = 256;

// P tokens per thread: one centroid read serves them all and their min-searches
// interleave (independent instructions). Large stores take 4 (subspace width <= 4; wider
// ones need the registers), small ones 1, so that a decode step's few tokens spread over
// as many threads as they can. Widths >= 8 give a subspace two warps (their groups hold
// half as many subspaces in the same shared memory).
template <int DS, int P, bool Grid = false>
struct StoreCfg {
  static constexpr int kLanes = DS >= 8 ? 64 : 32;       // threads per subspace: whole warps
  static constexpr int kTokens = kLanes * P * (Grid ? 4 : 1);  // tokens per CTA
  static constexpr int kGroup = kStoreThreads / kLanes;  // subspaces per CTA: one item a thread
  static constexpr int kSmem = kGroup * kCentroids * (DS + 1) * (int)sizeof(float);
  static_assert(DS <= 4 || P == 1, "registers");
  static_assert(!Grid || DS == 2, "grid records are 2-D");
};

// |c|^2 / 2 of a centroid of DS floats, the one rounding sequence every store path uses
// (NaN for the NaN-marked centroid: never nearest).
template <int DS>
__device__ __forceinline__ float half_sq_norm(const float* c) {
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < DS; ++i) sq = __fmaf_rn(c[i], c[i], sq);
  return 0.5f * sq;
}

// A CTA's group of mg subspaces into shared memory: centroids [kGroup][256][DS], then
// their |c|^2 / 2 [kGroup][256] (returned). Both store kernels score with these, so the
// grid search's scores are the full search's bit for bit.
template <int DS, int kGroup>
__device__ __forceinline__ float* stage_centroids(const float* cb, int mg, float* smem) {
  const float4* g4 = reinterpret_cast<const float4*>(cb);
  float4* s4 = reinterpret_cast<float4*>(smem);
  for (int i = threadIdx.x; i < mg * kCentroids * DS / 4; i += kStoreThreads) s4[i] = g4[i];
  float* half_norm = smem + kGroup * kCentroids * DS;
  for (int j = threadIdx.x; j < mg * kCentroids; j += kStoreThreads) half_norm[j] = half_sq_norm<DS>(cb + (size_t)j * DS);
  return half_norm;
}

// Whether none of a head vector's n elements is a NaN or an infinity (exponent bits all
// ones). 16-byte loads where the row is aligned, as vLLM's K/V views of its qkv tensor are:
// the lane of subspace 0 reads whole vectors, and element loads made it the slowest lane.
template <typename T>
__device__ __forceinline__ bool all_finite(const T* x, int n) {
  constexpr uint32_t e = std::is_same_v<T, __half> ? 0x7c00u : 0x7f80u;
  bool finite = true;  // & not &&: the loads need not wait for each other
  if ((reinterpret_cast<uintptr_t>(x) & 15) == 0 && n % 8 == 0) {
    const uint4* v = reinterpret_cast<const uint4*>(x);
#pragma unroll 4
    for (int i = 0; i < n / 8; ++i) {
      const uint4 w = v[i];
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) finite &= (u[j] & e) != e & (u[j] & e << 16) != e << 16;
    }
  } else {
    for (int i = 0; i < n; ++i) finite &= isfinite(Elem<T>::to_float(x[i]));
  }
  return finite;
}

// The byte of code `m` of the token in `slot`.
__device__ __forceinline__ uint8_t* code_byte(const Pages& pg, bool is_v, int head, int m, int64_t slot) {
  const int64_t blk = slot / pg.block_size, off = slot % pg.block_size;
  uint8_t* region = pg.base + blk * pg.block_stride + head * pg.head_stride;
  return region + (is_v ? pg.lay.v_off + (int64_t)m * pg.lay.v_sub + off : pg.lay.k_off + off * pg.lay.k_tok + m);
}

// Head `head` of token `tok`'s K row (is_v false) or V row: head_dim elements.
template <typename T>
__device__ __forceinline__ const T* head_row(const KVRows& kv, bool is_v, int64_t tok, int head, int head_dim) {
  return static_cast<const T*>(is_v ? kv.value : kv.key) + tok * (is_v ? kv.value_stride : kv.key_stride) +
         (int64_t)head * head_dim;
}

// Whether code `m` of the head vector `row` (head_dim elements) is the layout's nan_code:
// subspace 0 of a vector with one non-finite element marks the token.
template <typename T>
__device__ __forceinline__ bool nan_marked(const T* row, int m, int head_dim) {
  return m == 0 && !all_finite(row, head_dim);
}

// Code `m` of the token in `slot` goes into its page (nan_code where nan_marked).
__device__ __forceinline__ void write_code(const StoreArgs& a, bool is_v, int head, int m, int64_t slot, int code,
                                           bool nan) {
  *code_byte(a.pages, is_v, head, m, slot) = static_cast<uint8_t>(nan ? a.pages.lay.nan_code : code);
}

// 2-D centroids staged in shared memory with their |c|^2 / 2 ...
struct StagedCentroids {
  const float* c;
  const float* hn;
  __device__ __forceinline__ float3 operator[](int k) const { return make_float3(c[2 * k], c[2 * k + 1], hn[k]); }
};

// ... or read through L1, |c|^2 / 2 computed as staging computes it (the same bits).
struct CachedCentroids {
  const float2* c;
  __device__ __forceinline__ float3 operator[](int k) const {
    const float2 v = __ldg(c + k);
    const float f[2] = {v.x, v.y};
    return make_float3(v.x, v.y, half_sq_norm<2>(f));
  }
};

// Score of 2-D centroid k (c: its coordinates and |c|^2 / 2), |c|^2 / 2 - x.c, by the same
// fused multiply-adds as the full search; the first minimum wins and a NaN never does.
__device__ __forceinline__ void try_centroid(float x0, float x1, float3 c, int k, float& best, int& code) {
  const float score = __fmaf_rn(-x1, c.y, __fmaf_rn(-x0, c.x, c.z));
  if (score < best) best = score, code = k;
}

// Grid records (nearest.py): 16 bytes lo[2], inv_w[2]; uint16 bins, offsets, lists, fine,
// cells at byte 16. Records are 16-byte aligned (their size is a multiple of 16).
struct GridHeader {
  float4 f;  // lo[2], inv_w[2]
  uint4 s;   // the uint16 section offsets and sizes, packed
  __device__ __forceinline__ int sec(int i) const {
    const uint32_t w[4] = {s.x, s.y, s.z, s.w};
    return (w[i / 2] >> (16 * (i % 2))) & 0xffff;
  }
};

__device__ __forceinline__ GridHeader grid_header(const uint8_t* rec) {
  return {*reinterpret_cast<const float4*>(rec), *reinterpret_cast<const uint4*>(rec + 16)};
}

// The code of (x0, x1): the listed centroids of its cell, or all 256 outside the record's
// box. The list is walked 4 entries at a time, their centroids loaded before any is
// scored, so that a decode-sized store waits for one round of loads per 4 entries rather
// than per entry; past the list's end the last entry repeats, which never wins a strict
// compare, so the first minimum in index order still wins.
template <typename Centroids>
__device__ __forceinline__ int grid_code(float x0, float x1, const Centroids& cs, const uint8_t* rec,
                                         const GridHeader& h) {
  const float fx = (x0 - h.f.x) * h.f.z, fy = (x1 - h.f.y) * h.f.w;
  const int fine = h.sec(3);
  float best = CUDART_INF_F;
  int code = 0;
  if (fx >= 0.f && fx < (float)fine && fy >= 0.f && fy < (float)fine) {  // false for NaN
    const uint8_t* bins = rec + h.sec(0);
    const int cell = bins[(int)fx] * h.sec(4) + bins[fine + (int)fy];
    const uint16_t* offs = reinterpret_cast<const uint16_t*>(rec + h.sec(1));
    const uint8_t* list = rec + h.sec(2);
    const int lo = offs[cell], hi = offs[cell + 1];
    for (int j = lo; j < hi; j += 4) {
      int k[4];
      float3 c[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) k[u] = list[min(j + u, hi - 1)];
#pragma unroll
      for (int u = 0; u < 4; ++u) c[u] = cs[k[u]];
#pragma unroll
      for (int u = 0; u < 4; ++u) try_centroid(x0, x1, c[u], k[u], best, code);
    }
  } else {
    for (int k = 0; k < kCentroids; ++k) try_centroid(x0, x1, cs[k], k, best, code);
  }
  return code;
}

// Large stores of 2-D subspaces with grid records: a warp per subspace, 128 tokens a CTA.
template <typename T>
__global__ void __launch_bounds__(kStoreThreads) store_grid_kernel(StoreArgs a, int first_part, int groups) {
  using C = StoreCfg<2, 1, true>;
  constexpr int kTiles = C::kTokens / C::kLanes;
  // [group][256][2] centroids, [group][256] |c|^2 / 2, [group][record] grid records
  extern __shared__ float cb_smem[];
  const int head = blockIdx.y;
  const bool is_v = first_part + (int)blockIdx.z / groups == 1;
  const int m_total = is_v ? a.m_v : a.m_k;
  const int rec_bytes = is_v ? a.v_grid_bytes : a.k_grid_bytes;
  const int m0 = (blockIdx.z % groups) * C::kGroup;
  const int mg = min(C::kGroup, m_total - m0);
  uint8_t* recs = reinterpret_cast<uint8_t*>(cb_smem + C::kGroup * kCentroids * 3);
  const float* cb = (is_v ? a.v_cb : a.k_cb) + ((size_t)head * m_total + m0) * kCentroids * 2;
  const uint8_t* grid = (is_v ? a.v_grid : a.k_grid) + ((size_t)head * m_total + m0) * rec_bytes;
  const int tok0 = blockIdx.x * C::kTokens;
  const int ntok = min(C::kTokens, a.num_tokens - tok0);

  const float* half_norm = stage_centroids<2, C::kGroup>(cb, mg, cb_smem);
  const uint4* gr = reinterpret_cast<const uint4*>(grid);
  uint4* sr = reinterpret_cast<uint4*>(recs);
  for (int i = threadIdx.x; i < mg * rec_bytes / 16; i += kStoreThreads) sr[i] = gr[i];
  __syncthreads();
  const int lane = threadIdx.x % C::kLanes, ml = threadIdx.x / C::kLanes;
  const int m = m0 + ml;
  if (ml >= mg) return;
  const float* c = cb_smem + ml * kCentroids * 2;
  const float* hn = half_norm + ml * kCentroids;
  const uint8_t* rec = recs + ml * rec_bytes;
#pragma unroll 1
  for (int i = 0; i < kTiles; ++i) {
    const int t = lane + i * C::kLanes;
    if (t >= ntok) break;
    const int64_t slot = a.slot_mapping[tok0 + t];
    if (slot < 0) continue;
    const T* row = head_row<T>(a.kv, is_v, tok0 + t, head, a.head_dim);
    const int code = grid_code(Elem<T>::to_float(row[2 * m]), Elem<T>::to_float(row[2 * m + 1]),
                               StagedCentroids{c, hn}, rec, grid_header(rec));
    write_code(a, is_v, head, m, slot, code, nan_marked(row, m, a.head_dim));
  }
}

// Decode-sized stores of 2-D subspaces with grid records: warp w takes 32 tokens of
// subspace w / token_warps, so the warps of one subspace are neighbours in a CTA and share
// its record and centroids in L1, and a warp's loads of them touch a few cache lines (lanes
// over subspaces instead, each load touched 32 records' lines and lost to the full search).
template <typename T>
__global__ void __launch_bounds__(kStoreThreads) store_grid_l1_kernel(StoreArgs a, int first_part, int token_warps) {
  const int warp = blockIdx.x * (kStoreThreads / 32) + threadIdx.x / 32;
  const bool is_v = first_part + (int)blockIdx.z == 1;
  const int m_total = is_v ? a.m_v : a.m_k;
  const int m = warp / token_warps, tok = (warp % token_warps) * 32 + threadIdx.x % 32;
  if (m >= m_total || tok >= a.num_tokens) return;
  // A chain of dependent loads (record, cell, list, centroids) is all this kernel's time:
  // everything that depends on nothing else is loaded first, the slot's check waits for it.
  const int64_t slot = a.slot_mapping[tok];
  const int head = blockIdx.y;
  const size_t sub = (size_t)head * m_total + m;
  const float2* c = reinterpret_cast<const float2*>(is_v ? a.v_cb : a.k_cb) + sub * kCentroids;
  const uint8_t* rec = (is_v ? a.v_grid : a.k_grid) + sub * (is_v ? a.v_grid_bytes : a.k_grid_bytes);
  const GridHeader h = grid_header(rec);
  const T* row = head_row<T>(a.kv, is_v, tok, head, a.head_dim);
  const float x0 = Elem<T>::to_float(row[2 * m]), x1 = Elem<T>::to_float(row[2 * m + 1]);
  const bool nan = nan_marked(row, m, a.head_dim);
  if (slot < 0) return;
  write_code(a, is_v, head, m, slot, grid_code(x0, x1, CachedCentroids{c}, rec, h), nan);
}

template <typename T, int DS, int P>
__global__ void __launch_bounds__(kStoreThreads) store_kernel(StoreArgs a, int first_part, int groups) {
  using C = StoreCfg<DS, P>;
  // [group subspaces][256][DS] centroids, then [group subspaces][256] their |c|^2 / 2
  extern __shared__ float cb_smem[];
  const int head = blockIdx.y;
  const bool is_v = first_part + (int)blockIdx.z / groups == 1;  // part 0: K, part 1: V
  const int m_total = is_v ? a.m_v : a.m_k;
  const int m0 = (blockIdx.z % groups) * C::kGroup;
  const int mg = min(C::kGroup, m_total - m0);
  const float* cb = (is_v ? a.v_cb : a.k_cb) + ((size_t)head * m_total + m0) * kCentroids * DS;
  const int tok0 = blockIdx.x * C::kTokens;
  const int ntok = min(C::kTokens, a.num_tokens - tok0);

  const float* half_norm = stage_centroids<DS, C::kGroup>(cb, mg, cb_smem);
  __syncthreads();
  const int lane = threadIdx.x % C::kLanes, ml = threadIdx.x / C::kLanes;
  const int m = m0 + ml;
  if (ml >= mg) return;
  int64_t slot[P];
  float xv[P][DS];
  bool any = false;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int t = lane + p * C::kLanes;
    slot[p] = t < ntok ? a.slot_mapping[tok0 + t] : -1;
    any = any || slot[p] >= 0;
    const T* x = head_row<T>(a.kv, is_v, tok0 + min(t, ntok - 1), head, a.head_dim) + m * DS;
#pragma unroll
    for (int i = 0; i < DS; ++i) xv[p][i] = Elem<T>::to_float(x[i]);
  }
  if (!any) return;
  const float* c = cb_smem + ml * kCentroids * DS;
  const float* hn = half_norm + ml * kCentroids;
  float best[P];
  int code[P];
#pragma unroll
  for (int p = 0; p < P; ++p) best[p] = CUDART_INF_F, code[p] = 0;
#pragma unroll 16  // amortizes the loop's own instructions
  for (int k = 0; k < kCentroids; ++k) {
    float cv[DS];
#pragma unroll
    for (int i = 0; i < DS; ++i) cv[i] = c[k * DS + i];
    const float h = hn[k];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      float score = h;  // |c|^2 / 2 - x.c = (|x - c|^2 - |x|^2) / 2
#pragma unroll
      for (int i = 0; i < DS; ++i) score = __fmaf_rn(-xv[p][i], cv[i], score);
      if (score < best[p]) best[p] = score, code[p] = k;  // first minimum; never a NaN
    }
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (slot[p] < 0) continue;
    const T* row = head_row<T>(a.kv, is_v, tok0 + lane + p * C::kLanes, head, a.head_dim);
    write_code(a, is_v, head, m, slot[p], code[p], nan_marked(row, m, a.head_dim));
  }
}

// Parts [first_part, first_part + parts) of (K, V), all with m subspaces of width DS.
template <typename T, int DS, int P>
cudaError_t launch_store(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  using C = StoreCfg<DS, P>;
  auto kernel = store_kernel<T, DS, P>;
  // Set per call, not once per process: the attribute belongs to the current device.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (err != cudaSuccess) return err;
  const int groups = ceil_div(m, C::kGroup);
  dim3 grid(ceil_div(a.num_tokens, C::kTokens), a.num_kv_heads, parts * groups);
  kernel<<<grid, kStoreThreads, C::kSmem, stream>>>(a, first_part, groups);
  return cudaGetLastError();
}

// Parts with grid records (all of them: the caller launches K and V apart otherwise).
template <typename T>
cudaError_t launch_store_grid(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  using C = StoreCfg<2, 1, true>;
  auto kernel = store_grid_kernel<T>;
  const int rec = max(first_part == 0 ? a.k_grid_bytes : 0, first_part + parts == 2 ? a.v_grid_bytes : 0);
  const int smem = C::kSmem + C::kGroup * rec;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int groups = ceil_div(m, C::kGroup);
  dim3 grid(ceil_div(a.num_tokens, C::kTokens), a.num_kv_heads, parts * groups);
  kernel<<<grid, kStoreThreads, smem, stream>>>(a, first_part, groups);
  return cudaGetLastError();
}

// Parts with grid records, decode-sized: a warp per (subspace, 32 tokens).
template <typename T>
cudaError_t launch_store_grid_l1(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  const int token_warps = ceil_div(a.num_tokens, 32);
  dim3 grid(ceil_div(m * token_warps, kStoreThreads / 32), a.num_kv_heads, parts);
  store_grid_l1_kernel<T><<<grid, kStoreThreads, 0, stream>>>(a, first_part, token_warps);
  return cudaGetLastError();
}

// 4 tokens per thread once 128-token CTAs still number a few per SM (prefill); 1 below.
constexpr int kManyTokens = 1024;

template <typename T, int DS>
cudaError_t launch_store(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  if constexpr (DS == 2) {
    const bool k = first_part > 0 || a.k_grid, v = first_part + parts < 2 || a.v_grid;
    if (k && v) {
      // staging pays from about kManyTokens (eval/results/store_l1_*: equal at 1024 tokens)
      return a.num_tokens >= kManyTokens ? launch_store_grid<T>(a, first_part, parts, m, stream)
                                         : launch_store_grid_l1<T>(a, first_part, parts, m, stream);
    }
  }
  if constexpr (DS <= 4) {
    if (a.num_tokens >= kManyTokens) return launch_store<T, DS, 4>(a, first_part, parts, m, stream);
  }
  return launch_store<T, DS, 1>(a, first_part, parts, m, stream);
}

template <typename T>
cudaError_t store_parts(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  switch (a.head_dim / m) {
    case 2: return launch_store<T, 2>(a, first_part, parts, m, stream);
    case 4: return launch_store<T, 4>(a, first_part, parts, m, stream);
    case 8: return launch_store<T, 8>(a, first_part, parts, m, stream);
    case 16: return launch_store<T, 16>(a, first_part, parts, m, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t store_typed(const StoreArgs& a, cudaStream_t stream) {
  // one launch for K and V when their widths agree and both or neither have grid records
  // (their records' sizes may differ: each part reads its own)
  const bool same = a.m_k == a.m_v && (a.k_grid == nullptr) == (a.v_grid == nullptr);
  if (same) return store_parts<T>(a, 0, 2, a.m_k, stream);
  const cudaError_t err = store_parts<T>(a, 0, 1, a.m_k, stream);
  return err != cudaSuccess ? err : store_parts<T>(a, 1, 1, a.m_v, stream);
}

// One token's K (blockIdx.y 0) or V (1) head vectors into its window-store entry, V-byte
// words at a time (16 where every row is 16-byte aligned).
template <typename V>
__global__ void window_write_kernel(WindowArgs a) {
  const int i = blockIdx.x;
  const bool is_v = blockIdx.y == 1;
  const int64_t esz = a.elem_bytes, head_bytes = a.head_dim * esz, words = head_bytes / sizeof(V);
  const uint8_t* src = static_cast<const uint8_t*>(is_v ? a.kv.value : a.kv.key) +
                       a.tokens[i] * (is_v ? a.kv.value_stride : a.kv.key_stride) * esz;
  uint8_t* dst = static_cast<uint8_t*>(is_v ? a.win_v : a.win_k) +
                 (a.rows[i] * a.kv_heads * a.window + a.slots[i]) * head_bytes;
  for (int64_t w = threadIdx.x; w < a.kv_heads * words; w += blockDim.x) {
    const int64_t h = w / words, at = (w % words) * sizeof(V);
    *reinterpret_cast<V*>(dst + h * a.window * head_bytes + at) =
        *reinterpret_cast<const V*>(src + h * head_bytes + at);
  }
}

}  // namespace

cudaError_t window_write(const WindowArgs& a, cudaStream_t stream) {
  if (a.count == 0) return cudaSuccess;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = aligned(a.kv.key) && aligned(a.kv.value) && aligned(a.win_k) && aligned(a.win_v) &&
                   (a.head_dim * a.elem_bytes) % 16 == 0 && (a.kv.key_stride * a.elem_bytes) % 16 == 0 &&
                   (a.kv.value_stride * a.elem_bytes) % 16 == 0;
  const dim3 grid(a.count, 2);
  if (vec)
    window_write_kernel<uint4><<<grid, 128, 0, stream>>>(a);
  else
    window_write_kernel<uint16_t><<<grid, 128, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t store(const StoreArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.m_k <= 0 || a.m_v <= 0 || a.head_dim % a.m_k || a.head_dim % a.m_v) return cudaErrorInvalidValue;
  return a.dtype == DType::kBFloat16 ? store_typed<__nv_bfloat16>(a, stream)
                                     : store_typed<__half>(a, stream);
}

}  // namespace pq
