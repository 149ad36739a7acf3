// Torch custom ops over the torch-free kernels: torch.ops.pq_backend.store / .decode.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "pq_kernels.h"

namespace {

using torch::Tensor;

pq::DType dtype_of(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "PQ kernels take float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? pq::DType::kBFloat16 : pq::DType::kFloat16;
}

pq::Pages pages_of(const Tensor& kv_cache, int64_t k_off, int64_t k_tok, int64_t v_off,
                   int64_t v_sub) {
  // vLLM's layer view [blocks, kv_heads, B, 2M] (uint8/int8), a (block, head) region dense
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.element_size() == 1, "kv_cache must be a 4-D byte view");
  TORCH_CHECK(kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3),
              "each (block, head) region of kv_cache must be contiguous");
  return pq::Pages{static_cast<uint8_t*>(kv_cache.data_ptr()), kv_cache.stride(0),
                   kv_cache.stride(1), static_cast<int>(kv_cache.size(2)),
                   pq::PageLayout{(int)k_off, (int)k_tok, (int)v_off, (int)v_sub}};
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "vllm_pq_backend ", what, " kernel failed: ", cudaGetErrorString(err));
}

void store(Tensor kv_cache, const Tensor& key, const Tensor& value, const Tensor& slot_mapping,
           const Tensor& k_cb, const Tensor& v_cb, int64_t k_off, int64_t k_tok, int64_t v_off,
           int64_t v_sub) {
  const at::cuda::OptionalCUDAGuard guard(key.device());
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && key.stride(1) == key.size(2), "key must be [n, H, D] with dense rows");
  TORCH_CHECK(value.sizes() == key.sizes() && value.stride(2) == 1 && value.stride(1) == value.size(2), "value must match key");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64");
  TORCH_CHECK(k_cb.scalar_type() == at::kFloat && k_cb.is_contiguous() && v_cb.is_contiguous() &&
                  v_cb.scalar_type() == at::kFloat, "store codebooks must be contiguous float32");
  pq::StoreArgs a{};
  a.pages = pages_of(kv_cache, k_off, k_tok, v_off, v_sub);
  a.key = key.data_ptr();
  a.value = value.data_ptr();
  a.key_stride = key.stride(0);
  a.value_stride = value.stride(0);
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.k_cb = k_cb.data_ptr<float>();
  a.v_cb = v_cb.data_ptr<float>();
  a.num_tokens = static_cast<int>(slot_mapping.size(0));
  a.num_kv_heads = static_cast<int>(key.size(1));
  a.head_dim = static_cast<int>(key.size(2));
  a.m = static_cast<int>(k_cb.size(1));
  a.dtype = dtype_of(key);
  TORCH_CHECK(key.size(0) >= a.num_tokens, "fewer key rows than slots");
  check_cuda(pq::store(a, at::cuda::getCurrentCUDAStream()), "store");
}

void decode(Tensor out, const Tensor& q, const Tensor& kv_cache, const Tensor& block_table,
            const Tensor& seq_lens, const Tensor& k_cb, const Tensor& v_cb, const Tensor& win_k,
            const Tensor& win_v, const Tensor& rows, int64_t window, int64_t num_splits,
            double scale, bool lut, Tensor ws_o, Tensor ws_lse, int64_t k_off, int64_t k_tok,
            int64_t v_off, int64_t v_sub) {
  const at::cuda::OptionalCUDAGuard guard(q.device());
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [R, Hq, D] with dense heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2) &&
                  out.scalar_type() == q.scalar_type(), "out must match q");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "block_table must be int32 rows");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens must be contiguous int32");
  TORCH_CHECK(k_cb.scalar_type() == q.scalar_type() && v_cb.scalar_type() == q.scalar_type() &&
                  k_cb.is_contiguous() && v_cb.is_contiguous(), "codebooks must be contiguous, in q's dtype");
  const int64_t reqs = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(ws_o.numel() >= reqs * heads * (num_splits + 1) * d && ws_lse.numel() >= reqs * heads * (num_splits + 1),
              "decode workspace too small");
  pq::DecodeArgs a{};
  a.pages = pages_of(kv_cache, k_off, k_tok, v_off, v_sub);
  a.q = q.data_ptr();
  a.q_stride = q.stride(0);
  a.out = out.data_ptr();
  a.out_stride = out.stride(0);
  a.block_table = block_table.data_ptr<int32_t>();
  a.bt_stride = block_table.stride(0);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.k_cb = k_cb.data_ptr();
  a.v_cb = v_cb.data_ptr();
  a.window = static_cast<int>(window);
  if (window > 0) {
    TORCH_CHECK(win_k.dim() == 4 && win_k.is_contiguous() && win_v.is_contiguous() &&
                    win_k.size(2) == window && win_k.scalar_type() == q.scalar_type(),
                "window store must be contiguous [rows, kv_heads, W, D] in q's dtype");
    TORCH_CHECK(rows.scalar_type() == at::kInt && rows.is_contiguous() && rows.size(0) >= reqs, "rows must be int32 [R]");
    a.win_k = win_k.data_ptr();
    a.win_v = win_v.data_ptr();
    a.rows = rows.data_ptr<int32_t>();
  }
  a.num_reqs = static_cast<int>(reqs);
  a.num_heads = static_cast<int>(heads);
  a.num_kv_heads = static_cast<int>(k_cb.size(0));
  a.head_dim = static_cast<int>(d);
  a.m = static_cast<int>(k_cb.size(1));
  a.num_splits = static_cast<int>(num_splits);
  a.scale = static_cast<float>(scale);
  a.lut = lut;
  a.ws_o = ws_o.data_ptr<float>();
  a.ws_lse = ws_lse.data_ptr<float>();
  a.dtype = dtype_of(q);
  check_cuda(pq::decode(a, at::cuda::getCurrentCUDAStream()), "decode");
}

}  // namespace

TORCH_LIBRARY(pq_backend, m) {
  m.def(
      "store(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping, Tensor k_cb, "
      "Tensor v_cb, int k_off, int k_tok, int v_off, int v_sub) -> ()");
  m.def(
      "decode(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor k_cb, Tensor v_cb, Tensor win_k, Tensor win_v, Tensor rows, int window, "
      "int num_splits, float scale, bool lut, Tensor(b!) ws_o, Tensor(c!) ws_lse, int k_off, int k_tok, "
      "int v_off, int v_sub) -> ()");
}

TORCH_LIBRARY_IMPL(pq_backend, CUDA, m) {
  m.impl("store", &store);
  m.impl("decode", &decode);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.doc() = "vllm_pq_backend CUDA kernels"; }
