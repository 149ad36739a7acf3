// Prefill's pages for FlashAttention (vllm_pq_backend/ops.py, _pages and _segment_pages): a
// group's pages dequantized to the activation dtype in FlashAttention's paged layout
// [pages, B, kv_heads, D], and the segments' own subpages after them. Launched from C++
// rather than Triton: in vLLM's engine two Triton launches take 171 us of host time a layer
// for about 20 us of GPU work, more than the FlashAttention call itself.
#include "pq_common.cuh"

namespace pq {
namespace {

constexpr int kPagesThreads = 256;

// `bytes` (4, 8 or 16: one subspace's centroid, D / M elements) from src to dst, both
// aligned to it.
__device__ __forceinline__ void copy_entry(void* dst, const void* src, int bytes) {
  if (bytes == 16) {
    *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
  } else if (bytes == 8) {
    *static_cast<uint2*>(dst) = *static_cast<const uint2*>(src);
  } else {
    *static_cast<uint32_t*>(dst) = *static_cast<const uint32_t*>(src);
  }
}

// One codebook's part of a (page, KV head): each thread a (token, subspace) at a time,
// subspaces fastest so that a warp's writes are contiguous. `code(t, s)` reads the code.
// M is a power of two (dequant_pages checks): shifts, not divisions, split the index.
template <typename T, typename Code>
__device__ __forceinline__ void dequant_part(T* out, const T* cb, int b, int m, int d, int row, Code code) {
  const int ds = d / m, bytes = ds * (int)sizeof(T), lg = __ffs(m) - 1;
  for (int i = threadIdx.x; i < b * m; i += kPagesThreads) {
    const int t = i >> lg, s = i & (m - 1);
    copy_entry(out + (int64_t)t * row + s * ds, cb + ((size_t)s * kCentroids + code(t, s)) * ds, bytes);
  }
}

// A CTA per (entry, KV head): the entry's B tokens, K then V. Entries whose `first` is
// another entry are skipped: the table points at that one.
template <typename T>
__global__ void __launch_bounds__(kPagesThreads) dequant_pages_kernel(DequantArgs a) {
  const int entry = blockIdx.x, head = blockIdx.y;
  if (a.first != nullptr && a.first[entry] != entry) return;
  const int64_t blk = a.block_ids[(int64_t)entry * a.ids_stride];
  const uint8_t* region = a.pages.base + blk * a.pages.block_stride + head * a.pages.head_stride;
  const PageLayout lay = a.pages.lay;
  const int b = a.pages.block_size, d = a.head_dim, row = a.num_kv_heads * d;
  const int64_t out0 = ((int64_t)entry * b * a.num_kv_heads + head) * d;
  dequant_part(static_cast<T*>(a.k_out) + out0, static_cast<const T*>(a.k_cb) + (size_t)head * a.m_k * kCentroids * (d / a.m_k),
               b, a.m_k, d, row, [&](int t, int s) { return region[lay.k_off + t * lay.k_tok + s]; });
  dequant_part(static_cast<T*>(a.v_out) + out0, static_cast<const T*>(a.v_cb) + (size_t)head * a.m_v * kCentroids * (d / a.m_v),
               b, a.m_v, d, row, [&](int t, int s) { return region[lay.v_off + s * lay.v_sub + t]; });
}

// Rows first + i of k_out / v_out ([*, kv_heads, D], contiguous): row at[i] of the keys and
// values, or zeros where at[i] < 0. A warp a row, 16-byte pieces where every row is
// 16-byte aligned (V: uint4), 2-byte ones otherwise.
template <typename V>
__global__ void __launch_bounds__(kPagesThreads) own_subpages_kernel(SubpageArgs a) {
  constexpr int kWarps = kPagesThreads / 32;
  const int64_t i = (int64_t)blockIdx.x * kWarps + threadIdx.x / 32;
  if (i >= a.count) return;
  const int64_t src = a.at[i], row_bytes = (int64_t)a.num_kv_heads * a.head_dim * a.elem_bytes;
  const int64_t words = row_bytes / (int64_t)sizeof(V);
  const int64_t dst_off = (a.first + i) * row_bytes;
#pragma unroll 1
  for (int part = 0; part < 2; ++part) {
    uint8_t* dst = static_cast<uint8_t*>(part == 0 ? a.k_out : a.v_out) + dst_off;
    const uint8_t* row = src < 0 ? nullptr
                                 : static_cast<const uint8_t*>(part == 0 ? a.kv.key : a.kv.value) +
                                       src * (part == 0 ? a.kv.key_stride : a.kv.value_stride) * a.elem_bytes;
    for (int64_t w = threadIdx.x % 32; w < words; w += 32) {
      V x{};
      if (row != nullptr) x = reinterpret_cast<const V*>(row)[w];
      reinterpret_cast<V*>(dst)[w] = x;
    }
  }
}

}  // namespace

cudaError_t dequant_pages(const DequantArgs& a, cudaStream_t stream) {
  if (a.num_entries == 0) return cudaSuccess;
  if (a.m_k <= 0 || a.m_v <= 0 || a.head_dim % a.m_k || a.head_dim % a.m_v) return cudaErrorInvalidValue;
  for (int m : {a.m_k, a.m_v}) {
    const int bytes = a.head_dim / m * 2;
    if ((m & (m - 1)) || (bytes != 4 && bytes != 8 && bytes != 16)) return cudaErrorInvalidValue;
  }
  const dim3 grid(a.num_entries, a.num_kv_heads);
  if (a.dtype == DType::kBFloat16)
    dequant_pages_kernel<__nv_bfloat16><<<grid, kPagesThreads, 0, stream>>>(a);
  else
    dequant_pages_kernel<__half><<<grid, kPagesThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t own_subpages(const SubpageArgs& a, cudaStream_t stream) {
  if (a.count == 0) return cudaSuccess;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const int64_t row_bytes = (int64_t)a.num_kv_heads * a.head_dim * a.elem_bytes;
  const bool vec = aligned(a.kv.key) && aligned(a.kv.value) && aligned(a.k_out) && aligned(a.v_out) &&
                   row_bytes % 16 == 0 && (a.kv.key_stride * a.elem_bytes) % 16 == 0 &&
                   (a.kv.value_stride * a.elem_bytes) % 16 == 0;
  const int blocks = (int)((a.count + kPagesThreads / 32 - 1) / (kPagesThreads / 32));
  if (vec)
    own_subpages_kernel<uint4><<<blocks, kPagesThreads, 0, stream>>>(a);
  else
    own_subpages_kernel<uint16_t><<<blocks, kPagesThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace pq
