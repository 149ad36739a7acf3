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
template <int DS, int P>
struct StoreCfg {
  static constexpr int kLanes = DS >= 8 ? 64 : 32;       // threads per subspace: whole warps
  static constexpr int kTokens = kLanes * P;             // tokens per CTA
  static constexpr int kGroup = kStoreThreads / kLanes;  // subspaces per CTA: one item a thread
  static constexpr int kSmem = kGroup * kCentroids * (DS + 1) * (int)sizeof(float);
  static_assert(DS <= 4 || P == 1, "registers");
};

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
  float* half_norm = cb_smem + C::kGroup * kCentroids * DS;
  const float* cb = (is_v ? a.v_cb : a.k_cb) + ((size_t)head * m_total + m0) * kCentroids * DS;
  const T* src = static_cast<const T*>(is_v ? a.value : a.key);
  const int64_t stride = is_v ? a.value_stride : a.key_stride;
  const int tok0 = blockIdx.x * C::kTokens;
  const int ntok = min(C::kTokens, a.num_tokens - tok0);
  const Pages& pg = a.pages;

  const float4* g4 = reinterpret_cast<const float4*>(cb);
  float4* s4 = reinterpret_cast<float4*>(cb_smem);
  for (int i = threadIdx.x; i < mg * kCentroids * DS / 4; i += kStoreThreads) s4[i] = g4[i];
  for (int j = threadIdx.x; j < mg * kCentroids; j += kStoreThreads) {
    const float* cj = cb + (size_t)j * DS;
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < DS; ++i) sq = __fmaf_rn(cj[i], cj[i], sq);
    half_norm[j] = 0.5f * sq;  // NaN for the NaN-marked centroid: never nearest
  }
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
    const T* x = src + (tok0 + min(t, ntok - 1)) * stride + (int64_t)head * a.head_dim + m * DS;
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
    const int t = lane + p * C::kLanes;
    if (m == 0) {  // the whole head's vector: one non-finite element marks the token
      const T* xh = src + (tok0 + t) * stride + (int64_t)head * a.head_dim;
      bool finite = true;  // & not &&: the loads need not wait for each other
      for (int i = 0; i < a.head_dim; ++i) finite &= isfinite(Elem<T>::to_float(xh[i]));
      if (!finite) code[p] = pg.lay.nan_code;
    }
    const int64_t blk = slot[p] / pg.block_size, off = slot[p] % pg.block_size;
    uint8_t* region = pg.base + blk * pg.block_stride + head * pg.head_stride;
    const int64_t pos = is_v ? pg.lay.v_off + (int64_t)m * pg.lay.v_sub + off
                             : pg.lay.k_off + off * pg.lay.k_tok + m;
    region[pos] = static_cast<uint8_t>(code[p]);
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

// 4 tokens per thread once 128-token CTAs still number a few per SM (prefill); 1 below.
constexpr int kManyTokens = 1024;

template <typename T, int DS>
cudaError_t launch_store(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
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
  if (a.m_k == a.m_v) return store_parts<T>(a, 0, 2, a.m_k, stream);
  const cudaError_t err = store_parts<T>(a, 0, 1, a.m_k, stream);
  return err != cudaSuccess ? err : store_parts<T>(a, 1, 1, a.m_v, stream);
}

}  // namespace

cudaError_t store(const StoreArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.m_k <= 0 || a.m_v <= 0 || a.head_dim % a.m_k || a.head_dim % a.m_v) return cudaErrorInvalidValue;
  return a.dtype == DType::kBFloat16 ? store_typed<__nv_bfloat16>(a, stream)
                                     : store_typed<__half>(a, stream);
}

}  // namespace pq
