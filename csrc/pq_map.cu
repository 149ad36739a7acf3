// The codebooks' linear maps (vllm_pq_backend/codebooks.py): y[r, h] = x[r, h] T[h / group],
// for up to three tensors in one launch (query, key and value rows of a step).
//
// Each output element is an fp32 sum over k = 0..D-1 in that order, whatever the number of
// rows: a row's result does not depend on what else is in the batch. (torch.matmul hands
// these small GEMMs to cuBLAS, which picks its kernel, and with it the order of the sums,
// by shape, so the same token could round differently in a batch of 1 and one of 64.)
// One CTA takes R rows of one head: the rows go to shared memory as fp32, transposed so
// that a thread reads the R rows of one k as R/4 float4 loads, the same words in every lane
// (broadcasts); thread j owns output column j and reads column j of T 32 entries at a time,
// all 32 loads issued before the multiply-adds that use them. (One load at a time, each
// waited for, left the kernel latency-bound: 21 us for the 8 rows of a decode step, 108 us
// for 1K rows, eval/results/maps_*/.) R is 8 for a decode step's few rows and 64 (32 at
// head_dim 256, for shared memory) for more, so that each CTA's read of T serves more
// rows; the sums are the same either way.
#include "pq_common.cuh"

namespace pq {
namespace {

constexpr int kUnroll = 32;     // T entries in flight per thread (head_dim is a multiple)
constexpr int kManyRows = 128;  // from here the larger R

template <int R>
__host__ __device__ constexpr int xs_stride() { return R + 4; }  // words between k rows: fewer
                                                                 // bank conflicts on staging,
                                                                 // float4-aligned

template <typename T, int R>
__global__ void map_kernel(MapArgs a) {
  extern __shared__ float4 xs4[];  // [D][xs_stride<R>()] floats
  float* xs = reinterpret_cast<float*>(xs4);
  const MapJob& job = a.jobs[blockIdx.z];
  const int head = blockIdx.y;
  if (head >= job.heads) return;
  const int d = a.head_dim, j = threadIdx.x;
  const int r0 = blockIdx.x * R, nr = min(R, a.rows - r0);
  const T* x = static_cast<const T*>(job.x);
  for (int i = j; i < R * d; i += blockDim.x) {
    const int r = i / d, c = i % d;
    xs[c * xs_stride<R>() + r] =
        r < nr ? Elem<T>::to_float(x[(int64_t)(r0 + r) * job.x_stride + (int64_t)head * d + c]) : 0.f;
  }
  __syncthreads();  // (y may alias x: every read of this CTA's rows is done before a write)
  const float* t = job.t + (int64_t)(head / job.group) * d * d + j;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int k0 = 0; k0 < d; k0 += kUnroll) {
    float tk[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) tk[u] = __ldg(t + (int64_t)(k0 + u) * d);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float4* xk = reinterpret_cast<const float4*>(xs + (k0 + u) * xs_stride<R>());
#pragma unroll
      for (int q = 0; q < R / 4; ++q) {
        const float4 v = xk[q];
        acc[4 * q] = __fmaf_rn(v.x, tk[u], acc[4 * q]);
        acc[4 * q + 1] = __fmaf_rn(v.y, tk[u], acc[4 * q + 1]);
        acc[4 * q + 2] = __fmaf_rn(v.z, tk[u], acc[4 * q + 2]);
        acc[4 * q + 3] = __fmaf_rn(v.w, tk[u], acc[4 * q + 3]);
      }
    }
  }
  T* y = static_cast<T*>(job.y);
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (r < nr) y[(int64_t)(r0 + r) * job.y_stride + (int64_t)head * d + j] = Elem<T>::from_float(acc[r]);
}

template <typename T, int R>
cudaError_t launch_map(const MapArgs& a, int heads, cudaStream_t stream) {
  const dim3 grid(ceil_div(a.rows, R), heads, a.num_jobs);
  const size_t smem = sizeof(float) * xs_stride<R>() * a.head_dim;  // <= 35 KB
  map_kernel<T, R><<<grid, a.head_dim, smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t map_typed(const MapArgs& a, int heads, cudaStream_t stream) {
  if (a.rows < kManyRows) return launch_map<T, 8>(a, heads, stream);
  return a.head_dim <= 128 ? launch_map<T, 64>(a, heads, stream) : launch_map<T, 32>(a, heads, stream);
}

}  // namespace

cudaError_t map_rows(const MapArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.num_jobs == 0) return cudaSuccess;
  if (a.num_jobs > kMaxMapJobs || a.head_dim <= 0 || a.head_dim > 1024 || a.head_dim % kUnroll)
    return cudaErrorInvalidValue;
  int heads = 0;
  for (int i = 0; i < a.num_jobs; ++i) heads = max(heads, a.jobs[i].heads);
  return a.dtype == DType::kBFloat16 ? map_typed<__nv_bfloat16>(a, heads, stream)
                                     : map_typed<__half>(a, heads, stream);
}

}  // namespace pq
