// The codebooks' linear maps (vllm_pq_backend/codebooks.py): y[r, h] = x[r, h] T[h / group],
// for up to three tensors in one launch (query, key and value rows of a step).
//
// On tensor cores. T (fp32) is split into two parts of the activation's 16-bit type,
// T = Thi + Tlo + e with |e| <= 2^-17 |T| (bf16; 2^-23 for fp16), and mma.m16n8k16 sums
// x Thi and x Tlo in fp32, each in accumulators of its own, added at the end: x is exact in
// its own type, so the map keeps fp32's accuracy, which a 16-bit T would not (impl.py),
// for two MMAs per product. A row's result does not
// depend on the rest of the batch: each output element is the same sequence of MMAs over
// k, in the same order, whichever tile and CTA the row lands in, and the rows of an MMA
// tile do not mix. (torch.matmul hands these small GEMMs to cuBLAS, which picks its
// kernel, and with it the order of the sums, by shape.)
//
// A CTA takes R row-vectors (row, head) of one map's heads: it stages them in shared
// memory, then each of its 8 warps computes D/8 output columns (NTW n-tiles of 8) of all
// of them, its slice of Thi / Tlo held in registers as MMA B fragments (head_dim 256: one
// n-tile at a time, for registers). Sums run over a permuted k (dims), the same for A and
// B: in k-step j lane column c holds dims 32*(j/2) + 8c + 4*(j%2) + {0..3}, so that one
// 16-byte shared load gives a lane two k-steps of a row. Output columns are permuted
// across a warp's n-tiles (col_of) so that a lane's accumulators are 2*NTW consecutive
// columns of its rows: one store each. At Llama-3-8B's shape (H200) a launch takes 4.9 us
// for a decode step of 8 requests (launch latency: the CUDA-core kernel before took 4.8)
// and 25.7 us with a 1K-token prompt (before: 53.8): eval/results/layer_maps/.
#include "pq_common.cuh"

namespace pq {
namespace {

constexpr int kMapWarps = 8;

template <int D>
struct MapCfg {
  static constexpr int KS = D / 16;              // k-steps
  static constexpr int NTW = D / 8 / kMapWarps;  // n-tiles (8 output columns) per warp
  static constexpr int NP = D == 256 ? 1 : NTW;  // n-tiles whose B fragments are held at once
  static constexpr int MT = D == 256 ? 4 : 8;    // m-tiles (16 row-vectors) per CTA
  static constexpr int R = 16 * MT;              // row-vectors per CTA
  // bytes between staged row-vectors: 4 mod 8 16-byte units, so that the 8 lanes of a
  // 16-byte load's phase (rows r, r + 1, columns c = 0..3) hit distinct banks
  static constexpr int SP = 2 * D + 64;
  static_assert(NTW >= 1 && 4 * NP == map_out_align(D), "a lane stores NP words of a row");
};

// Output column of lane row (B) / accumulator column (C) n of the warp's n-tile s.
template <int D>
__device__ __forceinline__ int col_of(int warp, int s, int n) {
  constexpr int NTW = MapCfg<D>::NTW;
  return 8 * NTW * warp + 2 * NTW * (n / 2) + 2 * s + n % 2;
}

// Two fp32 values as a pair of the 16-bit type T (hi) and the pair of their remainders (lo).
template <typename T>
__device__ __forceinline__ void split_pair(float f0, float f1, uint32_t& hi, uint32_t& lo) {
  hi = Elem<T>::pack(f0, f1);
  const T* h = reinterpret_cast<const T*>(&hi);
  lo = Elem<T>::pack(f0 - Elem<T>::to_float(h[0]), f1 - Elem<T>::to_float(h[1]));
}

template <typename T, int D>
__global__ void __launch_bounds__(32 * kMapWarps) map_kernel(MapArgs a) {
  using C = MapCfg<D>;
  __shared__ __align__(16) uint8_t xs[C::R * C::SP];
  const MapJob& job = a.jobs[blockIdx.z];
  const int map = blockIdx.y, nvec = a.rows * job.group, v0 = blockIdx.x * C::R;
  if (map >= job.heads / job.group || v0 >= nvec) return;
  const int nv = min(C::R, nvec - v0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;
  // row-vector v: row v / group, head map * group + v % group (heads of a row are adjacent)
  auto offset = [&](int v, int64_t stride) {
    return (v / job.group) * stride + (int64_t)(map * job.group + v % job.group) * D;
  };

  // B fragments of the warp's n-tiles s0 .. s0 + NP - 1: [n-tile][k-step][b0, b1], loaded
  // as fp32 (load_b), then split into their two 16-bit parts (split_b).
  const float* t = job.t + (int64_t)map * D * D;
  float tf[C::NP][C::KS][2][2];
  uint32_t bh[C::NP][C::KS][2], bl[C::NP][C::KS][2];
  auto load_b = [&](int s0) {
#pragma unroll
    for (int s = 0; s < C::NP; ++s) {
      const float* tc = t + col_of<D>(warp, s0 + s, r);
#pragma unroll
      for (int j = 0; j < C::KS; ++j) {
        const int d0 = 32 * (j / 2) + 8 * c + 4 * (j % 2);
#pragma unroll
        for (int h = 0; h < 2; ++h) tf[s][j][h][0] = tc[(d0 + 2 * h) * D], tf[s][j][h][1] = tc[(d0 + 2 * h + 1) * D];
      }
    }
  };
  auto split_b = [&]() {
#pragma unroll
    for (int s = 0; s < C::NP; ++s)
#pragma unroll
      for (int j = 0; j < C::KS; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) split_pair<T>(tf[s][j][h][0], tf[s][j][h][1], bh[s][j][h], bl[s][j][h]);
  };

  // T's entries and the CTA's row-vectors load together: the rows as asynchronous copies,
  // each thread's all in flight at once, rows past nv as zeros. (Staged by a loop of
  // loads and shared stores they paid the global latency once per round, 8 rounds at
  // head_dim 128, and the kernel took 25.7 us for a 1K-token prompt: eval/results/map_kernel/.)
  load_b(0);
  const T* x = static_cast<const T*>(job.x);
  constexpr int CPR = D / 8;  // 16-byte pieces of a row-vector
  static_assert(C::R * CPR % (32 * kMapWarps) == 0, "whole rounds of pieces");
#pragma unroll
  for (int k = 0; k < C::R * CPR / (32 * kMapWarps); ++k) {
    const int i = threadIdx.x + k * 32 * kMapWarps, vi = i / CPR, q = i % CPR;
    cp_async16_zfill(xs + vi * C::SP + 16 * q, x + offset(vi < nv ? v0 + vi : v0, job.x_stride) + 8 * q, vi < nv);
  }
  split_b();
  // (behind a condition that always holds: unconditional, ptxas hoisted the wait above most
  // of T's loads, which then issued only once the rows had arrived)
  if (job.heads > 0) cp_async_wait_all();
  __syncthreads();  // (y may alias x: every read of this CTA's rows is done before a write)

  const uint32_t xs_at = static_cast<uint32_t>(__cvta_generic_to_shared(xs)) + r * C::SP + 16 * c;
  T* y = static_cast<T*>(job.y);
  for (int s0 = 0; s0 < C::NTW; s0 += C::NP) {
    if (s0 > 0) load_b(s0), split_b();
    for (int mt = 0; 16 * mt < nv; ++mt) {
      // x Thi and x Tlo in accumulators of their own, added at the end: chains of KS
      // dependent MMAs instead of 2 KS, for the tensor pipe's latency
      float acc[C::NP][2][4];
#pragma unroll
      for (int s = 0; s < C::NP; ++s)
#pragma unroll
        for (int p = 0; p < 2; ++p) acc[s][p][0] = acc[s][p][1] = acc[s][p][2] = acc[s][p][3] = 0.f;
#pragma unroll
      for (int i = 0; i < D / 32; ++i) {
        uint32_t u0[4], u1[4];  // rows r and r + 8, dims 32i + 8c .. + 7
        lds_words<4>(xs_at + 16 * mt * C::SP + 64 * i, u0);
        lds_words<4>(xs_at + (16 * mt + 8) * C::SP + 64 * i, u1);
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // k-step 2i + h
          const uint32_t af[4] = {u0[2 * h], u1[2 * h], u0[2 * h + 1], u1[2 * h + 1]};
#pragma unroll
          for (int s = 0; s < C::NP; ++s) {
            mma<T>(acc[s][0], af, bh[s][2 * i + h][0], bh[s][2 * i + h][1]);
            mma<T>(acc[s][1], af, bl[s][2 * i + h][0], bl[s][2 * i + h][1]);
          }
        }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int vi = 16 * mt + r + 8 * e;
        if (vi >= nv) continue;
        uint32_t w[C::NP];
#pragma unroll
        for (int s = 0; s < C::NP; ++s)
          w[s] = Elem<T>::pack(acc[s][0][2 * e] + acc[s][1][2 * e], acc[s][0][2 * e + 1] + acc[s][1][2 * e + 1]);
        store_words<C::NP>(y + offset(v0 + vi, job.y_stride) + col_of<D>(warp, s0, 2 * c), w);
      }
    }
  }
}

template <typename T, int D>
cudaError_t launch_map(const MapArgs& a, cudaStream_t stream) {
  int maps = 0, vecs = 0;
  for (int i = 0; i < a.num_jobs; ++i) {
    maps = max(maps, a.jobs[i].heads / a.jobs[i].group);
    vecs = max(vecs, a.rows * a.jobs[i].group);
  }
  map_kernel<T, D><<<dim3(ceil_div(vecs, MapCfg<D>::R), maps, a.num_jobs), 32 * kMapWarps, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t map_typed(const MapArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return launch_map<T, 64>(a, stream);
    case 128: return launch_map<T, 128>(a, stream);
    case 256: return launch_map<T, 256>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t map_rows(const MapArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.num_jobs == 0) return cudaSuccess;
  if (a.num_jobs > kMaxMapJobs) return cudaErrorInvalidValue;
  return a.dtype == DType::kBFloat16 ? map_typed<__nv_bfloat16>(a, stream) : map_typed<__half>(a, stream);
}

}  // namespace pq
