// Torch custom ops over the torch-free kernels, torch.ops.pq_backend.*: store, window_write,
// dequant_pages, own_subpages, decode_books, decode and map (the schemas in TORCH_LIBRARY
// below; one typed Python wrapper each in vllm_pq_backend/cuda_ops.py).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "pq_kernels.h"

namespace {

using torch::Tensor;

pq::DType dtype_of(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "vllm_pq_backend: ", name, " must be float16 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kBFloat16 ? pq::DType::kBFloat16 : pq::DType::kFloat16;
}

// Every tensor an op reads or writes: on `dev`, of the expected rank and sizes (-1: any).
void check(const Tensor& t, const char* name, const at::Device& dev, std::vector<int64_t> sizes) {
  TORCH_CHECK(t.device() == dev, "vllm_pq_backend: ", name, " is on ", t.device(), ", expected ", dev);
  bool ok = t.dim() == (int64_t)sizes.size();
  for (size_t i = 0; ok && i < sizes.size(); ++i) ok = sizes[i] < 0 || t.size(i) == sizes[i];
  TORCH_CHECK(ok, "vllm_pq_backend: ", name, " has shape ", t.sizes(), ", expected ", at::IntArrayRef(sizes),
              " (-1: any)");
}

void check_dtype(const Tensor& t, const char* name, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, "vllm_pq_backend: ", name, " must be ", want, ", got ", t.scalar_type());
}

// A K / V pair written in place (window store, subpages): the first of shape `sizes`, the
// second of the first's shape, both of `dtype` and contiguous.
void check_pair(const Tensor& x, const Tensor& y, const char* nx, const char* ny, const at::Device& dev,
                const std::vector<int64_t>& sizes, at::ScalarType dtype) {
  check(x, nx, dev, sizes);
  check(y, ny, dev, std::vector<int64_t>(x.sizes().begin(), x.sizes().end()));
  check_dtype(x, nx, dtype);
  check_dtype(y, ny, dtype);
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous(), "vllm_pq_backend: ", nx, " and ", ny, " must be contiguous");
}

// Codebooks [kv_heads, M, 256, head_dim / M], contiguous.
int64_t check_codebook(const Tensor& cb, const char* name, const at::Device& dev, int64_t heads,
                       int64_t d, at::ScalarType dtype) {
  check(cb, name, dev, {heads, -1, 256, -1});
  check_dtype(cb, name, dtype);
  TORCH_CHECK(cb.is_contiguous() && cb.size(1) * cb.size(3) == d, "vllm_pq_backend: ", name,
              " must be contiguous [", heads, ", M, 256, ", d, "/M], got ", cb.sizes());
  return cb.size(1);
}

// A grid record per (KV head, subspace) [kv_heads, M, bytes] (vllm_pq_backend/nearest.py), or
// empty: the full search. Records exist for 2-D subspaces only.
const uint8_t* grid_of(const Tensor& g, const char* name, const at::Device& dev, int64_t heads,
                       int64_t m, int64_t d, int* bytes) {
  *bytes = 0;
  if (g.numel() == 0) return nullptr;
  check(g, name, dev, {heads, m, -1});
  check_dtype(g, name, at::kByte);
  TORCH_CHECK(g.is_contiguous() && g.size(2) % 16 == 0 && g.size(2) >= 32 && g.size(2) <= 16384 && d == 2 * m,
              "vllm_pq_backend: ", name, " must be contiguous [", heads, ", ", m,
              ", bytes (a multiple of 16, at most 16384)] for 2-D subspaces, got ", g.sizes(), " with head_dim ", d);
  *bytes = static_cast<int>(g.size(2));
  return g.data_ptr<uint8_t>();
}

// vLLM's layer view [blocks, kv_heads, B, state bytes >= Mk + Mv], a (block, head) region dense and
// laid out as vllm_pq_backend/layout.py says.
pq::Pages pages_of(const Tensor& kv_cache, const at::Device& dev, int64_t heads, int64_t m_k,
                   int64_t m_v, int64_t k_off, int64_t k_tok, int64_t v_off, int64_t v_sub,
                   int64_t nan_code) {
  check(kv_cache, "kv_cache", dev, {-1, heads, -1, -1});
  TORCH_CHECK(kv_cache.element_size() == 1, "vllm_pq_backend: kv_cache must be a byte view, got ",
              kv_cache.scalar_type());
  TORCH_CHECK(kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3),
              "vllm_pq_backend: each (block, head) region of kv_cache must be contiguous");
  const int64_t b = kv_cache.size(2);
  // bytes after the codes hold the exact store (layout.py), which these kernels do not read
  TORCH_CHECK(kv_cache.size(3) >= m_k + m_v, "vllm_pq_backend: kv_cache has ", kv_cache.size(3),
              " bytes per token, fewer than the codes' ", m_k + m_v);
  TORCH_CHECK(k_off == 0 && k_tok == m_k && v_off == b * m_k && v_sub == b,
              "vllm_pq_backend: page layout (", k_off, ", ", k_tok, ", ", v_off, ", ", v_sub,
              ") does not match kv_cache block size ", b, " with Mk=", m_k, ", Mv=", m_v);
  // not 0: decode reads centroid 0 for keys it masks, which must never be the NaN marker
  TORCH_CHECK(nan_code > 0 && nan_code < 256, "vllm_pq_backend: nan_code must be in 1..255, got ", nan_code);
  return pq::Pages{static_cast<uint8_t*>(kv_cache.data_ptr()), kv_cache.stride(0),
                   kv_cache.stride(1), static_cast<int>(b),
                   pq::PageLayout{(int)k_off, (int)k_tok, (int)v_off, (int)v_sub, (int)nan_code}};
}

// key / value [n, kv_heads, head_dim] of one 16-bit dtype, heads dense (rows may be strided).
pq::KVRows kv_rows_of(const Tensor& key, const Tensor& value, const at::Device& dev) {
  check(key, "key", dev, {-1, -1, -1});
  const int64_t heads = key.size(1), d = key.size(2);
  dtype_of(key, "key");
  check(value, "value", dev, {key.size(0), heads, d});
  check_dtype(value, "value", key.scalar_type());
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == d && value.stride(2) == 1 && value.stride(1) == d,
              "vllm_pq_backend: key and value must be [n, kv_heads, head_dim] with dense heads");
  return pq::KVRows{key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0)};
}

// `t` starts at a 16-byte boundary and each of its strides in `dims` is a multiple of 16
// bytes: the decode kernel reads such tensors in 16-byte vectors (and asynchronous or bulk
// copies), which fault or read the wrong bytes off those boundaries.
void check_aligned(const Tensor& t, const char* name, std::initializer_list<int64_t> dims = {}) {
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (const int64_t dim : dims) ok = ok && (t.stride(dim) * t.element_size()) % 16 == 0;
  TORCH_CHECK(ok, "vllm_pq_backend: ", name, " must start 16-byte aligned with strides ", t.strides(),
              " (elements of ", t.element_size(), " bytes) that are multiples of 16 bytes in dims ",
              at::IntArrayRef(dims));
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "vllm_pq_backend ", what, " kernel failed: ", cudaGetErrorString(err));
}

void store(Tensor kv_cache, const Tensor& key, const Tensor& value, const Tensor& slot_mapping,
           const Tensor& k_cb, const Tensor& v_cb, const Tensor& k_grid, const Tensor& v_grid,
           int64_t k_off, int64_t k_tok, int64_t v_off, int64_t v_sub, int64_t nan_code) {
  const at::Device dev = key.device();
  TORCH_CHECK(dev.is_cuda(), "vllm_pq_backend: key must be a CUDA tensor");
  const at::cuda::OptionalCUDAGuard guard(dev);
  pq::StoreArgs a{};
  a.kv = kv_rows_of(key, value, dev);
  const int64_t n = key.size(0), heads = key.size(1), d = key.size(2);
  check(slot_mapping, "slot_mapping", dev, {-1});
  check_dtype(slot_mapping, "slot_mapping", at::kLong);
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.size(0) <= n,
              "vllm_pq_backend: slot_mapping must be contiguous with at most key.size(0)=", n, " entries, got ",
              slot_mapping.sizes());
  const int64_t m_k = check_codebook(k_cb, "k_cb", dev, heads, d, at::kFloat);
  const int64_t m_v = check_codebook(v_cb, "v_cb", dev, heads, d, at::kFloat);
  a.pages = pages_of(kv_cache, dev, heads, m_k, m_v, k_off, k_tok, v_off, v_sub, nan_code);
  a.slot_mapping = slot_mapping.data_ptr<int64_t>();
  a.k_cb = k_cb.data_ptr<float>();
  a.v_cb = v_cb.data_ptr<float>();
  a.k_grid = grid_of(k_grid, "k_grid", dev, heads, m_k, d, &a.k_grid_bytes);
  a.v_grid = grid_of(v_grid, "v_grid", dev, heads, m_v, d, &a.v_grid_bytes);
  a.num_tokens = static_cast<int>(slot_mapping.size(0));
  a.num_kv_heads = static_cast<int>(heads);
  a.head_dim = static_cast<int>(d);
  a.m_k = static_cast<int>(m_k);
  a.m_v = static_cast<int>(m_v);
  a.dtype = dtype_of(key, "key");
  check_cuda(pq::store(a, at::cuda::getCurrentCUDAStream()), "store");
}

// win_k[rows[i], :, slots[i]] = key[tokens[i]] and the same for V, for every i (pq_kernels.h).
void window_write(Tensor win_k, Tensor win_v, const Tensor& key, const Tensor& value, const Tensor& tokens,
                  const Tensor& rows, const Tensor& slots) {
  const at::Device dev = key.device();
  TORCH_CHECK(dev.is_cuda(), "vllm_pq_backend: key must be a CUDA tensor");
  const at::cuda::OptionalCUDAGuard guard(dev);
  pq::WindowArgs a{};
  a.kv = kv_rows_of(key, value, dev);
  const int64_t heads = key.size(1), d = key.size(2);
  check_pair(win_k, win_v, "win_k", "win_v", dev, {-1, heads, -1, d}, key.scalar_type());
  const int64_t count = tokens.numel();
  const std::pair<const Tensor*, const char*> index[] = {{&tokens, "tokens"}, {&rows, "rows"}, {&slots, "slots"}};
  for (const auto& [t, name] : index) {
    check(*t, name, dev, {count});
    check_dtype(*t, name, at::kLong);
    TORCH_CHECK(t->is_contiguous(), "vllm_pq_backend: ", name, " must be contiguous");
  }
  a.win_k = win_k.data_ptr();
  a.win_v = win_v.data_ptr();
  a.tokens = tokens.data_ptr<int64_t>();
  a.rows = rows.data_ptr<int64_t>();
  a.slots = slots.data_ptr<int64_t>();
  a.count = static_cast<int>(count);
  a.kv_heads = static_cast<int>(heads);
  a.window = static_cast<int>(win_k.size(2));
  a.head_dim = static_cast<int>(d);
  a.elem_bytes = static_cast<int>(key.element_size());
  check_cuda(pq::window_write(a, at::cuda::getCurrentCUDAStream()), "window_write");
}

// The decode kernel's codebook image of one layer (pq_kernels.h): [kv_heads, bytes] uint8,
// empty for head_dim 256.
Tensor decode_books(const Tensor& k_cb, const Tensor& v_cb) {
  const at::Device dev = k_cb.device();
  TORCH_CHECK(dev.is_cuda(), "vllm_pq_backend: k_cb must be a CUDA tensor");
  const at::cuda::OptionalCUDAGuard guard(dev);
  const pq::DType dt = dtype_of(k_cb, "k_cb");
  check(k_cb, "k_cb", dev, {-1, -1, 256, -1});
  const int64_t heads = k_cb.size(0), d = k_cb.size(1) * k_cb.size(3);
  const int64_t m_k = check_codebook(k_cb, "k_cb", dev, heads, d, k_cb.scalar_type());
  const int64_t m_v = check_codebook(v_cb, "v_cb", dev, heads, d, k_cb.scalar_type());
  const int bytes = pq::decode_books_bytes(static_cast<int>(d));
  Tensor out = torch::zeros({bytes > 0 ? heads : 0, bytes}, k_cb.options().dtype(at::kByte));
  check_cuda(pq::decode_books(out.data_ptr<uint8_t>(), k_cb.data_ptr(), v_cb.data_ptr(), static_cast<int>(out.size(0)),
                              static_cast<int>(d), static_cast<int>(m_k), static_cast<int>(m_v), dt,
                              at::cuda::getCurrentCUDAStream()),
             "decode_books");
  return out;
}

void decode(Tensor out, const Tensor& q, const Tensor& kv_cache, const Tensor& block_table,
            const Tensor& seq_lens, const Tensor& order, const Tensor& k_cb, const Tensor& v_cb, const Tensor& books,
            const Tensor& win_k, const Tensor& win_v, const Tensor& rows, const Tensor& new_k, const Tensor& new_v,
            int64_t window, int64_t sliding_window, int64_t num_splits, int64_t min_split, int64_t num_ctas,
            double scale, const Tensor& sinks, bool lut, Tensor ws_o, Tensor ws_lse, const Tensor& corr,
            int64_t corr_slots, int64_t k_off, int64_t k_tok, int64_t v_off, int64_t v_sub, int64_t nan_code) {
  const at::Device dev = q.device();
  TORCH_CHECK(dev.is_cuda(), "vllm_pq_backend: q must be a CUDA tensor");
  const at::cuda::OptionalCUDAGuard guard(dev);
  check(q, "q", dev, {-1, -1, -1});
  const int64_t reqs = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == d, "vllm_pq_backend: q must be [R, Hq, D] with dense heads");
  const pq::DType dt = dtype_of(q, "q");
  check(out, "out", dev, {reqs, heads, d});
  check_dtype(out, "out", q.scalar_type());
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == d, "vllm_pq_backend: out must have dense heads");
  const int64_t kv_heads = k_cb.size(0);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "vllm_pq_backend: ", heads,
              " query heads are not a multiple of k_cb's ", kv_heads, " KV heads");
  const int64_t m_k = check_codebook(k_cb, "k_cb", dev, kv_heads, d, q.scalar_type());
  const int64_t m_v = check_codebook(v_cb, "v_cb", dev, kv_heads, d, q.scalar_type());
  check(block_table, "block_table", dev, {-1, -1});
  check_dtype(block_table, "block_table", at::kInt);
  TORCH_CHECK(block_table.size(0) >= reqs && block_table.stride(1) == 1,
              "vllm_pq_backend: block_table must have >= ", reqs, " int32 rows with unit stride, got ",
              block_table.sizes());
  check(seq_lens, "seq_lens", dev, {-1});
  check_dtype(seq_lens, "seq_lens", at::kInt);
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.size(0) >= reqs, "vllm_pq_backend: seq_lens must be "
              "contiguous int32 with >= ", reqs, " entries");
  if (order.numel() > 0) {  // (a permutation of the requests: ops.decode_order)
    check(order, "order", dev, {-1});
    check_dtype(order, "order", at::kInt);
    TORCH_CHECK(order.is_contiguous() && order.size(0) >= reqs, "vllm_pq_backend: order must be contiguous "
                "int32 with >= ", reqs, " entries");
  }
  TORCH_CHECK(num_splits >= 1, "vllm_pq_backend: num_splits must be >= 1, got ", num_splits);
  TORCH_CHECK(min_split >= 0 && min_split % 32 == 0, "vllm_pq_backend: min_split must be a multiple of 32 "
              "(tokens), got ", min_split);
  check_dtype(ws_o, "ws_o", at::kFloat);
  check_dtype(ws_lse, "ws_lse", at::kFloat);
  TORCH_CHECK(ws_o.device() == dev && ws_lse.device() == dev && ws_o.is_contiguous() && ws_lse.is_contiguous() &&
                  ws_o.numel() >= reqs * heads * num_splits * d &&
                  ws_lse.numel() >= reqs * heads * num_splits,
              "vllm_pq_backend: decode workspace too small or not on ", dev);
  pq::DecodeArgs a{};
  a.pages = pages_of(kv_cache, dev, kv_heads, m_k, m_v, k_off, k_tok, v_off, v_sub, nan_code);
  check_aligned(q, "q", {0});
  check_aligned(out, "out", {0});
  check_aligned(kv_cache, "kv_cache", {0, 1});
  check_aligned(k_cb, "k_cb");
  check_aligned(v_cb, "v_cb");
  a.q = q.data_ptr();
  a.q_stride = q.stride(0);
  a.out = out.data_ptr();
  a.out_stride = out.stride(0);
  a.block_table = block_table.data_ptr<int32_t>();
  a.bt_stride = block_table.stride(0);
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.order = order.numel() > 0 ? order.data_ptr<int32_t>() : nullptr;
  a.k_cb = k_cb.data_ptr();
  a.v_cb = v_cb.data_ptr();
  if (const int bytes = pq::decode_books_bytes(static_cast<int>(d)); bytes > 0) {
    check(books, "books", dev, {kv_heads, bytes});
    check_dtype(books, "books", at::kByte);
    TORCH_CHECK(books.is_contiguous(), "vllm_pq_backend: books must be contiguous (decode_books' output)");
    check_aligned(books, "books");
    a.books = books.data_ptr<uint8_t>();
  }
  TORCH_CHECK(window >= 0, "vllm_pq_backend: window must be >= 0, got ", window);
  a.window = static_cast<int>(window);
  TORCH_CHECK(sliding_window == 0 || sliding_window > window, "vllm_pq_backend: sliding_window ", sliding_window,
              " must be 0 (none) or larger than the residual window ", window);
  a.sliding_window = static_cast<int>(sliding_window);
  if (window > 0) {
    check_pair(win_k, win_v, "win_k", "win_v", dev, {-1, kv_heads, window, d}, q.scalar_type());
    check_aligned(win_k, "win_k");
    check_aligned(win_v, "win_v");
    check(rows, "rows", dev, {-1});
    check_dtype(rows, "rows", at::kInt);
    TORCH_CHECK(rows.is_contiguous() && rows.size(0) >= reqs, "vllm_pq_backend: rows must be contiguous int32 "
                "with >= ", reqs, " entries");
    a.win_k = win_k.data_ptr();
    a.win_v = win_v.data_ptr();
    a.rows = rows.data_ptr<int32_t>();
    a.win_rows = static_cast<int>(win_k.size(0));
    if (new_k.numel() > 0) {  // this step's keys and values go into the window first
      check(new_k, "new_k", dev, {-1, kv_heads, d});
      check(new_v, "new_v", dev, {new_k.size(0), kv_heads, d});
      check_dtype(new_k, "new_k", q.scalar_type());
      check_dtype(new_v, "new_v", q.scalar_type());
      TORCH_CHECK(new_k.size(0) >= reqs && new_k.stride(2) == 1 && new_k.stride(1) == d && new_v.stride(2) == 1 &&
                      new_v.stride(1) == d,
                  "vllm_pq_backend: new_k and new_v must be [>= ", reqs, ", kv_heads, head_dim] with dense heads");
      a.new_k = new_k.data_ptr();
      a.new_v = new_v.data_ptr();
      a.new_k_stride = new_k.stride(0);
      a.new_v_stride = new_v.stride(0);
    }
  }
  a.num_reqs = static_cast<int>(reqs);
  a.num_heads = static_cast<int>(heads);
  a.num_kv_heads = static_cast<int>(kv_heads);
  a.head_dim = static_cast<int>(d);
  a.m_k = static_cast<int>(m_k);
  a.m_v = static_cast<int>(m_v);
  a.num_splits = static_cast<int>(num_splits);
  a.min_split = static_cast<int>(min_split);
  a.num_ctas = static_cast<int>(num_ctas);
  a.scale = static_cast<float>(scale);
  if (sinks.numel() > 0) {  // one logit per query head, in float32 or q's dtype (empty: none)
    check(sinks, "sinks", dev, {heads});
    TORCH_CHECK(sinks.is_contiguous() && (sinks.scalar_type() == at::kFloat || sinks.scalar_type() == q.scalar_type()),
                "vllm_pq_backend: sinks must be contiguous float32 or ", q.scalar_type(), " [", heads, "], got ",
                sinks.scalar_type());
    a.sinks = sinks.data_ptr();
    a.sinks_f32 = sinks.scalar_type() == at::kFloat;
  }
  if (corr.numel() > 0) {  // the exact store's corrections (empty: none)
    check_dtype(corr, "corr", at::kFloat);
    TORCH_CHECK(corr.device() == dev && corr.is_contiguous() && corr_slots >= 1 &&
                    corr.numel() >= reqs * heads * corr_slots * (d + 2),
                "vllm_pq_backend: corr must be contiguous float32 on ", dev, " with >= ",
                reqs * heads * corr_slots * (d + 2), " elements");
    a.corr = corr.data_ptr<float>();
    a.corr_slots = static_cast<int>(corr_slots);
  }
  a.lut = lut;
  a.ws_o = ws_o.data_ptr<float>();
  a.ws_lse = ws_lse.data_ptr<float>();
  a.dtype = dt;
  check_cuda(pq::decode(a, at::cuda::getCurrentCUDAStream()), "decode");
}

// out[i] = x[i] T[i] row by row (pq_map.cu): up to three (out, x, T) in one launch, all with
// the same rows, head_dim and dtype; out[i] may be x[i].
void map_rows(std::vector<Tensor> out, const std::vector<Tensor>& x, const std::vector<Tensor>& t) {
  TORCH_CHECK(!x.empty() && x.size() <= (size_t)pq::kMaxMapJobs && out.size() == x.size() && t.size() == x.size(),
              "vllm_pq_backend: map takes 1 to ", pq::kMaxMapJobs, " (out, x, T) triples, got ", out.size(), ", ",
              x.size(), ", ", t.size());
  const at::Device dev = x[0].device();
  TORCH_CHECK(dev.is_cuda(), "vllm_pq_backend: map inputs must be CUDA tensors");
  const at::cuda::OptionalCUDAGuard guard(dev);
  check(x[0], "x[0]", dev, {-1, -1, -1});
  const int64_t n = x[0].size(0), d = x[0].size(2);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "vllm_pq_backend: map supports head_dim 64, 128 and 256, got ", d);
  pq::MapArgs a{};
  a.dtype = dtype_of(x[0], "x[0]");
  for (size_t i = 0; i < x.size(); ++i) {
    const std::string xi = "x[" + std::to_string(i) + "]", oi = "out[" + std::to_string(i) + "]",
                      ti = "T[" + std::to_string(i) + "]";
    check(x[i], xi.c_str(), dev, {n, -1, d});
    const int64_t heads = x[i].size(1);
    check(out[i], oi.c_str(), dev, {n, heads, d});
    check_dtype(x[i], xi.c_str(), x[0].scalar_type());
    check_dtype(out[i], oi.c_str(), x[0].scalar_type());
    TORCH_CHECK(x[i].stride(2) == 1 && x[i].stride(1) == d && out[i].stride(2) == 1 && out[i].stride(1) == d,
                "vllm_pq_backend: ", xi, " and ", oi, " must be [rows, heads, head_dim] with dense heads");
    // the kernel reads rows in 16-byte pieces and writes them in map_out_align's (pq_map.cu)
    const int64_t esz = x[i].element_size(), align = pq::map_out_align(static_cast<int>(d));
    TORCH_CHECK(reinterpret_cast<uintptr_t>(x[i].data_ptr()) % 16 == 0 && (x[i].stride(0) * esz) % 16 == 0,
                "vllm_pq_backend: ", xi, " and its rows must be 16-byte aligned");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(out[i].data_ptr()) % align == 0 && (out[i].stride(0) * esz) % align == 0,
                "vllm_pq_backend: ", oi, " and its rows must be ", align, "-byte aligned");
    check(t[i], ti.c_str(), dev, {-1, d, d});
    check_dtype(t[i], ti.c_str(), at::kFloat);
    TORCH_CHECK(t[i].is_contiguous() && t[i].size(0) > 0 && heads % t[i].size(0) == 0, "vllm_pq_backend: ", ti,
                " must be contiguous [maps, ", d, ", ", d, "] with ", heads, " heads a multiple of maps, got ",
                t[i].sizes());
    a.jobs[i] = pq::MapJob{x[i].data_ptr(), out[i].data_ptr(), t[i].data_ptr<float>(), x[i].stride(0),
                           out[i].stride(0), static_cast<int>(heads), static_cast<int>(heads / t[i].size(0))};
  }
  a.num_jobs = static_cast<int>(x.size());
  a.rows = static_cast<int>(n);
  a.head_dim = static_cast<int>(d);
  check_cuda(pq::map_rows(a, at::cuda::getCurrentCUDAStream()), "map");
}

// The pages block_ids (1-D int32, any stride) dequantized to k_cb's dtype in FlashAttention's
// paged layout [pages, B, kv_heads, D], then extra_pages more left unwritten (the segments'
// own subpages, own_subpages); with `first` (int64, first_occurrence of the ids) only
// each block id's first entry is written (pq_kernels.h, DequantArgs).
std::tuple<Tensor, Tensor> dequant_pages(const Tensor& kv_cache, const Tensor& block_ids,
                                         const std::optional<Tensor>& first,
                                         const Tensor& k_cb, const Tensor& v_cb, int64_t extra_pages,
                                         int64_t k_off, int64_t k_tok, int64_t v_off, int64_t v_sub,
                                         int64_t nan_code) {
  const at::Device dev = k_cb.device();
  TORCH_CHECK(dev.is_cuda(), "vllm_pq_backend: k_cb must be a CUDA tensor");
  const at::cuda::OptionalCUDAGuard guard(dev);
  const int64_t heads = k_cb.size(0), d = k_cb.dim() == 4 ? k_cb.size(1) * k_cb.size(3) : 0;
  pq::DequantArgs a{};
  a.dtype = dtype_of(k_cb, "k_cb");
  const int64_t m_k = check_codebook(k_cb, "k_cb", dev, heads, d, k_cb.scalar_type());
  const int64_t m_v = check_codebook(v_cb, "v_cb", dev, heads, d, k_cb.scalar_type());
  a.pages = pages_of(kv_cache, dev, heads, m_k, m_v, k_off, k_tok, v_off, v_sub, nan_code);
  check(block_ids, "block_ids", dev, {-1});
  check_dtype(block_ids, "block_ids", at::kInt);
  const int64_t n = block_ids.size(0);
  if (first.has_value()) {
    check(*first, "first", dev, {n});
    check_dtype(*first, "first", at::kLong);
    TORCH_CHECK(first->is_contiguous(), "vllm_pq_backend: first must be contiguous");
    a.first = first->data_ptr<int64_t>();
  }
  TORCH_CHECK(extra_pages >= 0, "vllm_pq_backend: extra_pages must be >= 0, got ", extra_pages);
  const int64_t b = kv_cache.size(2);
  Tensor k = at::empty({n + extra_pages, b, heads, d}, k_cb.options());
  Tensor v = at::empty_like(k);
  a.block_ids = block_ids.data_ptr<int32_t>();
  a.ids_stride = block_ids.stride(0);
  a.k_cb = k_cb.data_ptr();
  a.v_cb = v_cb.data_ptr();
  a.k_out = k.data_ptr();
  a.v_out = v.data_ptr();
  a.num_entries = static_cast<int>(n);
  a.num_kv_heads = static_cast<int>(heads);
  a.head_dim = static_cast<int>(d);
  a.m_k = static_cast<int>(m_k);
  a.m_v = static_cast<int>(m_v);
  check_cuda(pq::dequant_pages(a, at::cuda::getCurrentCUDAStream()), "dequant_pages");
  return {k, v};
}

// Rows first + i of k / v ([*, kv_heads, D], contiguous): row src[i] (int64, the op's `at`)
// of keys / values ([n, kv_heads, D], dense heads), zeros where src[i] < 0 (pq_kernels.h, SubpageArgs).
void own_subpages(Tensor k, Tensor v, int64_t first, const Tensor& keys, const Tensor& values, const Tensor& src) {
  const at::Device dev = k.device();
  TORCH_CHECK(dev.is_cuda(), "vllm_pq_backend: k must be a CUDA tensor");
  const at::cuda::OptionalCUDAGuard guard(dev);
  pq::SubpageArgs a{};
  a.kv = kv_rows_of(keys, values, dev);
  const int64_t heads = keys.size(1), d = keys.size(2);
  check_pair(k, v, "k", "v", dev, {-1, heads, d}, keys.scalar_type());
  check(src, "at", dev, {-1});
  check_dtype(src, "at", at::kLong);
  TORCH_CHECK(src.is_contiguous(), "vllm_pq_backend: at must be contiguous");
  TORCH_CHECK(first >= 0 && first + src.size(0) <= k.size(0), "vllm_pq_backend: rows ", first, "..",
              first + src.size(0), " are outside k's ", k.size(0), " rows");
  a.k_out = k.data_ptr();
  a.v_out = v.data_ptr();
  a.at = src.data_ptr<int64_t>();
  a.first = first;
  a.count = src.size(0);
  a.num_kv_heads = static_cast<int>(heads);
  a.head_dim = static_cast<int>(d);
  a.elem_bytes = static_cast<int>(keys.element_size());
  check_cuda(pq::own_subpages(a, at::cuda::getCurrentCUDAStream()), "own_subpages");
}

}  // namespace

TORCH_LIBRARY(pq_backend, m) {
  m.def("map(Tensor(a!)[] out, Tensor[] x, Tensor[] t) -> ()");
  m.def("decode_books(Tensor k_cb, Tensor v_cb) -> Tensor");
  m.def(
      "store(Tensor(a!) kv_cache, Tensor key, Tensor value, Tensor slot_mapping, Tensor k_cb, "
      "Tensor v_cb, Tensor k_grid, Tensor v_grid, int k_off, int k_tok, int v_off, int v_sub, "
      "int nan_code) -> ()");
  m.def(
      "dequant_pages(Tensor kv_cache, Tensor block_ids, Tensor? first, Tensor k_cb, Tensor v_cb, int extra_pages, "
      "int k_off, int k_tok, int v_off, int v_sub, int nan_code) -> (Tensor, Tensor)");
  m.def("own_subpages(Tensor(a!) k, Tensor(b!) v, int first, Tensor keys, Tensor values, Tensor at) -> ()");
  m.def(
      "window_write(Tensor(a!) win_k, Tensor(b!) win_v, Tensor key, Tensor value, Tensor tokens, Tensor rows, "
      "Tensor slots) -> ()");
  m.def(
      "decode(Tensor(a!) out, Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor order, "
      "Tensor k_cb, Tensor v_cb, Tensor books, Tensor(d!) win_k, Tensor(e!) win_v, Tensor rows, Tensor new_k, "
      "Tensor new_v, int window, int sliding_window, int num_splits, int min_split, int num_ctas, float scale, "
      "Tensor sinks, bool lut, Tensor(b!) ws_o, Tensor(c!) ws_lse, Tensor corr, int corr_slots, int k_off, "
      "int k_tok, int v_off, int v_sub, int nan_code) -> ()");
}

TORCH_LIBRARY_IMPL(pq_backend, CUDA, m) {
  m.impl("store", &store);
  m.impl("window_write", &window_write);
  m.impl("dequant_pages", &dequant_pages);
  m.impl("own_subpages", &own_subpages);
  m.impl("decode", &decode);
  m.impl("decode_books", &decode_books);
  m.impl("map", &map_rows);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.doc() = "vllm_pq_backend CUDA kernels"; }
