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
// n-tile at a time, for registers); A fragments come from shared memory by ldmatrix, one
// instruction per k-step of 16 row-vectors. Output columns are permuted across a warp's
// n-tiles (col_of) so that a lane's accumulators are 2*NTW consecutive columns of its rows:
// one store each. The row-vectors' global offsets (a division by the group size each) are
// computed once per CTA into shared memory, for the copies in and the stores out.
// At Llama-3-8B's shape on an H200 the two launches of a layer take 7.9 us for a decode step
// of 8 requests and 30.2 us for a 1K-token prompt (10.0 and 44.0 us with A fragments
// assembled in registers from 16-byte shared loads and the rows staged by a loop of loads
// and shared stores).
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
  // bytes between staged row-vectors: 16 mod 128, so that the 8 rows of an ldmatrix phase
  // (16 bytes each) fall in distinct bank groups
  static constexpr int SP = 2 * D + 16;
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

// The A fragment of rows 0..15 and k 0..15 of the 16-row tile at shared address `at` (row
// stride SP bytes; each lane passes its row's address: lane % 16, k 8 * (lane / 16)).
__device__ __forceinline__ void ldmatrix_x4(uint32_t at, uint32_t (&a)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(at));
}

template <typename T, int D>
__global__ void __launch_bounds__(32 * kMapWarps) map_kernel(MapArgs a) {
  using C = MapCfg<D>;
  __shared__ __align__(16) uint8_t xs[C::R * C::SP];
  __shared__ int64_t x_at[C::R], y_at[C::R];  // elements from x / y of each row-vector
  const MapJob& job = a.jobs[blockIdx.z];
  const int map = blockIdx.y, nvec = a.rows * job.group, v0 = blockIdx.x * C::R;
  if (map >= job.heads / job.group || v0 >= nvec) return;
  const int nv = min(C::R, nvec - v0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, r = lane / 4, c = lane % 4;

  // B fragments of the warp's n-tiles s0 .. s0 + NP - 1, [n-tile][k-step][b0, b1]: lane
  // (r, c) holds T[16j + 2c + 8h + {0, 1}][col_of(r)]. Loaded as fp32 (load_b), then split
  // into their two 16-bit parts (split_b).
  const float* t = job.t + (int64_t)map * D * D;
  float tf[C::NP][C::KS][2][2];
  uint32_t bh[C::NP][C::KS][2], bl[C::NP][C::KS][2];
  auto load_b = [&](int s0) {
#pragma unroll
    for (int s = 0; s < C::NP; ++s) {
      const float* tc = t + col_of<D>(warp, s0 + s, r);
#pragma unroll
      for (int j = 0; j < C::KS; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) tf[s][j][h][e] = tc[(16 * j + 2 * c + 8 * h + e) * D];
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
  load_b(0);

  // row-vector v: row v / group, head map * group + v % group (heads of a row are adjacent);
  // past nv: the CTA's first (a valid address for the copies, which read none of it)
  if (threadIdx.x < C::R) {
    const int v = v0 + (threadIdx.x < nv ? threadIdx.x : 0), head = map * job.group + v % job.group;
    x_at[threadIdx.x] = (int64_t)(v / job.group) * job.x_stride + (int64_t)head * D;
    y_at[threadIdx.x] = (int64_t)(v / job.group) * job.y_stride + (int64_t)head * D;
  }
  __syncthreads();
  // The rows into shared memory as asynchronous copies, all of a thread's in flight at once
  // and with T's loads (staged by a loop of loads and shared stores they paid the global
  // latency once per round: 8 rounds at head_dim 128); rows past nv as zeros.
  const T* x = static_cast<const T*>(job.x);
  constexpr int CPR = D / 8;  // 16-byte pieces of a row-vector
  static_assert(C::R * CPR % (32 * kMapWarps) == 0, "whole rounds of pieces");
#pragma unroll
  for (int k = 0; k < C::R * CPR / (32 * kMapWarps); ++k) {
    const int i = threadIdx.x + k * 32 * kMapWarps, vi = i / CPR, q = i % CPR;
    cp_async16_zfill(xs + vi * C::SP + 16 * q, x + x_at[vi] + 8 * q, vi < nv);
  }
  split_b();
  // (behind a condition that always holds: unconditional, ptxas hoisted the wait above most
  // of T's loads, which then issued only once the rows had arrived)
  if (job.heads > 0) cp_async_wait_all();
  __syncthreads();  // (y may alias x: every read of this CTA's rows is done before a write)

  // this lane's ldmatrix row: lane % 16 of the m-tile, k half lane / 16
  const uint32_t xs_at = static_cast<uint32_t>(__cvta_generic_to_shared(xs)) + (lane % 16) * C::SP + 16 * (lane / 16);
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
      for (int j = 0; j < C::KS; ++j) {
        uint32_t af[4];
        ldmatrix_x4(xs_at + 16 * mt * C::SP + 32 * j, af);
#pragma unroll
        for (int s = 0; s < C::NP; ++s) {
          mma<T>(acc[s][0], af, bh[s][j][0], bh[s][j][1]);
          mma<T>(acc[s][1], af, bl[s][j][0], bl[s][j][1]);
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
        store_words<C::NP>(y + y_at[vi] + col_of<D>(warp, s0, 2 * c), w);
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
