// Torch-free interface of the PQ KV-cache kernels (raw pointers, cudaStream_t), so the
// CUDA sources compile with plain nvcc; csrc/pq_binding.cpp adapts torch tensors to it.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>

namespace pq {

// Byte layout inside one (block, KV head) region of a page, filled from
// vllm_pq_backend/layout.py (PageLayout.kernel_args): K code `m` of token `t` is at
// k_off + t * k_tok + m; V code `m` of token `t` is at v_off + m * v_sub + t. Subspace 0 of
// a token whose vector is not finite holds nan_code (layout.NAN_CODE).
struct PageLayout {
  int k_off, k_tok, v_off, v_sub, nan_code;
};

enum class DType { kFloat16 = 0, kBFloat16 = 1 };

struct Pages {
  uint8_t* base;         // layer view [blocks][kv_heads][B][Mk + Mv]
  int64_t block_stride;  // bytes
  int64_t head_stride;   // bytes
  int block_size;
  PageLayout lay;
};

// This step's K and V rows, [n, kv_heads, D] (activation dtype) with dense heads; rows may
// be strided, as vLLM's views of its qkv tensor are.
struct KVRows {
  const void* key;
  const void* value;
  int64_t key_stride, value_stride;  // elements between tokens
};

struct StoreArgs {
  Pages pages;
  KVRows kv;
  const int64_t* slot_mapping;  // [n], -1 = padding
  const float* k_cb;            // [kv_heads, Mk, 256, D/Mk]
  const float* v_cb;            // [kv_heads, Mv, 256, D/Mv]
  // 2-D subspaces: per (KV head, subspace) a record of grid_bytes bytes that lists the
  // centroids that can be nearest in each cell of the plane (vllm_pq_backend/nearest.py
  // defines it), or null: the full search
  const uint8_t* k_grid;  // [kv_heads, Mk, k_grid_bytes]
  const uint8_t* v_grid;
  int k_grid_bytes, v_grid_bytes;
  int num_tokens, num_kv_heads, head_dim, m_k, m_v;
  DType dtype;
};

struct DecodeArgs {
  Pages pages;
  const void* q;  // [R, Hq, D]
  int64_t q_stride;  // elements between requests (heads are contiguous)
  void* out;      // [R, Hq, D]
  int64_t out_stride;
  const int32_t* block_table;
  int64_t bt_stride;
  const int32_t* seq_lens;  // [R], context length including the query token
  const int32_t* order;     // [R] a permutation of the requests, longest first (ops.decode_order),
                            // the order their items are dealt to the CTAs; or null (as given)
  const void* k_cb;         // [kv_heads, Mk, 256, D/Mk] activation dtype
  const void* v_cb;         // [kv_heads, Mv, 256, D/Mv]
  const uint8_t* books;     // [kv_heads, decode_books_bytes(D)]: decode_books of k_cb, v_cb
  void* win_k;              // [rows, kv_heads, W, D] or null
  void* win_v;
  const int32_t* rows;      // [R] window row of each request, or null
  int win_rows;             // rows of win_k / win_v: a row outside reads and writes nothing
  const void* new_k;        // [R, kv_heads, D] this step's keys, written into the window at
  const void* new_v;        // position L - 1 before it is read; or null (already there)
  int64_t new_k_stride, new_v_stride;  // elements between requests
  int window;
  int sliding_window;  // > 0: a query at position i reads keys j > i - sliding_window only
  int num_reqs, num_heads, num_kv_heads, head_dim, m_k, m_v;
  int num_splits;  // split slots per (request, KV head group), from the batch; the last
                   // split with codes also reads the window
  int min_split;   // tokens (a multiple of 32): no split is shorter, so a request with no more
                   // codes than this has one split whatever num_splits its batch gets, and
                   // its result does not depend on the batch (0: the codes split evenly)
  int num_ctas;    // CTAs per KV-head group, taking the (request, split) items in rounds
                   // (see `order`); <= 0: one per item
  float scale;
  // Attention sinks (gpt-oss): [Hq] one logit per query head, in the natural-log units of
  // the scaled scores, that joins each query's softmax denominator once, with no value
  // (vLLM's `sinks`); float32 if sinks_f32, else the activation dtype. Null: none.
  const void* sinks;
  bool sinks_f32;
  bool lut;       // score through Q.centroid lookup tables where supported (see pq_decode.cuh)
  float* ws_o;    // [R, Hq, num_splits, D]
  float* ws_lse;  // [R, Hq, num_splits] (log2 domain)
  // The exact store's corrections (vllm_pq_backend/exact.py), or null: [R, Hq, corr_slots,
  // D + 2] fp32, each a numerator [D], a denominator and their scale's log2 (-inf: none),
  // added to the splits' by the merge, which then always runs.
  const float* corr;
  int corr_slots;
  DType dtype;
};

// y = x T for the rows of one tensor: x, y [rows, heads, D] (activation dtype, dense
// heads), T [maps, D, D] fp32 row-major; head h uses map h / group. y may be x. x's rows
// are read as 16-byte pieces, y's written as map_out_align(D)-byte ones (pq_map.cu).
struct MapJob {
  const void* x;
  void* y;
  const float* t;
  int64_t x_stride, y_stride;  // elements between rows
  int heads, group;
};

constexpr int kMaxMapJobs = 3;
constexpr int map_out_align(int head_dim) { return head_dim == 128 ? 8 : 4; }

struct MapArgs {
  MapJob jobs[kMaxMapJobs];
  int num_jobs, rows, head_dim;
  DType dtype;
};

// This step's K/V rows into the window store (pq_store.cu): for i < count,
// win_k[rows[i], h, slots[i]] = key[tokens[i], h] for every KV head h, and the same for V.
struct WindowArgs {
  void* win_k;  // [win_rows, kv_heads, W, D], contiguous
  void* win_v;
  KVRows kv;
  const int64_t* tokens;  // [count] rows of key / value
  const int64_t* rows;    // [count] window-store rows
  const int64_t* slots;   // [count] entries in them (position % W)
  int count, kv_heads, window, head_dim, elem_bytes;
};

// A prefill group's pages dequantized for FlashAttention (pq_pages.cu): for each entry e
// and KV head h, the B tokens of block block_ids[e * ids_stride] into
// k_out / v_out [entries(+ more), B, kv_heads, D] at entry e; an entry whose first[e] != e
// is left as it is (first: each entry's first entry with the same block id, or null).
struct DequantArgs {
  Pages pages;
  const int32_t* block_ids;
  int64_t ids_stride;
  const int64_t* first;
  const void* k_cb;  // [kv_heads, Mk, 256, D/Mk] activation dtype
  const void* v_cb;  // [kv_heads, Mv, 256, D/Mv]
  void* k_out;
  void* v_out;
  int num_entries, num_kv_heads, head_dim, m_k, m_v;
  DType dtype;
};

// The segments' own subpages (pq_pages.cu): for i < count, row first + i of k_out / v_out
// ([*, kv_heads, D], contiguous) = row at[i] of kv's key / value, or zeros if at[i] < 0.
struct SubpageArgs {
  void* k_out;
  void* v_out;
  KVRows kv;
  const int64_t* at;
  int64_t first, count;
  int num_kv_heads, head_dim, elem_bytes;
};

cudaError_t store(const StoreArgs& a, cudaStream_t stream);
cudaError_t dequant_pages(const DequantArgs& a, cudaStream_t stream);
cudaError_t own_subpages(const SubpageArgs& a, cudaStream_t stream);
cudaError_t window_write(const WindowArgs& a, cudaStream_t stream);
cudaError_t map_rows(const MapArgs& a, cudaStream_t stream);
cudaError_t decode(const DecodeArgs& a, cudaStream_t stream);

// The decode kernel's shared-memory image of a layer's codebooks (csrc/pq_decode.cuh), built
// once per layer: out [kv_heads, decode_books_bytes(head_dim)] from k_cb / v_cb laid out as
// in DecodeArgs. head_dim 256 has none (0 bytes): its decode reads the codebooks directly.
int decode_books_bytes(int head_dim);
cudaError_t decode_books(uint8_t* out, const void* k_cb, const void* v_cb, int kv_heads, int head_dim,
                         int m_k, int m_v, DType dtype, cudaStream_t stream);

}  // namespace pq
