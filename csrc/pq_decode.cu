// Decode entry point: picks the (dtype, head_dim, Mk, Mv) instantiation, then, with more
// than one split, merges the split results by their log-sum-exp (a kernel of its own: the
// last CTA of each request merging them in place is slower).
// The instantiations live in generated units
// (csrc/gen_units.py, which also writes the list of cases below) so that they compile
// in parallel.
#include <math_constants.h>

#include "pq_common.cuh"

namespace pq {

template <typename T, int D, int MK, int MV>
cudaError_t launch_decode(const DecodeArgs& a, cudaStream_t stream);
template <typename T, int D, int MK, int MV>
cudaError_t launch_books(uint8_t* out, const void* k_cb, const void* v_cb, int kv_heads, cudaStream_t stream);

namespace {

// out[req, head] = sum_s 2^(lse_s - max) o_s / sum_s 2^(lse_s - max), skipping empty splits;
// with attention sinks, the sink joins that denominator here, once (sink_log2). The splits'
// results are sink-free: a sink in each would count it once per split that holds keys, and
// the output would depend on how the codes were split.
// The exact store's corrections (DecodeArgs::corr) join both sums at their own scale.
template <typename T>
__global__ void reduce_kernel(DecodeArgs a) {
  const int req = blockIdx.x, head = blockIdx.y, slots = a.num_splits, d = a.head_dim;
  const int64_t base = ((int64_t)req * a.num_heads + head) * slots;
  const float* lse = a.ws_lse + base;
  const int cs = a.corr != nullptr ? a.corr_slots : 0;
  const float* corr = cs ? a.corr + ((int64_t)req * a.num_heads + head) * cs * (d + 2) : nullptr;
  const float sink = a.sinks != nullptr ? sink_log2<T>(a, head) : 0.f;  // (in flight with lse's loads)
  float mx = -CUDART_INF_F;
  bool nan = false;  // a split that read a NaN-marked key (layout.py) makes the output NaN
  for (int s = 0; s < slots; ++s) mx = fmaxf(mx, lse[s]), nan = nan || isnan(lse[s]);
  for (int c = 0; c < cs; ++c) {
    const float m = corr[c * (d + 2) + d + 1], den = corr[c * (d + 2) + d];
    mx = fmaxf(mx, m), nan = nan || isnan(m) || isnan(den);
  }
  T* out = static_cast<T*>(a.out) + req * a.out_stride + (int64_t)head * d;
  for (int dim = threadIdx.x; dim < d; dim += blockDim.x) {
    float num = 0.f, den = 0.f;
    if (mx != -CUDART_INF_F) {
      for (int s = 0; s < slots; ++s) {
        if (lse[s] == -CUDART_INF_F) continue;  // nothing written there
        const float w = exp2f(lse[s] - mx);
        num += w * a.ws_o[(base + s) * d + dim];
        den += w;
      }
      for (int c = 0; c < cs; ++c) {
        const float* x = corr + c * (d + 2);
        if (x[d + 1] == -CUDART_INF_F) continue;  // no entry read there
        const float w = exp2f(x[d + 1] - mx);
        num += w * x[dim];
        den += w * x[d];
      }
    }
    if (a.sinks != nullptr && den > 0.f) den += exp2f(sink - mx);
    const float o = den > 0.f ? num / den : 0.f;
    out[dim] = Elem<T>::from_float(nan ? CUDART_NAN_F : o);
  }
}

template <typename T>
cudaError_t decode_typed(const DecodeArgs& a, cudaStream_t stream) {
  const int64_t key = (int64_t)a.head_dim * 1000000 + a.m_k * 1000 + a.m_v;
  cudaError_t err;
  switch (key) {
#define PQ_CASE(D, MK, MV) \
  case D * 1000000 + MK * 1000 + MV: err = launch_decode<T, D, MK, MV>(a, stream); break;
#include "pq_decode_shapes.inc"  // generated next to the units (csrc/gen_units.py)
#undef PQ_CASE
    default: return cudaErrorInvalidValue;
  }
  if (err != cudaSuccess || (a.num_splits == 1 && a.corr == nullptr)) return err;  // the kernel wrote out
  reduce_kernel<T><<<dim3(a.num_reqs, a.num_heads), 128, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t books_typed(uint8_t* out, const void* k_cb, const void* v_cb, int kv_heads, int head_dim, int m_k,
                        int m_v, cudaStream_t stream) {
  switch ((int64_t)head_dim * 1000000 + m_k * 1000 + m_v) {
#define PQ_CASE(D, MK, MV) \
  case D * 1000000 + MK * 1000 + MV: return launch_books<T, D, MK, MV>(out, k_cb, v_cb, kv_heads, stream);
#include "pq_decode_shapes.inc"
#undef PQ_CASE
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int decode_books_bytes(int head_dim) { return book_image_bytes(head_dim); }

cudaError_t decode_books(uint8_t* out, const void* k_cb, const void* v_cb, int kv_heads, int head_dim, int m_k,
                         int m_v, DType dtype, cudaStream_t stream) {
  if (kv_heads == 0 || book_image_bytes(head_dim) == 0) return cudaSuccess;
  return dtype == DType::kBFloat16 ? books_typed<__nv_bfloat16>(out, k_cb, v_cb, kv_heads, head_dim, m_k, m_v, stream)
                                   : books_typed<__half>(out, k_cb, v_cb, kv_heads, head_dim, m_k, m_v, stream);
}

cudaError_t decode(const DecodeArgs& a, cudaStream_t stream) {
  if (a.num_reqs == 0) return cudaSuccess;
  if (a.num_heads % a.num_kv_heads || a.pages.block_size % 32) return cudaErrorInvalidValue;
  return a.dtype == DType::kBFloat16 ? decode_typed<__nv_bfloat16>(a, stream)
                                     : decode_typed<__half>(a, stream);
}

}  // namespace pq
