// Quantize new K/V rows to their nearest centroids and write the codes into the pages.
//
// One CTA per (64 tokens, KV head, K|V); K and V have their own subspace width DS, so
// they are one launch when the widths agree and two otherwise. The fp32 codebook is staged in shared memory a
// group of subspaces at a time; a warp's lanes take 32 tokens of one subspace, so every
// centroid read is a broadcast. Distances are fp32 sums of squared differences in
// element order, and the first minimum wins (a NaN distance never does), as in
// reference.encode; subspace 0 of a non-finite vector gets the layout's nan_code.
#include <math_constants.h>

#include "pq_common.cuh"

namespace pq {
namespace {

constexpr int kStoreThreads = 256;
constexpr int kStoreTokens = 64;
constexpr int kStoreSmem = 64 * 1024;

template <typename T, int DS>
__global__ void __launch_bounds__(kStoreThreads) store_kernel(StoreArgs a, int first_part) {
  extern __shared__ float cb_smem[];  // [group subspaces][256][DS]
  const int head = blockIdx.y;
  const bool is_v = first_part + blockIdx.z == 1;  // part 0: K, part 1: V
  const int m_total = is_v ? a.m_v : a.m_k;
  const int group = kStoreSmem / (kCentroids * DS * (int)sizeof(float));
  const float* cb = (is_v ? a.v_cb : a.k_cb) + (size_t)head * m_total * kCentroids * DS;
  const T* src = static_cast<const T*>(is_v ? a.value : a.key);
  const int64_t stride = is_v ? a.value_stride : a.key_stride;
  const int tok0 = blockIdx.x * kStoreTokens;
  const int ntok = min(kStoreTokens, a.num_tokens - tok0);
  const Pages& pg = a.pages;

  for (int m0 = 0; m0 < m_total; m0 += group) {
    const int mg = min(group, m_total - m0);
    __syncthreads();  // the previous group's readers are done
    const float4* g4 = reinterpret_cast<const float4*>(cb + (size_t)m0 * kCentroids * DS);
    float4* s4 = reinterpret_cast<float4*>(cb_smem);
    for (int i = threadIdx.x; i < mg * kCentroids * DS / 4; i += kStoreThreads) s4[i] = g4[i];
    __syncthreads();
    for (int item = threadIdx.x; item < mg * kStoreTokens; item += kStoreThreads) {
      const int t = item % kStoreTokens, ml = item / kStoreTokens;
      if (t >= ntok) continue;
      const int64_t slot = a.slot_mapping[tok0 + t];
      if (slot < 0) continue;
      const int m = m0 + ml;
      const T* xh = src + (tok0 + t) * stride + (int64_t)head * a.head_dim;
      const T* x = xh + m * DS;
      float xv[DS];
#pragma unroll
      for (int i = 0; i < DS; ++i) xv[i] = Elem<T>::to_float(x[i]);
      const float* c = cb_smem + ml * kCentroids * DS;
      float best = CUDART_INF_F;
      int code = 0;
      for (int k = 0; k < kCentroids; ++k) {
        float dist = 0.f;
#pragma unroll
        for (int i = 0; i < DS; ++i) {
          const float diff = xv[i] - c[k * DS + i];
          dist = __fmaf_rn(diff, diff, dist);
        }
        if (dist < best) best = dist, code = k;
      }
      if (m == 0) {  // the whole head's vector: one non-finite element marks the token
        bool finite = true;
        for (int i = 0; i < a.head_dim; ++i) finite = finite && isfinite(Elem<T>::to_float(xh[i]));
        if (!finite) code = pg.lay.nan_code;
      }
      const int64_t blk = slot / pg.block_size, off = slot % pg.block_size;
      uint8_t* region = pg.base + blk * pg.block_stride + head * pg.head_stride;
      const int64_t pos = is_v ? pg.lay.v_off + (int64_t)m * pg.lay.v_sub + off
                               : pg.lay.k_off + off * pg.lay.k_tok + m;
      region[pos] = static_cast<uint8_t>(code);
    }
  }
}

// Parts [first_part, first_part + parts) of (K, V), all with subspace width DS.
template <typename T, int DS>
cudaError_t launch_store(const StoreArgs& a, int first_part, int parts, cudaStream_t stream) {
  auto kernel = store_kernel<T, DS>;
  // Set per call, not once per process: the attribute belongs to the current device.
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStoreSmem);
  if (err != cudaSuccess) return err;
  dim3 grid(ceil_div(a.num_tokens, kStoreTokens), a.num_kv_heads, parts);
  kernel<<<grid, kStoreThreads, kStoreSmem, stream>>>(a, first_part);
  return cudaGetLastError();
}

template <typename T>
cudaError_t store_parts(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  switch (a.head_dim / m) {
    case 2: return launch_store<T, 2>(a, first_part, parts, stream);
    case 4: return launch_store<T, 4>(a, first_part, parts, stream);
    case 8: return launch_store<T, 8>(a, first_part, parts, stream);
    case 16: return launch_store<T, 16>(a, first_part, parts, stream);
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
