// Quantize new K/V rows to their nearest centroids and write the codes into the pages.
//
// A CTA takes one KV head, K or V, and a group of subspaces, and walks tiles of the
// tokens (tile_ctas: as many CTAs as fill the GPU once, each tile a CTA's at most): the
// groups are spread over the grid, not looped over in one CTA, so that a decode step's few
// tokens still fill the GPU (one CTA looping over every group gives 64 tokens 16 CTAs). K
// and V have their own subspace width DS, so they are one launch when the widths agree and
// two otherwise. The
// full search stages its group's fp32 centroids in shared memory with each centroid's
// |c|^2 / 2; a warp's lanes take tokens of one subspace, so every centroid read is a
// broadcast. The nearest centroid
// minimises |c|^2 / 2 - x.c (DS fused multiply-adds and a compare per centroid, against
// 2 DS operations for |x - c|^2); the first minimum wins and a NaN score never does. In
// fp32 this may pick a centroid whose distance ties the nearest one's within rounding of
// |x|^2 + |c|^2 where reference.encode, summing squared differences, picks the other (the
// GPU tests bound it). Carrying the index in the score's low mantissa bits (one min
// instead of a compare and two selects) made such ties 2^-15 wide instead of 2^-23, and
// the attention tests, which expect the reference's codes, saw the difference. Subspace 0
// of a non-finite vector gets the layout's nan_code.
//
// 2-D subspaces (4 bits per element) with a grid record (vllm_pq_backend/nearest.py) skip
// most of the 256 centroids: a token's cell lists the few that can be nearest to it, in
// index order, and the same fp32 scores pick among them, so the code is the full search's
// (a token outside the record's box, or not finite, gets the full search). Large stores
// stage 16 subspaces per CTA interleaved in shared memory (store_grid_kernel).
// A decode step's store (fewer than kManyTokens tokens) gives each (KV head, subspace) too
// few tokens to pay for staging: its warps read the record and the listed centroids
// through L1 instead (store_grid_l1_kernel).
#include <math_constants.h>

#include "pq_common.cuh"

namespace pq {
namespace {

constexpr int kStoreThreads = 256;

// P tokens per thread: one centroid read serves them all and their min-searches
// interleave (independent instructions). Large stores take 4 (subspace width <= 4; wider
// ones need the registers), small ones 1, so that a decode step's few tokens spread over
// as many threads as they can. Widths >= 8 give a subspace two warps (their groups hold
// half as many subspaces in the same shared memory).
template <int DS, int P>
struct StoreCfg {
  static constexpr int kLanes = DS >= 8 ? 64 : 32;       // threads per subspace: whole warps
  static constexpr int kTokens = kLanes * P;             // tokens per tile
  static constexpr int kGroup = kStoreThreads / kLanes;  // subspaces per CTA: one item a thread
  static constexpr int kSmem = kGroup * kCentroids * (DS + 1) * (int)sizeof(float);
  static_assert(DS <= 4 || P == 1, "registers");
};

// |c|^2 / 2 of a centroid of DS floats, the one rounding sequence every store path uses
// (NaN for the NaN-marked centroid: never nearest).
template <int DS>
__device__ __forceinline__ float half_sq_norm(const float* c) {
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < DS; ++i) sq = __fmaf_rn(c[i], c[i], sq);
  return 0.5f * sq;
}

// A CTA's group of mg subspaces into shared memory: centroids [kGroup][256][DS] by
// asynchronous copies, all in flight at once, then, once they have landed, their
// |c|^2 / 2 [kGroup][256] (returned) from the staged copies: the one rounding sequence
// that every store path scores with, so that the grid searches' codes are the full
// search's bit for bit. `more`: issues the caller's own loads while the copies are in
// flight.
template <int DS, int kGroup, typename More>
__device__ __forceinline__ float* stage_centroids(const float* cb, int mg, float* smem, More&& more) {
  for (int i = threadIdx.x; i < mg * kCentroids * DS / 4; i += kStoreThreads) cp_async16(smem + 4 * i, cb + 4 * i);
  more();
  cp_async_wait_all();
  __syncthreads();
  float* half_norm = smem + kGroup * kCentroids * DS;
  for (int j = threadIdx.x; j < mg * kCentroids; j += kStoreThreads) half_norm[j] = half_sq_norm<DS>(smem + j * DS);
  __syncthreads();
  return half_norm;
}

// CTAs per (KV head, part, group) along the tokens: as many as fill the GPU once with
// `combos` such triples (each CTA stages its group once and then walks tiles
// blockIdx.x, + gridDim.x, ...), at most one per tile. A CTA per tile staged its group for
// every tile: for the grid search, 74 KB for 1024 searches.
template <typename Kernel>
int tile_ctas(Kernel kernel, int smem, int tiles, int combos) {
  int dev = 0, sms = 1, per_sm = 1;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();  // a query that failed leaves the grid at a CTA per tile
    return tiles;
  }
  if ((int64_t)tiles * combos <= sms) return tiles;  // (a decode step's store: no occupancy query)
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kStoreThreads, smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return tiles;
  }
  return max(1, min(tiles, sms * max(per_sm, 1) / max(combos, 1)));
}

// Whether any of pieces first, first + step, ... of a head vector (head_dim elements) holds
// a NaN or an infinity (exponent bits all ones): a piece is 16 bytes where the row is
// aligned, as vLLM's K/V views of its qkv tensor are (element loads made the lane that
// checks a whole vector the slowest one), an element otherwise.
template <typename T>
__device__ __forceinline__ bool any_nonfinite(const T* row, int head_dim, int first, int step) {
  constexpr uint32_t e = std::is_same_v<T, __half> ? 0x7c00u : 0x7f80u;
  bool bad = false;  // | not ||: the loads need not wait for each other
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0 && head_dim % 8 == 0) {
    const uint4* v = reinterpret_cast<const uint4*>(row);
#pragma unroll 4
    for (int p = first; p < head_dim / 8; p += step) {
      const uint4 w = v[p];
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) bad |= (u[j] & e) == e | (u[j] & e << 16) == e << 16;
    }
  } else {
    for (int p = first; p < head_dim; p += step) bad |= !isfinite(Elem<T>::to_float(row[p]));
  }
  return bad;
}

// The byte of code `m` of the token in `slot`.
__device__ __forceinline__ uint8_t* code_byte(const Pages& pg, bool is_v, int head, int m, int64_t slot) {
  const int64_t blk = slot / pg.block_size, off = slot % pg.block_size;
  uint8_t* region = pg.base + blk * pg.block_stride + head * pg.head_stride;
  return region + (is_v ? pg.lay.v_off + (int64_t)m * pg.lay.v_sub + off : pg.lay.k_off + off * pg.lay.k_tok + m);
}

// Head `head` of token `tok`'s K row (is_v false) or V row: head_dim elements.
template <typename T>
__device__ __forceinline__ const T* head_row(const KVRows& kv, bool is_v, int64_t tok, int head, int head_dim) {
  return static_cast<const T*>(is_v ? kv.value : kv.key) + tok * (is_v ? kv.value_stride : kv.key_stride) +
         (int64_t)head * head_dim;
}

// Whether code `m` of the head vector `row` (head_dim elements) is the layout's nan_code:
// subspace 0 of a vector with one non-finite element marks the token.
template <typename T>
__device__ __forceinline__ bool nan_marked(const T* row, int m, int head_dim) {
  return m == 0 && any_nonfinite(row, head_dim, 0, 1);
}

// Code `m` of the token in `slot` goes into its page (nan_code where nan_marked).
__device__ __forceinline__ void write_code(const StoreArgs& a, bool is_v, int head, int m, int64_t slot, int code,
                                           bool nan) {
  *code_byte(a.pages, is_v, head, m, slot) = static_cast<uint8_t>(nan ? a.pages.lay.nan_code : code);
}

// Grid-search stores stage 16 subspaces per CTA, interleaved: word w of subspace s's record
// at shared word w * kGridSubs + s and its centroid k at float2 k * kGridSubs + s, so that
// the 16 lanes searching one token's 16 subspaces read 16 distinct banks (two for a
// centroid), whatever the cells, list entries and codes.
constexpr int kGridSubs = 16;
constexpr int kGridTile = 64;  // tokens of a grid-search tile: 4 pairs a warp
constexpr int kGridPad = 4;    // bytes after each staged record (SharedRecord::bytes4 reads a word past it)

// 2-D centroids staged interleaved in shared memory, |c|^2 / 2 computed as staging computes
// it for the full search (the same bits) ...
struct SharedCentroids {
  const float2* c;  // centroid 0 of this subspace
  __device__ __forceinline__ float3 operator[](int k) const {
    const float2 v = c[k * kGridSubs];
    const float f[2] = {v.x, v.y};
    return make_float3(v.x, v.y, half_sq_norm<2>(f));
  }
};

// ... or read through L1, |c|^2 / 2 computed as staging computes it (the same bits).
struct CachedCentroids {
  const float2* c;
  __device__ __forceinline__ float3 operator[](int k) const {
    const float2 v = __ldg(c + k);
    const float f[2] = {v.x, v.y};
    return make_float3(v.x, v.y, half_sq_norm<2>(f));
  }
};

// Score of 2-D centroid k (c: its coordinates and |c|^2 / 2), |c|^2 / 2 - x.c, by the same
// fused multiply-adds as the full search; the first minimum wins and a NaN never does.
__device__ __forceinline__ void try_centroid(float x0, float x1, float3 c, int k, float& best, int& code) {
  const float score = __fmaf_rn(-x1, c.y, __fmaf_rn(-x0, c.x, c.z));
  if (score < best) best = score, code = k;
}

// Grid records (nearest.py): 16 bytes lo[2], inv_w[2]; uint16 bins, offsets, lists, fine,
// cells at byte 16. Records are 16-byte aligned (their size is a multiple of 16).
struct GridHeader {
  float4 f;  // lo[2], inv_w[2]
  uint4 s;   // the uint16 section offsets and sizes, packed
  __device__ __forceinline__ int sec(int i) const {
    const uint32_t w[4] = {s.x, s.y, s.z, s.w};
    return (w[i / 2] >> (16 * (i % 2))) & 0xffff;
  }
};

// A record in global memory, read through L1 ...
struct GlobalRecord {
  const uint8_t* p;
  __device__ __forceinline__ GridHeader header() const {
    return {*reinterpret_cast<const float4*>(p), *reinterpret_cast<const uint4*>(p + 16)};
  }
  __device__ __forceinline__ int byte(int i) const { return p[i]; }
  __device__ __forceinline__ int u16(int i) const { return *reinterpret_cast<const uint16_t*>(p + i); }
  // bytes i .. i + 3 (little-endian; those past `last` repeat it: the record may end there)
  __device__ __forceinline__ uint32_t bytes4(int i, int last) const {
    uint32_t b = 0;
#pragma unroll
    for (int u = 0; u < 4; ++u) b |= (uint32_t)p[min(i + u, last)] << (8 * u);
    return b;
  }
};

// ... or staged interleaved in shared memory (kGridSubs).
struct SharedRecord {
  const uint32_t* w;  // word 0 of this subspace's record
  __device__ __forceinline__ uint32_t word(int i) const { return w[(i >> 2) * kGridSubs]; }
  __device__ __forceinline__ GridHeader header() const {
    return {make_float4(__uint_as_float(word(0)), __uint_as_float(word(4)), __uint_as_float(word(8)),
                        __uint_as_float(word(12))),
            make_uint4(word(16), word(20), word(24), word(28))};
  }
  __device__ __forceinline__ int byte(int i) const { return (word(i) >> (8 * (i & 3))) & 0xff; }
  __device__ __forceinline__ int u16(int i) const { return (word(i) >> (8 * (i & 3))) & 0xffff; }  // i even
  // bytes i .. i + 3 (little-endian), from two words and a funnel shift (the staged records
  // have a word of padding after them, kGridPad)
  __device__ __forceinline__ uint32_t bytes4(int i, int) const {
    return __funnelshift_r(word(i), word(i + 4), 8 * (i & 3));
  }
};

// The code of (x0, x1): the listed centroids of its cell, or all 256 outside the record's
// box. The list is walked 4 entries at a time: their 4 bytes in one word, their centroids
// loaded before any is scored, so that a decode-sized store waits for one round of loads
// per 4 entries rather than per entry; past the list's end the last entry repeats, which
// never wins a strict compare, so the first minimum in index order still wins. (A byte
// load and a clamped index per entry take 23 instructions an entry against about 15.)
template <typename Centroids, typename Record>
__device__ __forceinline__ int grid_code(float x0, float x1, const Centroids& cs, const Record& rec,
                                         const GridHeader& h) {
  const float fx = (x0 - h.f.x) * h.f.z, fy = (x1 - h.f.y) * h.f.w;
  const int fine = h.sec(3);
  float best = CUDART_INF_F;
  int code = 0;
  if (fx >= 0.f && fx < (float)fine && fy >= 0.f && fy < (float)fine) {  // false for NaN
    const int bins = h.sec(0), offs = h.sec(1), list = h.sec(2);
    const int cell = rec.byte(bins + (int)fx) * h.sec(4) + rec.byte(bins + fine + (int)fy);
    const int lo = rec.u16(offs + 2 * cell), hi = rec.u16(offs + 2 * cell + 2);
    for (int j = lo; j < hi; j += 4) {
      // the round's bytes, the last listed one repeated past the list's end (byte-permute
      // selectors 0000, 1110, 2210, 3210 for 1 .. 4 entries left)
      const int left = min(hi - j, 4);
      const uint32_t ks = __byte_perm(rec.bytes4(list + j, list + hi - 1), 0,
                                      (uint32_t)(0x3210221011100000ull >> (16 * (left - 1))) & 0xffffu);
      int k[4];
      float3 c[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) k[u] = __byte_perm(ks, 0, 0x4440 + u);
#pragma unroll
      for (int u = 0; u < 4; ++u) c[u] = cs[k[u]];
#pragma unroll
      for (int u = 0; u < 4; ++u) try_centroid(x0, x1, c[u], k[u], best, code);
    }
  } else {
    for (int k = 0; k < kCentroids; ++k) try_centroid(x0, x1, cs[k], k, best, code);
  }
  return code;
}

// Large stores of 2-D subspaces with grid records. A CTA stages kGridSubs subspaces of one
// (KV head, K|V) interleaved (SharedCentroids, SharedRecord) and walks tiles of kGridTile
// tokens (tile_ctas); lane l of a warp searches subspace l % 16 of token l / 16 of a pair,
// each warp 4 pairs of a tile, whose loads are all issued before the first search. Lanes
// over the tokens of one subspace would read random entries of one table (541 against
// 427 us for 16K tokens x 8 KV heads on an H100; the profile still counts 1.8 wavefronts
// per shared load here: the two tokens' lanes of one subspace share its banks). The CTA of
// subspaces 0..15 also checks every element of its tokens' vectors for the non-finite mark,
// 16 bytes a lane (one lane doing it for each of its tokens likely makes that warp the last
// of a CTA that walks several tiles).
template <typename T>
__global__ void __launch_bounds__(kStoreThreads, 3) store_grid_kernel(StoreArgs a, int first_part, int groups) {
  constexpr int kTile = kGridTile, kPairs = kTile / 2 / (kStoreThreads / 32);  // a warp's token pairs per tile
  // [256][kGridSubs] float2 centroids, then [record words][kGridSubs] records
  extern __shared__ __align__(16) float cb_smem[];
  const int head = blockIdx.y;
  const bool is_v = first_part + (int)blockIdx.z / groups == 1;
  const int m_total = is_v ? a.m_v : a.m_k;
  const int rec_bytes = is_v ? a.v_grid_bytes : a.k_grid_bytes;
  const int m0 = (blockIdx.z % groups) * kGridSubs;
  const int mg = min(kGridSubs, m_total - m0);
  float2* cen = reinterpret_cast<float2*>(cb_smem);
  uint32_t* recw = reinterpret_cast<uint32_t*>(cen + kCentroids * kGridSubs);
  const float2* cb = reinterpret_cast<const float2*>(is_v ? a.v_cb : a.k_cb) + ((size_t)head * m_total + m0) * kCentroids;
  const uint4* grid = reinterpret_cast<const uint4*>((is_v ? a.v_grid : a.k_grid) + ((size_t)head * m_total + m0) * rec_bytes);
  const int tiles = ceil_div(a.num_tokens, kTile);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane % kGridSubs, half = lane / kGridSubs;
  const int m = m0 + min(sub, mg - 1);  // (lanes past the group search a real subspace, write nothing)

  int64_t slot[kPairs];
  float x0[kPairs], x1[kPairs];
  bool nan[kPairs];
  auto load = [&](int tile) {
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int t = tile * kTile + 2 * (warp + i * (kStoreThreads / 32)) + half, tt = min(t, a.num_tokens - 1);
      slot[i] = t < a.num_tokens ? a.slot_mapping[tt] : -1;
      const T* row = head_row<T>(a.kv, is_v, tt, head, a.head_dim);
      x0[i] = Elem<T>::to_float(row[2 * m]);
      x1[i] = Elem<T>::to_float(row[2 * m + 1]);
      // the 16 lanes of a half-warp check its token's vector (m0 is the same in the warp)
      nan[i] = m0 == 0 &&
               (__ballot_sync(0xffffffffu, any_nonfinite(row, a.head_dim, sub, kGridSubs)) >> (16 * half) & 0xffffu) &&
               sub == 0;
    }
  };
  if ((int)blockIdx.x < tiles) load(blockIdx.x);  // in flight while the group is staged
  // (consecutive lanes take consecutive subspaces, so that the interleaved stores hit
  // distinct banks: subspace-major lanes put a warp's stores in one bank)
#pragma unroll 4
  for (int i = threadIdx.x; i < kGridSubs * kCentroids; i += kStoreThreads) {
    const int s = (i >> 1) % kGridSubs, k = (i >> 5) * 2 + (i & 1);  // pairs of centroids
    if (s < mg) cen[k * kGridSubs + s] = cb[s * kCentroids + k];
  }
  const int pieces = rec_bytes / 16;
#pragma unroll 4
  for (int i = threadIdx.x; i < kGridSubs * pieces; i += kStoreThreads) {
    const int s = i % kGridSubs, piece = i / kGridSubs;
    if (s >= mg) continue;
    const uint4 v = grid[s * pieces + piece];
    uint32_t* d = recw + piece * 4 * kGridSubs + s;
    d[0] = v.x, d[kGridSubs] = v.y, d[2 * kGridSubs] = v.z, d[3 * kGridSubs] = v.w;
  }
  __syncthreads();
  const SharedCentroids cs{cen + sub};
  const SharedRecord rec{recw + sub};
  const GridHeader h = rec.header();
  const bool writes = sub < mg;
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    if (tile != (int)blockIdx.x) load(tile);
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int code = grid_code(x0[i], x1[i], cs, rec, h);
      if (writes && slot[i] >= 0) write_code(a, is_v, head, m, slot[i], code, nan[i]);
    }
  }
}

// Decode-sized stores of 2-D subspaces with grid records: warp w takes 32 tokens of
// subspace w / token_warps, so the warps of one subspace are neighbours in a CTA and share
// its record and centroids in L1, and a warp's loads of them touch a few cache lines (lanes
// over subspaces instead, each load touched 32 records' lines and lost to the full search).
template <typename T>
__global__ void __launch_bounds__(kStoreThreads) store_grid_l1_kernel(StoreArgs a, int first_part, int token_warps) {
  const int warp = blockIdx.x * (kStoreThreads / 32) + threadIdx.x / 32;
  const bool is_v = first_part + (int)blockIdx.z == 1;
  const int m_total = is_v ? a.m_v : a.m_k;
  const int m = warp / token_warps, tok = (warp % token_warps) * 32 + threadIdx.x % 32;
  if (m >= m_total || tok >= a.num_tokens) return;
  // A chain of dependent loads (record, cell, list, centroids) is all this kernel's time:
  // everything that depends on nothing else is loaded first, the slot's check waits for it.
  const int64_t slot = a.slot_mapping[tok];
  const int head = blockIdx.y;
  const size_t sub = (size_t)head * m_total + m;
  const float2* c = reinterpret_cast<const float2*>(is_v ? a.v_cb : a.k_cb) + sub * kCentroids;
  const uint8_t* rec = (is_v ? a.v_grid : a.k_grid) + sub * (is_v ? a.v_grid_bytes : a.k_grid_bytes);
  const GridHeader h = GlobalRecord{rec}.header();
  const T* row = head_row<T>(a.kv, is_v, tok, head, a.head_dim);
  const float x0 = Elem<T>::to_float(row[2 * m]), x1 = Elem<T>::to_float(row[2 * m + 1]);
  const bool nan = nan_marked(row, m, a.head_dim);
  if (slot < 0) return;
  write_code(a, is_v, head, m, slot, grid_code(x0, x1, CachedCentroids{c}, GlobalRecord{rec}, h), nan);
}

// The full search: P tokens a thread (kLanes * P a tile), every centroid of the group
// staged once per CTA, tiles walked as in store_grid_kernel.
template <typename T, int DS, int P>
__global__ void __launch_bounds__(kStoreThreads) store_kernel(StoreArgs a, int first_part, int groups) {
  using C = StoreCfg<DS, P>;
  // [group subspaces][256][DS] centroids, then [group subspaces][256] their |c|^2 / 2
  extern __shared__ __align__(16) float cb_smem[];
  const int head = blockIdx.y;
  const bool is_v = first_part + (int)blockIdx.z / groups == 1;  // part 0: K, part 1: V
  const int m_total = is_v ? a.m_v : a.m_k;
  const int m0 = (blockIdx.z % groups) * C::kGroup;
  const int mg = min(C::kGroup, m_total - m0);
  const float* cb = (is_v ? a.v_cb : a.k_cb) + ((size_t)head * m_total + m0) * kCentroids * DS;
  const int tiles = ceil_div(a.num_tokens, C::kTokens);
  const int lane = threadIdx.x % C::kLanes, ml = threadIdx.x / C::kLanes;
  const int m = m0 + min(ml, mg - 1);

  int64_t slot[P];
  float xv[P][DS];
  auto load = [&](int tok0) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int t = tok0 + lane + p * C::kLanes, tt = min(t, a.num_tokens - 1);
      slot[p] = t < a.num_tokens ? a.slot_mapping[tt] : -1;
      const T* x = head_row<T>(a.kv, is_v, tt, head, a.head_dim) + m * DS;
#pragma unroll
      for (int i = 0; i < DS; ++i) xv[p][i] = Elem<T>::to_float(x[i]);
    }
  };
  const float* half_norm = stage_centroids<DS, C::kGroup>(cb, mg, cb_smem, [&] {
    if ((int)blockIdx.x < tiles) load(blockIdx.x * C::kTokens);
  });
  if (ml >= mg) return;
  const float* c = cb_smem + ml * kCentroids * DS;
  const float* hn = half_norm + ml * kCentroids;
#pragma unroll 1
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    if (tile != (int)blockIdx.x) load(tile * C::kTokens);
    bool any = false;
#pragma unroll
    for (int p = 0; p < P; ++p) any = any || slot[p] >= 0;
    if (!any) continue;
    float best[P];
    int code[P];
#pragma unroll
    for (int p = 0; p < P; ++p) best[p] = CUDART_INF_F, code[p] = 0;
#pragma unroll 16  // amortizes the loop's own instructions
    for (int k = 0; k < kCentroids; ++k) {
      float cv[DS];
#pragma unroll
      for (int i = 0; i < DS; ++i) cv[i] = c[k * DS + i];
      const float h = hn[k];
#pragma unroll
      for (int p = 0; p < P; ++p) {
        float score = h;  // |c|^2 / 2 - x.c = (|x - c|^2 - |x|^2) / 2
#pragma unroll
        for (int i = 0; i < DS; ++i) score = __fmaf_rn(-xv[p][i], cv[i], score);
        if (score < best[p]) best[p] = score, code[p] = k;  // first minimum; never a NaN
      }
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (slot[p] < 0) continue;
      const T* row = head_row<T>(a.kv, is_v, tile * C::kTokens + lane + p * C::kLanes, head, a.head_dim);
      write_code(a, is_v, head, m, slot[p], code[p], nan_marked(row, m, a.head_dim));
    }
  }
}

// Parts [first_part, first_part + parts) of (K, V), all with m subspaces of width DS.
template <typename T, int DS, int P>
cudaError_t launch_store(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  using C = StoreCfg<DS, P>;
  auto kernel = store_kernel<T, DS, P>;
  // Set per call, not once per process: the attribute belongs to the current device.
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (err != cudaSuccess) return err;
  const int groups = ceil_div(m, C::kGroup), combos = a.num_kv_heads * parts * groups;
  dim3 grid(tile_ctas(kernel, C::kSmem, ceil_div(a.num_tokens, C::kTokens), combos), a.num_kv_heads, parts * groups);
  kernel<<<grid, kStoreThreads, C::kSmem, stream>>>(a, first_part, groups);
  return cudaGetLastError();
}

// Parts with grid records (all of them: the caller launches K and V apart otherwise).
template <typename T>
cudaError_t launch_store_grid(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  auto kernel = store_grid_kernel<T>;
  const int rec = max(first_part == 0 ? a.k_grid_bytes : 0, first_part + parts == 2 ? a.v_grid_bytes : 0);
  const int smem = kGridSubs * (kCentroids * (int)sizeof(float2) + rec + kGridPad);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const int groups = ceil_div(m, kGridSubs), combos = a.num_kv_heads * parts * groups;
  dim3 grid(tile_ctas(kernel, smem, ceil_div(a.num_tokens, kGridTile), combos), a.num_kv_heads, parts * groups);
  kernel<<<grid, kStoreThreads, smem, stream>>>(a, first_part, groups);
  return cudaGetLastError();
}

// Parts with grid records, decode-sized: a warp per (subspace, 32 tokens).
template <typename T>
cudaError_t launch_store_grid_l1(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  const int token_warps = ceil_div(a.num_tokens, 32);
  dim3 grid(ceil_div(m * token_warps, kStoreThreads / 32), a.num_kv_heads, parts);
  store_grid_l1_kernel<T><<<grid, kStoreThreads, 0, stream>>>(a, first_part, token_warps);
  return cudaGetLastError();
}

// 4 tokens per thread once 128-token CTAs still number a few per SM (prefill); 1 below.
constexpr int kManyTokens = 1024;

template <typename T, int DS>
cudaError_t launch_store(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  if constexpr (DS == 2) {
    const bool k = first_part > 0 || a.k_grid, v = first_part + parts < 2 || a.v_grid;
    if (k && v) {
      // staging pays from about kManyTokens (the two take equal time at 1024 tokens)
      return a.num_tokens >= kManyTokens ? launch_store_grid<T>(a, first_part, parts, m, stream)
                                         : launch_store_grid_l1<T>(a, first_part, parts, m, stream);
    }
  }
  if constexpr (DS <= 4) {
    if (a.num_tokens >= kManyTokens) return launch_store<T, DS, 4>(a, first_part, parts, m, stream);
  }
  return launch_store<T, DS, 1>(a, first_part, parts, m, stream);
}

template <typename T>
cudaError_t store_parts(const StoreArgs& a, int first_part, int parts, int m, cudaStream_t stream) {
  switch (a.head_dim / m) {
    case 2: return launch_store<T, 2>(a, first_part, parts, m, stream);
    case 4: return launch_store<T, 4>(a, first_part, parts, m, stream);
    case 8: return launch_store<T, 8>(a, first_part, parts, m, stream);
    case 16: return launch_store<T, 16>(a, first_part, parts, m, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename T>
cudaError_t store_typed(const StoreArgs& a, cudaStream_t stream) {
  // one launch for K and V when their widths agree and both or neither have grid records
  // (their records' sizes may differ: each part reads its own)
  const bool same = a.m_k == a.m_v && (a.k_grid == nullptr) == (a.v_grid == nullptr);
  if (same) return store_parts<T>(a, 0, 2, a.m_k, stream);
  const cudaError_t err = store_parts<T>(a, 0, 1, a.m_k, stream);
  return err != cudaSuccess ? err : store_parts<T>(a, 1, 1, a.m_v, stream);
}

// One token's K (blockIdx.y 0) or V (1) head vectors into its window-store entry, V-byte
// words at a time (16 where every row is 16-byte aligned).
template <typename V>
__global__ void window_write_kernel(WindowArgs a) {
  const int i = blockIdx.x;
  const bool is_v = blockIdx.y == 1;
  const int64_t esz = a.elem_bytes, head_bytes = a.head_dim * esz, words = head_bytes / sizeof(V);
  const uint8_t* src = static_cast<const uint8_t*>(is_v ? a.kv.value : a.kv.key) +
                       a.tokens[i] * (is_v ? a.kv.value_stride : a.kv.key_stride) * esz;
  uint8_t* dst = static_cast<uint8_t*>(is_v ? a.win_v : a.win_k) +
                 (a.rows[i] * a.kv_heads * a.window + a.slots[i]) * head_bytes;
  for (int64_t w = threadIdx.x; w < a.kv_heads * words; w += blockDim.x) {
    const int64_t h = w / words, at = (w % words) * sizeof(V);
    *reinterpret_cast<V*>(dst + h * a.window * head_bytes + at) =
        *reinterpret_cast<const V*>(src + h * head_bytes + at);
  }
}

}  // namespace

cudaError_t window_write(const WindowArgs& a, cudaStream_t stream) {
  if (a.count == 0) return cudaSuccess;
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = aligned(a.kv.key) && aligned(a.kv.value) && aligned(a.win_k) && aligned(a.win_v) &&
                   (a.head_dim * a.elem_bytes) % 16 == 0 && (a.kv.key_stride * a.elem_bytes) % 16 == 0 &&
                   (a.kv.value_stride * a.elem_bytes) % 16 == 0;
  const dim3 grid(a.count, 2);
  if (vec)
    window_write_kernel<uint4><<<grid, 128, 0, stream>>>(a);
  else
    window_write_kernel<uint16_t><<<grid, 128, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t store(const StoreArgs& a, cudaStream_t stream) {
  if (a.num_tokens == 0) return cudaSuccess;
  if (a.m_k <= 0 || a.m_v <= 0 || a.head_dim % a.m_k || a.head_dim % a.m_v) return cudaErrorInvalidValue;
  return a.dtype == DType::kBFloat16 ? store_typed<__nv_bfloat16>(a, stream)
                                     : store_typed<__half>(a, stream);
}

}  // namespace pq
