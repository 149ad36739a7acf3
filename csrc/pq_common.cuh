// Small device helpers shared by the PQ kernels: element types, tensor-core MMA, loads.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include "pq_kernels.h"

namespace pq {

constexpr int kCentroids = 256;

// Bytes of one KV head's codebook image for the decode kernel (pq_decode.cuh, DecodeCfg):
// rows of 256 bytes, one per code, of K then V (head_dim 128) or both (64); none for 256.
__host__ __device__ constexpr int book_image_bytes(int d) {
  return d == 128 ? 2 * kCentroids * 256 : d == 64 ? kCentroids * 256 : 0;
}

template <typename T>
struct Elem;

template <>
struct Elem<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

// Query head `head`'s attention sink (DecodeArgs::sinks, non-null) in the log2 domain of the
// decode kernel's scores: a softmax over scores with maximum m gains 2^(sink_log2 - m) in its
// denominator.
template <typename T>
__device__ __forceinline__ float sink_log2(const DecodeArgs& a, int head) {
  const float s = a.sinks_f32 ? static_cast<const float*>(a.sinks)[head]
                              : Elem<T>::to_float(static_cast<const T*>(a.sinks)[head]);
  return s * 1.4426950408889634f;
}

#define PQ_MMA_M16N8K16(AB)                                                              \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." AB "." AB                       \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"          \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// D += A(16x16, row) * B(16x8, col) on tensor cores, fp32 accumulate, T = f16 or bf16.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    PQ_MMA_M16N8K16("f16");
  } else {
    PQ_MMA_M16N8K16("bf16");
  }
}
#undef PQ_MMA_M16N8K16

// Transpose an 8x8 b16 matrix held in mma fragment form (row lane/4, cols 2*(lane%4)+{0,1}).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// N bytes (a power of two, N <= 16, or a multiple of 16) into 32-bit words, widest loads.
template <int N>
__device__ __forceinline__ void load_bytes(const uint8_t* p, uint32_t (&w)[(N + 3) / 4]) {
  if constexpr (N % 16 == 0) {
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      uint4 v = reinterpret_cast<const uint4*>(p)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (N == 8) {
    uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else if constexpr (N == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  } else {
    static_assert(N == 2, "unsupported byte count");
    w[0] = *reinterpret_cast<const uint16_t*>(p);
  }
}

__device__ __forceinline__ int byte_of(const uint32_t* w, int i) { return (w[i >> 2] >> (8 * (i & 3))) & 0xff; }

// N 32-bit words moved as one aligned vector access (16-byte pieces when N >= 4).
template <int N>
struct alignas(N >= 4 ? 16 : 4 * N) Words {
  uint32_t w[N];
};

template <int N>
__device__ __forceinline__ void load_words(const void* p, uint32_t (&w)[N]) {
  const Words<N> v = *static_cast<const Words<N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = v.w[i];
}

template <int N>
__device__ __forceinline__ void store_words(void* p, const uint32_t (&w)[N]) {
  Words<N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.w[i] = w[i];
  *static_cast<Words<N>*>(p) = v;
}

// N 32-bit words from a shared-memory address (a shared-window address, as
// __cvta_generic_to_shared gives): the caller forms the whole address itself, with no base
// register added per load. Volatile: kept after the barrier that publishes the data.
template <int N>
__device__ __forceinline__ void lds_words(uint32_t addr, uint32_t (&w)[N]) {
  if constexpr (N == 1) {
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(w[0]) : "r"(addr));
  } else if constexpr (N == 2) {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(w[0]), "=r"(w[1]) : "r"(addr));
  } else {
    static_assert(N == 4, "one load of 1, 2 or 4 words");
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(addr));
  }
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t n;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(n));
  return n;
}

// Asynchronous 16-byte global -> shared copy (L2 only: codebooks are read once per CTA).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

// The same where `full`; else no bytes read (gmem must still be a valid address) and 16
// zero bytes written.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool full) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 16 : 0));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// From sm_90: an mbarrier with a transaction count, and bulk copies (TMA) that complete on one.
// Builds for older GPUs compile these to traps; their callers take cp.async paths there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define PQ_SM90(...) __trap()
#else
#define PQ_SM90(...) __VA_ARGS__
#endif

// An mbarrier in shared memory for one arrival and `bytes` of bulk copies. The caller makes
// the init visible to the other threads (a barrier) before they wait on it.
__device__ __forceinline__ void mbar_init_expect(uint64_t* bar, uint32_t bytes) {
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  PQ_SM90(asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n"
                       "fence.mbarrier_init.release.cluster;\n"
                       "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(b),
                       "r"(bytes)
                       : "memory"));
}

// Wait until the barrier's phase `parity` has completed: its bytes have landed and are visible.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t b = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  PQ_SM90(asm volatile("{\n"
                       ".reg .pred done;\n"
                       "WAIT:\n"
                       "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                       "@!done bra WAIT;\n"
                       "}\n" ::"r"(b),
                       "r"(parity)
                       : "memory"));
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory
// as one bulk copy, which signals `bar` as it lands.
__device__ __forceinline__ void bulk_copy(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  PQ_SM90(asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          static_cast<uint32_t>(__cvta_generic_to_shared(smem))),
      "l"(gmem), "r"(bytes), "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar)))
      : "memory"));
}
#undef PQ_SM90

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

}  // namespace pq
