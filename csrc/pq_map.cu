// The codebooks' linear maps (vllm_pq_backend/codebooks.py): y[r, h] = x[r, h] T[h / group],
// for up to three tensors in one launch (query, key and value rows of a step).
//
// Each output element is an fp32 sum over k = 0..D-1 in that order, whatever the number of
// rows: a row's result does not depend on what else is in the batch. (torch.matmul hands
// these small GEMMs to cuBLAS, which picks its kernel, and with it the order of the sums,
// by shape, so the same token could round differently in a batch of 1 and one of 64.)
// One CTA takes kRows rows of one head: the rows go to shared memory as fp32 (every lane
// then reads the same word: a broadcast), thread j owns output column j and streams
// column j of T from L2 once per CTA.
#include "pq_common.cuh"

namespace pq {
namespace {

constexpr int kRows = 16;

template <typename T>
__global__ void map_kernel(MapArgs a) {
  extern __shared__ float xs[];  // [kRows][D]
  const MapJob& job = a.jobs[blockIdx.z];
  const int head = blockIdx.y;
  if (head >= job.heads) return;
  const int d = a.head_dim, j = threadIdx.x;
  const int r0 = blockIdx.x * kRows, nr = min(kRows, a.rows - r0);
  const T* x = static_cast<const T*>(job.x);
  for (int i = j; i < nr * d; i += blockDim.x) {
    const int r = i / d, c = i % d;
    xs[i] = Elem<T>::to_float(x[(int64_t)(r0 + r) * job.x_stride + (int64_t)head * d + c]);
  }
  __syncthreads();  // (y may alias x: every read of this CTA's rows is done before a write)
  const float* t = job.t + (int64_t)(head / job.group) * d * d + j;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  for (int k = 0; k < d; ++k) {
    const float tk = t[(int64_t)k * d];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = __fmaf_rn(xs[r * d + k], tk, acc[r]);
  }
  T* y = static_cast<T*>(job.y);
  for (int r = 0; r < nr; ++r)
    y[(int64_t)(r0 + r) * job.y_stride + (int64_t)head * d + j] = Elem<T>::from_float(acc[r]);
}

}  // namespace

cudaError_t map_rows(const MapArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.num_jobs == 0) return cudaSuccess;
  if (a.num_jobs > kMaxMapJobs || a.head_dim <= 0 || a.head_dim > 1024) return cudaErrorInvalidValue;
  int heads = 0;
  for (int i = 0; i < a.num_jobs; ++i) heads = max(heads, a.jobs[i].heads);
  const dim3 grid(ceil_div(a.rows, kRows), heads, a.num_jobs);
  const size_t smem = sizeof(float) * kRows * a.head_dim;  // <= 16 KB for head_dim 256
  if (a.dtype == DType::kBFloat16)
    map_kernel<__nv_bfloat16><<<grid, a.head_dim, smem, stream>>>(a);
  else
    map_kernel<__half><<<grid, a.head_dim, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace pq
