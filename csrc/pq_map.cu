// The codebooks' linear maps (vllm_pq_backend/codebooks.py): y[r, h] = x[r, h] T[h / group],
// for up to three tensors in one launch (query, key and value rows of a step).
//
// Each output element is an fp32 sum over k = 0..D-1 in that order, whatever the number of
// rows: a row's result does not depend on what else is in the batch. (torch.matmul hands
// these small GEMMs to cuBLAS, which picks its kernel, and with it the order of the sums,
// by shape, so the same token could round differently in a batch of 1 and one of 64.)
// A CTA of 4 warps takes R rows of one head: the rows go to shared memory as fp32,
// transposed ([k][row]: a warp reads its rows of one k as one vector, the same words in
// every lane, a broadcast); warp w owns rows w*RW .., lane l owns the D/32 output columns
// l*D/32 .., so that every x read serves D/32 columns and every T read (a vector of one row
// of T) RW rows. T is read U rows at a time, all U loads issued before the multiply-adds
// that use them. (With one column per thread, one row of T at a time and one shared load
// per multiply-add, the kernel was latency- and shared-load-bound: 21 us for the 8 rows of
// a decode step, 108 us for a step of 1K rows, eval/results/layer_maps_145046e/.) A decode
// step's few rows take CTAs of 8 rows (2 a warp), more rows CTAs of 64 (32 at head_dim
// 256, for registers), so that each read of T serves more rows; the sums are the same
// either way.
#include "pq_common.cuh"

namespace pq {
namespace {

constexpr int kMapThreads = 128;
constexpr int kManyRows = 128;  // from here the larger CTAs

template <int D, bool Many>
struct MapCfg {
  static constexpr int CPL = D / 32;                            // output columns per lane
  static constexpr int RW = Many ? (D <= 128 ? 16 : 8) : 2;     // rows per warp
  static constexpr int R = RW * kMapThreads / 32;               // rows per CTA
  static constexpr int U = (Many ? 32 : 64) / CPL;              // rows of T in flight
  static constexpr int S = R + 4;  // floats between k rows of the staged x: float4-aligned,
                                   // fewer bank conflicts when staging
  static_assert(D % U == 0 && D % 32 == 0, "head_dim");
};

template <int N>
__device__ __forceinline__ void load_floats(const float* p, float (&f)[N]) {
  uint32_t w[N];
  load_words<N>(p, w);
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = __uint_as_float(w[i]);
}

// (A minimum of 1 CTA per SM lets ptxas keep the U loads of T in registers at once: with
// the default bound it moved each load down to its multiply-adds, 34 registers instead of 96.)
template <typename T, int D, bool Many>
__global__ void __launch_bounds__(kMapThreads, 1) map_kernel(MapArgs a) {
  using C = MapCfg<D, Many>;
  __shared__ __align__(16) float xs[D * C::S];  // [k][row]
  const MapJob& job = a.jobs[blockIdx.z];
  const int head = blockIdx.y;
  if (head >= job.heads) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = blockIdx.x * C::R, nr = min(C::R, a.rows - r0);
  const T* x = static_cast<const T*>(job.x);
  for (int i = threadIdx.x; i < C::R * D; i += kMapThreads) {
    const int r = i / D, k = i % D;
    xs[k * C::S + r] = r < nr ? Elem<T>::to_float(x[(int64_t)(r0 + r) * job.x_stride + (int64_t)head * D + k]) : 0.f;
  }
  __syncthreads();  // (y may alias x: every read of this CTA's rows is done before a write)
  const float* t = job.t + (int64_t)(head / job.group) * D * D + lane * C::CPL;
  const float* xw = xs + warp * C::RW;
  float acc[C::RW][C::CPL];
#pragma unroll
  for (int r = 0; r < C::RW; ++r)
#pragma unroll
    for (int c = 0; c < C::CPL; ++c) acc[r][c] = 0.f;
  for (int k0 = 0; k0 < D; k0 += C::U) {
    float tk[C::U][C::CPL];
#pragma unroll
    for (int u = 0; u < C::U; ++u) load_floats<C::CPL>(t + (k0 + u) * D, tk[u]);
#pragma unroll
    for (int u = 0; u < C::U; ++u) {
      float xv[C::RW];
      load_floats<C::RW>(xw + (k0 + u) * C::S, xv);
#pragma unroll
      for (int r = 0; r < C::RW; ++r)
#pragma unroll
        for (int c = 0; c < C::CPL; ++c) acc[r][c] = __fmaf_rn(xv[r], tk[u][c], acc[r][c]);
    }
  }
  T* y = static_cast<T*>(job.y);
#pragma unroll
  for (int r = 0; r < C::RW; ++r) {
    const int row = warp * C::RW + r;
    if (row >= nr) break;
    uint32_t w[C::CPL / 2];
#pragma unroll
    for (int c = 0; c < C::CPL / 2; ++c) w[c] = Elem<T>::pack(acc[r][2 * c], acc[r][2 * c + 1]);
    store_words<C::CPL / 2>(y + (int64_t)(r0 + row) * job.y_stride + (int64_t)head * D + lane * C::CPL, w);
  }
}

template <typename T, int D>
cudaError_t launch_map(const MapArgs& a, int heads, cudaStream_t stream) {
  const bool many = a.rows >= kManyRows;
  const dim3 grid(ceil_div(a.rows, many ? MapCfg<D, true>::R : MapCfg<D, false>::R), heads, a.num_jobs);
  if (many)
    map_kernel<T, D, true><<<grid, kMapThreads, 0, stream>>>(a);
  else
    map_kernel<T, D, false><<<grid, kMapThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t map_typed(const MapArgs& a, int heads, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return launch_map<T, 64>(a, heads, stream);
    case 128: return launch_map<T, 128>(a, heads, stream);
    case 256: return launch_map<T, 256>(a, heads, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t map_rows(const MapArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.num_jobs == 0) return cudaSuccess;
  if (a.num_jobs > kMaxMapJobs) return cudaErrorInvalidValue;
  int heads = 0;
  for (int i = 0; i < a.num_jobs; ++i) heads = max(heads, a.jobs[i].heads);
  return a.dtype == DType::kBFloat16 ? map_typed<__nv_bfloat16>(a, heads, stream)
                                     : map_typed<__half>(a, heads, stream);
}

}  // namespace pq
