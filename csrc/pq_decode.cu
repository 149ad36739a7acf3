// Decode entry point: picks the (dtype, head_dim, Mk, Mv) instantiation (the kernel merges
// its split results itself, pq_decode.cuh). The instantiations live in generated units
// (csrc/gen_units.py, which also writes the list of cases below) so that they compile
// in parallel.
#include "pq_common.cuh"

namespace pq {

template <typename T, int D, int MK, int MV>
cudaError_t launch_decode(const DecodeArgs& a, cudaStream_t stream);
template <typename T, int D, int MK, int MV>
cudaError_t launch_books(uint8_t* out, const void* k_cb, const void* v_cb, int kv_heads, cudaStream_t stream);

namespace {

template <typename T>
cudaError_t decode_typed(const DecodeArgs& a, cudaStream_t stream) {
  switch ((int64_t)a.head_dim * 1000000 + a.m_k * 1000 + a.m_v) {
#define PQ_CASE(D, MK, MV) \
  case D * 1000000 + MK * 1000 + MV: return launch_decode<T, D, MK, MV>(a, stream);
#include "pq_decode_shapes.inc"  // generated next to the units (csrc/gen_units.py)
#undef PQ_CASE
    default: return cudaErrorInvalidValue;
  }
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
