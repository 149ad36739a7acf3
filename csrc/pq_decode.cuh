// Split-K decode attention over PQ codes (flash-decoding), GQA-aware, on tensor cores.
//
// CTA = (KV head x group of <= 8 query heads, one of num_ctas): it loads the head's
// codebooks into shared memory once, then takes one (request, split) item in each round of
// num_ctas items, longest requests first (plan_items; num_ctas CTAs per head group fill the
// GPU once; a CTA per item would reload the codebooks, as many bytes as a 1K-token split's
// codes, for every item). Its warps take 32-token chunks of the item's split. The codes of
// a KV head are read once for all its query heads: scores are S = K^ Q^T with K^
// dequantized from the codebook straight into mma.m16n8k16 A fragments (16 tokens x 16
// dims, 8 query heads as N), and O^T += V^T P with V^ dequantized into A fragments through
// the transposed V page layout. With LUT (one query head per KV head only) scores are
// instead sums of M entries of a per-query table q_m . centroid, built in shared memory in
// place of the K codebook: M 4-byte lookups per token instead of M (D/M)-element lookups
// and idle MMA columns.
//
// Centroid lookups (head_dim <= 128) read a per-KV-head image of both codebooks in shared
// memory (k_word / v_word, built once per layer by decode_books): a row of 256 bytes per code, so
// that a lookup's address is code * 256 + an offset fixed per lane and instruction, formed
// by one byte permute. The lanes of one warp-wide lookup read distinct subspaces whose
// entries sit in distinct banks, whatever the codes: no bank conflicts. The MMA fragments
// tie a subspace to a lane column (K) or row (V), so lanes take their subspaces in a
// rotated order (K by lane row within blocks of 8 / DWK subspaces, V by lane column within
// blocks of NV tiles) and rotate the looked-up words back with selects. (Spreading each
// subspace over a few banks by code instead averages 3 wavefronts per lookup in Nsight
// Compute.) Where a V block has fewer than 4 tiles (head_dim 64 at 2 bits
// and below, head_dim 128 at 1 bit) lane columns share tiles: 2- or 4-way conflicts remain.
// At head_dim 128 and 4 or 2 bits the blocks are shortened on purpose (DecodeCfg::XK, XV):
// a select round less for 2-way conflicts.
//
// Codes: a warp copies its next chunk's K and V codes into shared memory asynchronously
// while it works on the current one (DecodeCfg::kStageBytes); from there one 8-byte load per
// tile gives a lane its V codes of tokens 8c .. 8c+7 (both halves).
//
// Fragment bookkeeping (lane = 4 r + c):
// * Head dims are permuted for Q.K (a sum over dims): in k-step j thread c holds logical
//   dims c*D/4 + 4j + {0..3}, i.e. whole subspaces c*M/4 .. of one token, read with one
//   vector load of its M/4 codes.
// * Tokens are permuted inside a 32-token chunk (a sum over tokens): PV k-index kk of
//   half h is token 8*(kk%8/2) + 4h + 2*(kk/8) + kk%2, so a thread's PV columns are 4
//   consecutive tokens: one 32-bit word of V codes per owned subspace (8q + r) and half.
// * Output dims are permuted back at the end: tile (q, u) rows r / r+8 are dims
//   (8q + r) * D/M + 2u + {0, 1}.
// Scores go through exp2 with scale*log2(e); partial results are normalized with their
// log2-sum-exp and merged by reduce_kernel (pq_decode.cu), or, where a step has one split,
// are the output, which the items write themselves. The last split with codes also reads the
// full-precision window store (its own CTAs would each reserve the codebooks' shared memory
// for nothing). An attention sink (DecodeArgs::sinks) joins the denominator once per query,
// where the output is written: in the item's epilogue with one split, else in reduce_kernel
// (sink_log2).
#pragma once

#include <math_constants.h>

#include <type_traits>

#include "pq_common.cuh"

namespace pq {

constexpr int kChunk = 32;
constexpr int kHeadsPerCta = 8;
constexpr int kSched = 32;  // items a CTA resolves at once (a lane each)
constexpr float kLog2e = 1.4426950408889634f;

// One (request, split) item as the CTA runs it: its codes [t_begin, t_end) and its window
// positions [w_begin, w_end) (window row `row`); req < 0 past the CTA's last item.
struct ItemPlan {
  int req, slot, n_codes, t_begin, t_end, w_begin, w_end, row;
};

// MK / MV: K and V subspaces per head (K and V may have different bit rates).
template <typename T, int D, int MK, int MV>
struct DecodeCfg {
  static constexpr int DSK = D / MK;  // dims per K subspace
  static constexpr int DSV = D / MV;  // dims per V subspace
  static constexpr int KQ = D / 4;    // K dims per lane quarter
  static constexpr int KW = KQ / 2;   // 32-bit words per token for K
  static constexpr int MQ = MK / 4;   // K subspaces (code bytes) per lane quarter
  static constexpr int VSUB = MV / 8; // V subspaces owned per lane (8q + r)
  static constexpr int DWK = DSK / 2; // words per K centroid
  static constexpr int DWV = DSV / 2; // words per V centroid
  static constexpr int NT = D / 16;   // m16 tiles of output dims
  static constexpr bool kCbSmem = D <= 128;
  // Lookup rotation (see the header): K blocks of NK subspaces, V blocks of NV tiles. Full
  // blocks (XK = XV = 1) span a shared-memory phase (32 / DWK lanes: 8 / DWK lane rows for K,
  // 4 lane columns for V) and are conflict-free. XK / XV = 2 halves them: one select round
  // less per lookup at 2-way bank conflicts. The kernel is bound by the instructions it
  // issues more than by shared-memory wavefronts, so at head_dim 128 the round saved wins
  // where measured (one H100, Llama-3-8B and Qwen2.5-7B shapes): 4 bits, both halved: 8-11%
  // less time at 32K; 2 bits, K halved: 0.4-4.7% less at 32K (V halved as well: up to 5%
  // slower). Other shapes keep full blocks (not measured).
  static constexpr int XK = D == 128 && (MK == 64 || MK == 32) && MV == MK ? 2 : 1;
  static constexpr int XV = D == 128 && MK == 64 && MV == 64 ? 2 : 1;
  static constexpr int NK = 8 / DWK / XK;
  static constexpr int NV = (VSUB < 4 ? VSUB : 4) / XV;
  static constexpr int RV = 8 / DWV;  // lane rows of one phase for V
  // 32-bit words of a code's image row spanned by one block: K's 4 lane columns, V's 8 lane rows
  static constexpr int kKBlockWords = 4 * NK * DWK;
  static constexpr int kVBlockWords = 8 * NV * DWV;
  // 12 warps hide latency better than 8 that prefetch the next chunk's codes into registers
  // (<= 168 registers against 246-251): at 4 bits 0.86x FA3 against 0.85x at 1K x 64, 1.33x
  // against 1.16x at 32K x 8; 16 warps (128 registers, small spills) come within 2% of 12
  // (measured with lookups spread over banks by code). The next chunk's codes are prefetched
  // into shared memory (kStageBytes). head_dim 256 keeps 8: its codebooks stay in global
  // memory and its fragments need the registers.
  static constexpr int kWarps = D <= 128 ? 12 : 8;
  static constexpr int kThreads = 32 * kWarps;
  // The codebook image (k_word / v_word): rows of 256 bytes, one per code. head_dim 128: all K
  // rows, then all V rows; head_dim 64: a row holds K's 128 bytes, then V's.
  static constexpr int kRow = 256;
  static constexpr int kVBase = D == 128 ? kCentroids * kRow : 2 * D;
  static constexpr int kImgBytes = book_image_bytes(D);
  // Q.centroid tables (LUT) in place of K's rows (head_dim 128) or after the image (64)
  static constexpr int kLutOffset = D == 128 ? 0 : kImgBytes;
  static constexpr int kCbBytes = D == 128 ? kImgBytes : kImgBytes + MK * kCentroids * 4;
  static constexpr int kRedBytes = kWarps * kHeadsPerCta * (D + 2) * (int)sizeof(float);
  // Dynamic shared memory: the cross-warp reduction from byte 0 (the codebooks stay for the
  // next item: it has a region of its own), then the codebook image at img_at(base), the first
  // offset past the reduction whose shared-window address (base: that of byte 0) is a multiple
  // of 64 KB. A lookup's whole address (bits 16+ of the image's, the code, the lane's offset)
  // is then one byte permute, where adding a base register cost an instruction per lookup.
  static constexpr int kVImm = kVBase % 65536;  // V rows: image bits 16+ plus 1 at head_dim 128
  __host__ __device__ static constexpr int img_at(uint32_t base) {
    return kRedBytes + (int)((0x10000u - ((base + kRedBytes) & 0xffffu)) & 0xffffu);
  }
  // Each warp stages its next chunk's codes in shared memory, copied asynchronously while it
  // works on the chunk before, so that a chunk starts without waiting on HBM (without it,
  // global-load stalls are 19% of samples; prefetching into registers costs warps or spills):
  // K codes (32 token rows of MK bytes, as in the page) after the codebooks (kStageBytes),
  // V codes (MV rows of 32 tokens) in the reduction region, idle while chunks run
  // (kVStageBytes).
  static constexpr int kStageBytes = kWarps * kChunk * MK;
  static constexpr int kVStageBytes = kWarps * kChunk * MV;
  __host__ __device__ static constexpr int stage_at(uint32_t base) { return kCbSmem ? img_at(base) + kCbBytes : kRedBytes; }
  // `reserved`: where the window's dynamic shared memory starts (the driver's reserved bytes)
  // LaneLookup's per-lane constants ([word][lane], LaneLookup::save), after the K staging:
  // its K and V offset words and two rotation selectors
  static constexpr int kLaneWords = (NK + 1) / 2 + (NV + 1) / 2 + 2;
  static constexpr int kLaneBytes = kCbSmem ? 32 * 4 * kLaneWords : 0;
  // then the mbarrier that the codebook image's bulk copy signals (load_books)
  static constexpr int kBarBytes = kCbSmem ? 16 : 0;
  // then the CTA's next kSched items, resolved ahead (ItemPlan, plan_items)
  static constexpr int kSchedBytes = kSched * (int)sizeof(ItemPlan) + kSched * kWarps * 4;
  // then the attention sinks of the CTA's query heads, in the log2 domain of scores
  static constexpr int kSinkBytes = kHeadsPerCta * 4;
  __host__ __device__ static constexpr int smem_bytes(int reserved) {
    return stage_at(reserved) + kStageBytes + kLaneBytes + kBarBytes + kSchedBytes + kSinkBytes;
  }
  static_assert(DSK >= 2 && DSK <= 8 && DSV >= 2 && DSV <= 8 && D % 16 == 0 && MK % 8 == 0 &&
                MV % 8 == 0, "unsupported D/M");
  static_assert(VSUB * DWV == NT, "tiles");
  static_assert(!kCbSmem || D == 64 || D == 128, "the codebook image has rows of 2 * 128 bytes");
  static_assert(kVStageBytes <= kRedBytes, "V staging in the reduction region");
  static_assert(MQ % NK == 0 && VSUB % NV == 0, "rotation blocks");
  static_assert(!kCbSmem || kVBase % 65536 == 0 || kVBase < 256, "V rows at the next 64 KB or within a row");
};

// Where a centroid sits in the codebook image, as a 32-bit word of its code's row (K from
// byte 0 of the row, V from byte kVBase). K subspace s = c * MQ + m is read by lane column c;
// within a block of NK subspaces (m / NK), entry (c, m % NK) has a bank group of its own, so
// the lanes of one phase (8 / DWK lane rows x 4 columns) reading distinct m of a block share
// a bank only XK-way (lane rows r and r + NK read the same entry's bank group). V subspace
// s = 8q + r is read by lane row r; within a block of NV tiles the entries of (q % NV, r % RV)
// have bank groups of their own, r / RV picks the phase's row (lane columns c and c + NV
// share a bank group where NV < 4).
template <class C>
__host__ __device__ constexpr int k_word(int s) {
  const int c = s / C::MQ, m = s % C::MQ;
  return (m / C::NK) * C::kKBlockWords + (c * C::NK + m % C::NK) * C::DWK;
}

template <class C>
__host__ __device__ constexpr int v_word(int s) {
  const int q = s / 8, r = s % 8;
  return (q / C::NV) * C::kVBlockWords + ((r / C::RV) * C::NV * C::RV + (q % C::NV) * C::RV + r % C::RV) * C::DWV;
}

// The LUT's layout (floats): lane quarter c reads subspaces c*MQ .., so quarter c gets a
// quarter of each 128-byte row (8 lanes share a subspace: conflicts remain, see the header).
template <int MQ>
__device__ __forceinline__ int lut_unit(int sub, int code) {
  return ((sub % MQ) * (kCentroids / 8) + code / 8) * 32 + (sub / MQ) * 8 + code % 8;
}

// x[b][m][*] <- x[b][(m - amount) mod N][*] for the BLOCKS blocks of N entries of W words:
// a barrel rotation, log2(N) rounds of selects.
template <int N, int W, int BLOCKS>
__device__ __forceinline__ void rotate_entries(uint32_t (&x)[BLOCKS * N * W], int amount) {
#pragma unroll
  for (int sh = 1; sh < N; sh <<= 1) {
    const bool on = amount & sh;
    uint32_t t[BLOCKS * N * W];
#pragma unroll
    for (int i = 0; i < BLOCKS * N * W; ++i) {
      const int b = i / (N * W), m = i / W % N, w = i % W;
      t[i] = on ? x[(b * N + (m - sh + N) % N) * W + w] : x[i];
    }
#pragma unroll
    for (int i = 0; i < BLOCKS * N * W; ++i) x[i] = t[i];
  }
}

// One byte permute: code byte `kb` of `codes` times 256 plus byte `ob` (0 or 1) of `offs`,
// plus bytes 2 and 3 of `offs` as bits 16-31: a lookup's shared-window address.
// (kb and ob are constants once the loops around are unrolled: the selector is immediate.)
__device__ __forceinline__ uint32_t row_address(uint32_t codes, uint32_t offs, int kb, int ob) {
  return __byte_perm(codes, offs, (4 + ob) | (kb << 4) | (6 << 8) | (7 << 12));
}

// The code bytes a lane needs for one 32-token chunk.
template <class C>
struct ChunkCodes {
  uint32_t k[2][2][(C::MQ + 3) / 4];  // [half][row r | r+8][bytes]
  uint32_t v[2][C::VSUB];             // [half][tile slot]: tokens 8c+4h .. +3 of a tile
};                                    // (slots hold the tiles rotated, see load_codes)

__device__ __forceinline__ int k_token(int half, int r) { return 8 * (r >> 1) + 4 * half + (r & 1); }

// The first 32-token chunk of an item's codes [t_begin, ..): warp w takes chunks from
// first_chunk(t_begin) + 32 w, one of every kWarps (plan_items resolves their first pages).
__device__ __forceinline__ int first_chunk(int t_begin) { return t_begin / kChunk * kChunk; }

// Dynamic shared memory (DecodeCfg: the cross-warp reduction, then the codebook image).
// Addressed through this symbol so that accesses compile to shared-memory loads (through a
// pointer that may also be global they would be generic loads).
extern __shared__ __align__(16) uint8_t pq_smem[];

// A lane's constants for the image lookups: lookup j of a block reads K subspace
// c*MQ + b*NK + (j + rk) % NK and V tile qb*NV + (j + rv) % NV.
template <class C>
struct LaneLookup {
  uint32_t k_off[(C::NK + 1) / 2];  // image offsets (bytes within the block's rows) of
  uint32_t v_off[(C::NV + 1) / 2];  // lookup j in byte j % 2 of word j / 2; bytes 2-3: bits
                                    // 16-31 of the K / V rows' shared-window address
  uint32_t k_rot[2];  // byte_perm selectors rotating code bytes by rk within blocks of NK
  int rk, rv;
  static_assert(sizeof(k_off) + sizeof(v_off) + sizeof(k_rot) == 4 * C::kLaneWords, "save / load's table");

  // The offsets and selectors from / to a per-lane table in shared memory ([word][lane]):
  // the compiler, short of registers, recomputed them from (r, c) every chunk (about 70
  // instructions); a reload is a few shared loads.
  __device__ void save(uint32_t* t, int lane) const {
    int i = 0;
    for (int j = 0; j < (C::NK + 1) / 2; ++j) t[32 * i++ + lane] = k_off[j];
    for (int j = 0; j < (C::NV + 1) / 2; ++j) t[32 * i++ + lane] = v_off[j];
    t[32 * i++ + lane] = k_rot[0];
    t[32 * i++ + lane] = k_rot[1];
  }
  __device__ void load(const uint32_t* t, int lane) {
    int i = 0;
#pragma unroll
    for (int j = 0; j < (C::NK + 1) / 2; ++j) k_off[j] = t[32 * i++ + lane];
#pragma unroll
    for (int j = 0; j < (C::NV + 1) / 2; ++j) v_off[j] = t[32 * i++ + lane];
    k_rot[0] = t[32 * i++ + lane];
    k_rot[1] = t[32 * i++ + lane];
  }

  // hi: bits 16-31 of the image's shared-window address (its low 16 bits are zero)
  __device__ LaneLookup(int r, int c, uint32_t hi) {
    rk = C::kCbSmem ? r % C::NK : 0;
    rv = C::kCbSmem ? c % C::NV : 0;
#pragma unroll
    for (int i = 0; i < (C::NK + 1) / 2; ++i) k_off[i] = hi << 16;
#pragma unroll
    for (int i = 0; i < (C::NV + 1) / 2; ++i) v_off[i] = (hi + C::kVBase / 65536) << 16;
#pragma unroll
    for (int j = 0; j < C::NK; ++j)
      k_off[j / 2] |= (uint32_t)(4 * k_word<C>(c * C::MQ + (j + rk) % C::NK)) << (8 * (j % 2));
#pragma unroll
    for (int j = 0; j < C::NV; ++j)  // (block 0: under 256 bytes, the rest is per block)
      v_off[j / 2] |= (uint32_t)(4 * v_word<C>(8 * ((j + rv) % C::NV) + r)) << (8 * (j % 2));
    k_rot[0] = k_rot[1] = 0u;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (C::NK == 8) {  // a block is two words: select from both
        k_rot[0] |= (uint32_t)((k + rk) % 8) << (4 * k);
        k_rot[1] |= (uint32_t)((k + 4 + rk) % 8) << (4 * k);
      } else {  // blocks within a word
        k_rot[0] |= (uint32_t)((k / C::NK) * C::NK + (k + rk) % C::NK) << (4 * k);
      }
    }
  }
};

template <typename T, int D, int MK, int MV>
struct DecodeCta {
  using C = DecodeCfg<T, D, MK, MV>;
  const DecodeArgs& a;
  int req, hkv, r, c;
  const int32_t* bt;
  const T* kcb;  // this head's codebooks in global memory, [MK][256][DSK], [MV][256][DSV]
  const T* vcb;
  const uint8_t* img;  // this head's codebook image (head_dim <= 128)
  uint8_t* bsm;        // where it sits in shared memory (DecodeCfg::img_at)
  uint8_t* stage;      // this warp's staging of K codes (DecodeCfg::kStageBytes)
  uint8_t* vstage;     // and of V codes (DecodeCfg::kVStageBytes)
  const T* wk = nullptr;  // this request's window rows [W][D]
  const T* wv = nullptr;
  int win_base;  // position of window slot 0
  LaneLookup<C> lk;

  __device__ DecodeCta(const DecodeArgs& a_, int req_, int hkv_, int r_, int c_, const int32_t* bt_, int win_base_,
                       int img_at, uint8_t* stage_, uint8_t* vstage_)
      : a(a_), req(req_), hkv(hkv_), r(r_), c(c_), bt(bt_),
        kcb(static_cast<const T*>(a_.k_cb) + (int64_t)hkv_ * kCentroids * D),
        vcb(static_cast<const T*>(a_.v_cb) + (int64_t)hkv_ * kCentroids * D),
        img(a_.books + (int64_t)hkv_ * C::kImgBytes), bsm(pq_smem + img_at), stage(stage_),
        vstage(vstage_), win_base(win_base_),
        lk(r_, c_, static_cast<uint32_t>(__cvta_generic_to_shared(bsm)) >> 16) {}

  // This warp's chunk t0 of codes, on page `page` (bt's entry for t0), into its staging: K's
  // 32 rows (contiguous in the page), V's MV rows of 32 bytes, as asynchronous 16-byte copies
  // (take_codes waits for them).
  __device__ void stage_codes(int t0, int page) const {
    const int lane = 4 * r + c;
    const uint8_t* reg = a.pages.base + (int64_t)page * a.pages.block_stride + (int64_t)hkv * a.pages.head_stride;
    const int off0 = t0 % a.pages.block_size;
    const uint8_t* src = reg + a.pages.lay.k_off + off0 * MK;
    for (int u = 16 * lane; u < kChunk * MK; u += 16 * 32) cp_async16(stage + u, src + u);
    for (int u = lane; u < 2 * MV; u += 32)
      cp_async16(vstage + 16 * u, reg + a.pages.lay.v_off + (u / 2) * a.pages.lay.v_sub + off0 + 16 * (u % 2));
  }

  // The staged codes this lane needs: K of its tokens and quarter; V of its tiles, tile
  // qb*NV + (j + rv) % NV in slot qb*NV + j (an 8-byte load covers both halves). The staging
  // is free for the next stage_codes once this returns (every lane of the warp has read it).
  __device__ void take_codes(ChunkCodes<C>& cc) const {
    cp_async_wait_all();
    __syncwarp();  // the other lanes' copies are visible
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) load_bytes<C::MQ>(stage + (k_token(h, r) + 2 * e) * MK + c * C::MQ, cc.k[h][e]);
#pragma unroll
    for (int i = 0; i < C::VSUB; ++i) {
      const int q = (i / C::NV) * C::NV + (i % C::NV + lk.rv) % C::NV;
      const uint2 x = *reinterpret_cast<const uint2*>(vstage + (8 * q + r) * kChunk + 8 * c);
      cc.v[0][i] = x.x;
      cc.v[1][i] = x.y;
    }
    __syncwarp();
  }

  // K of one token, this lane's quarter of the dims (subspaces c*MQ .. in order), as words.
  template <bool WIN>
  __device__ void fetch_k(const ChunkCodes<C>& cc, int h, int e, int pos, uint32_t (&w)[C::KW]) const {
    if constexpr (WIN) {
      load_words<C::KW>(wk + (int64_t)win_slot(pos) * D + c * C::KQ, w);
    } else if constexpr (C::kCbSmem) {
      constexpr int NW = (C::MQ + 3) / 4;
      uint32_t codes[NW];  // byte j of block b: subspace b*NK + (j + rk) % NK
#pragma unroll
      for (int i = 0; i < NW; ++i) {
        if constexpr (C::NK == 8) {
          codes[i] = __byte_perm(cc.k[h][e][i & ~1], cc.k[h][e][i | 1], lk.k_rot[i & 1]);
        } else {
          codes[i] = __byte_perm(cc.k[h][e][i], 0u, lk.k_rot[0]);
        }
      }
#pragma unroll
      for (int i = 0; i < C::MQ; ++i) {
        const int j = i % C::NK;
        const uint32_t at = row_address(codes[i / 4], lk.k_off[j / 2], i % 4, j % 2);
        uint32_t cw[C::DWK];
        lds_words<C::DWK>(at + (i / C::NK) * 4 * C::kKBlockWords, cw);
#pragma unroll
        for (int u = 0; u < C::DWK; ++u) w[i * C::DWK + u] = cw[u];
      }
      rotate_entries<C::NK, C::DWK, C::MQ / C::NK>(w, lk.rk);
    } else {
#pragma unroll
      for (int mm = 0; mm < C::MQ; ++mm) {
        const int sub = c * C::MQ + mm;
        uint32_t cw[C::DWK];
        load_words<C::DWK>(kcb + (sub * kCentroids + byte_of(cc.k[h][e], mm)) * C::DSK, cw);
#pragma unroll
        for (int u = 0; u < C::DWK; ++u) w[mm * C::DWK + u] = cw[u];
      }
    }
  }

  // V of tokens tv .. tv + 3 (bytes 0..3 of `codes`, one word per tile slot) in tiles
  // qb*NV .. qb*NV + NV - 1 (dims of subspaces 8q + r), in tile order; zero for a window
  // position outside [k_lo, k_hi), whose row may hold anything.
  template <bool WIN>
  __device__ void fetch_v(const uint32_t (&codes)[C::VSUB], int qb, int tv, int k_lo, int k_hi,
                          uint32_t (&v)[4][C::NV * C::DWV]) const {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int j = 0; j < C::NV; ++j) {
        uint32_t cw[C::DWV];
        const int s = 8 * (qb * C::NV + j) + r;
        if constexpr (WIN) {
          if (tv + k >= k_lo && tv + k < k_hi) {
            load_words<C::DWV>(wv + (int64_t)win_slot(tv + k) * D + s * C::DSV, cw);
          } else {
#pragma unroll
            for (int u = 0; u < C::DWV; ++u) cw[u] = 0u;
          }
        } else if constexpr (C::kCbSmem) {
          const uint32_t at = row_address(codes[qb * C::NV + j], lk.v_off[j / 2], k, j % 2);
          lds_words<C::DWV>(at + C::kVImm + qb * 4 * C::kVBlockWords, cw);
        } else {
          const int code = (codes[qb * C::NV + j] >> (8 * k)) & 0xff;
          load_words<C::DWV>(vcb + (s * kCentroids + code) * C::DSV, cw);
        }
#pragma unroll
        for (int u = 0; u < C::DWV; ++u) v[k][j * C::DWV + u] = cw[u];
      }
      if constexpr (!WIN && C::kCbSmem) rotate_entries<C::NV, C::DWV, 1>(v[k], lk.rv);
    }
  }

  // The codebook image into shared memory (wait_books waits for it). With LUT the K part is
  // each request's Q.centroid table (build_lut) instead. From sm_90 one bulk copy issued by
  // one thread, completing on its own mbarrier, apart from the codes' cp.async copies: so a
  // warp starts once its own codes and the image are in, not once every warp's codes are;
  // before sm_90 every 16-byte piece is a cp.async copy.
  // The caller makes `bar`'s init visible (a barrier) before anyone waits on it.
  template <bool LUT>
  __device__ void load_books(uint64_t* bar) const {
    constexpr int lo = (LUT && D == 128) ? C::kVBase : 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    for (int u = lo + 16 * threadIdx.x; u < C::kImgBytes; u += 16 * C::kThreads) cp_async16(bsm + u, img + u);
#else
    if (threadIdx.x == 0) {
      mbar_init_expect(bar, C::kImgBytes - lo);
      bulk_copy(bsm + lo, img + lo, C::kImgBytes - lo, bar);
    }
#endif
  }

  // Every thread of the CTA: the image is in shared memory and visible to all (before sm_90
  // after a barrier, which publishes the pieces other threads copied).
  __device__ static void wait_books(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    cp_async_wait_all();
    __syncthreads();
#else
    mbar_wait(bar, 0);
#endif
  }

  __device__ void build_lut(const T* qh) const {
    float* lut = reinterpret_cast<float*>(bsm + C::kLutOffset);
    for (int u = threadIdx.x; u < MK * kCentroids; u += C::kThreads) {
      const int sub = u / kCentroids, code = u % kCentroids;
      uint32_t w[C::DWK];
      load_words<C::DWK>(kcb + u * C::DSK, w);
      const T* cen = reinterpret_cast<const T*>(w);
      float dot = 0.f;
#pragma unroll
      for (int i = 0; i < C::DSK; ++i) dot += Elem<T>::to_float(qh[sub * C::DSK + i]) * Elem<T>::to_float(cen[i]);
      lut[lut_unit<C::MQ>(sub, code)] = dot;
    }
  }

  __device__ int win_slot(int pos) const {
    const int slot = pos - win_base;
    return (slot >= 0 && slot < a.window) ? slot : 0;  // out-of-range rows are masked
  }
};

// Where a request's keys go.
// Codes [lo, n_codes) in `used` splits of `per` tokens from `first`, and the window
// [max(n_codes, lo), L) (layout.window_start of the query at L - 1) in split used - 1,
// where lo = L - sliding_window on sliding-window layers (else 0). Pages wholly before lo
// are never touched: vLLM frees them, and the block table may still name their old blocks.
// `per` is at least min_split: a request with at most min_split codes has one split
// whatever num_splits is. Splits past `used` are empty (their items write -inf).
struct SplitPlan {
  int n_codes, lo, first, per, used;
};

__device__ __forceinline__ SplitPlan split_plan(const DecodeArgs& a, int len) {
  SplitPlan p;
  p.n_codes = a.window > 0 ? ((max(len, 1) - 1) / a.window) * a.window : len;
  p.lo = a.sliding_window > 0 ? max(0, len - a.sliding_window) : 0;
  p.first = first_chunk(p.lo);  // splits stay 32-token aligned
  p.per = kChunk, p.used = 1;   // (no codes: the window's split only)
  if (p.n_codes > p.lo) {
    const int even = ceil_div(p.n_codes - p.first, a.num_splits);
    p.per = max(a.min_split, ceil_div(even, kChunk) * kChunk);
    p.used = ceil_div(p.n_codes - p.first, p.per);
  }
  return p;
}

// Items (request, split) are dealt to a head group's CTAs in rounds of gridDim.x, requests
// longest first (a.order) and every other round in reverse (a snake), so that each CTA gets
// about as many codes as the others whatever the mix of lengths; dealt in the batch's order,
// the CTA that draws the longest requests sets the launch's time (longest first takes 12-28%
// off the kernel's time with requests of 4K-14K tokens on an H100, wherever a CTA gets more
// than one item).
// Which CTA runs an item does not change its result.
// A CTA resolves its items of rounds r0 .. r0 + kSched - 1 together, lane k of each warp
// round r0 + k: the item into plans[k] (warp 0) and each warp's first page of its codes into
// pages[k][warp], so that the dependent loads (order, seq_lens, block table) are one chain per
// kSched items, not one per item ahead of its first codes.
template <int WARPS>
__device__ void plan_items(const DecodeArgs& a, int r0, ItemPlan* plans, int* pages) {
  const int warp = threadIdx.x / 32, k = threadIdx.x % 32;
  const int round = r0 + k, slots = a.num_splits;
  const int item = round * gridDim.x + (round % 2 ? gridDim.x - 1 - blockIdx.x : blockIdx.x);
  ItemPlan p{-1, 0, 0, 0, 0, 0, 0, -1};
  int page = 0;
  if (item < a.num_reqs * slots) {
    p.req = a.order != nullptr ? a.order[item / slots] : item / slots;
    p.slot = item % slots;
    const int len = a.seq_lens[p.req];
    const SplitPlan sp = split_plan(a, len);
    p.n_codes = sp.n_codes;
    if (len > 0) {
      if (sp.n_codes > sp.lo) {
        p.t_begin = min(sp.first + p.slot * sp.per, sp.n_codes), p.t_end = min(p.t_begin + sp.per, sp.n_codes);
        p.t_begin = max(p.t_begin, sp.lo);
      }
      // (a window row outside the store, which the builder never gives, is not touched)
      const int wrow = a.window > 0 ? a.rows[p.req] : -1;
      if (wrow >= 0 && wrow < a.win_rows && p.slot == sp.used - 1)
        p.w_begin = max(sp.n_codes, sp.lo), p.w_end = len, p.row = wrow;
    }
    const int t0 = first_chunk(p.t_begin) + warp * kChunk;
    if (p.t_begin < p.t_end && t0 < p.t_end) page = a.block_table[p.req * a.bt_stride + t0 / a.pages.block_size];
  }
  if (warp == 0) plans[k] = p;
  pages[k * WARPS + warp] = page;
}

// Attention sinks are a runtime flag, not a template one: the kernel with sinks is the kernel
// without them, so both run the same main loop. As a separate instantiation, ptxas allocated
// and scheduled its main loop anew, which cost 1-3% at 2 bits; with the flag, a sink costs a
// shared-memory read and one term in the epilogue (at head_dim 64 and 128 the main loop's
// SASS is that of a kernel with no sink code). LUT kernels never see sinks and carry none.
template <typename T, int D, int MK, int MV, bool LUT>
__global__ void __launch_bounds__(DecodeCfg<T, D, MK, MV>::kThreads, 1) decode_kernel(DecodeArgs a) {
  using C = DecodeCfg<T, D, MK, MV>;
  static_assert(!LUT || C::kCbSmem, "the LUT takes the shared-memory codebook's place");
  const int group = a.num_heads / a.num_kv_heads;
  const int hgroups = ceil_div(group, kHeadsPerCta);
  const int hkv = blockIdx.y / hgroups, hg = blockIdx.y % hgroups;
  const int h0 = hkv * group + hg * kHeadsPerCta;
  const int nh = min(kHeadsPerCta, group - hg * kHeadsPerCta);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r = lane >> 2, c = lane & 3;
  const int slots = a.num_splits;
  const int img_at = C::img_at(static_cast<uint32_t>(__cvta_generic_to_shared(pq_smem)));
  // (the launch sized shared memory for the window starting at the reserved bytes)
  const int stage_at = C::stage_at(static_cast<uint32_t>(__cvta_generic_to_shared(pq_smem)));
  if (C::smem_bytes(static_cast<uint32_t>(__cvta_generic_to_shared(pq_smem))) > (int)dynamic_smem_bytes()) __trap();
  uint32_t* lane_table = reinterpret_cast<uint32_t*>(pq_smem + stage_at + C::kStageBytes);
  uint64_t* books_bar = reinterpret_cast<uint64_t*>(pq_smem + stage_at + C::kStageBytes + C::kLaneBytes);
  ItemPlan* plans = reinterpret_cast<ItemPlan*>(pq_smem + stage_at + C::kStageBytes + C::kLaneBytes + C::kBarBytes);
  int* first_pages = reinterpret_cast<int*>(plans + kSched);  // [kSched][kWarps]
  float* sink_l2 = reinterpret_cast<float*>(first_pages + kSched * C::kWarps);  // [kHeadsPerCta]
  const bool sinks = !LUT && a.sinks != nullptr;
  if (sinks && threadIdx.x < nh) sink_l2[threadIdx.x] = sink_log2<T>(a, h0 + threadIdx.x);
  // The codebooks, once for all of this CTA's items, in flight while the first codes load.
  bool books_ready = !C::kCbSmem;
  uint8_t* stage = pq_smem + stage_at + warp * kChunk * MK;  // K codes, past the codebooks
  uint8_t* vstage = pq_smem + warp * kChunk * MV;             // V codes, in the reduction region
  if constexpr (C::kCbSmem) {
    DecodeCta<T, D, MK, MV> first(a, 0, hkv, r, c, nullptr, 0, img_at, stage, vstage);
    first.template load_books<LUT>(books_bar);
    if (warp == 0) first.lk.save(lane_table, lane);
  }

  for (int round = 0;; ++round) {
    if (round % kSched == 0) {
      if (round > 0) __syncthreads();  // every thread is done with the previous items' plans
      plan_items<C::kWarps>(a, round, plans, first_pages);
      __syncthreads();  // the plans (at round 0 also the lane table and the barrier's init) are visible
    }
    const ItemPlan it = plans[round % kSched];
    if (it.req < 0) break;
    const int req = it.req, slot = it.slot, n_codes = it.n_codes;
    const int t_begin = it.t_begin, t_end = it.t_end, w_begin = it.w_begin, w_end = it.w_end;
    float* lse_out = a.ws_lse + ((int64_t)req * a.num_heads + h0) * slots + slot;
    // One split: the item's result is the output (what reduce_kernel would write, bit for
    // bit without sinks), so there is no workspace round trip and no reduce launch
    // (pq_decode.cu), unless the merge has the exact store's corrections to add.
    T* direct = slots == 1 && a.corr == nullptr ? static_cast<T*>(a.out) + req * a.out_stride + (int64_t)h0 * D
                                                : nullptr;
    const bool has_codes = t_begin < t_end, has_win = w_begin < w_end;
    if (!has_codes && !has_win) {
      if (direct != nullptr) {
        for (int idx = threadIdx.x; idx < nh * D; idx += C::kThreads) direct[idx] = Elem<T>::from_float(0.f);
      } else if (threadIdx.x < nh) {
        lse_out[threadIdx.x * slots] = -CUDART_INF_F;
      }
      continue;
    }

    if (round > 0) __syncthreads();  // the reduction region's readers are done (V staging)
    DecodeCta<T, D, MK, MV> cta(a, req, hkv, r, c, a.block_table + (int64_t)req * a.bt_stride, n_codes, img_at, stage, vstage);
    // This warp's first codes are requested before anything else of the item: their HBM
    // latency is the longest wait of its start.
    const int first = first_chunk(t_begin);
    int t0 = first + warp * kChunk;  // (plan_items resolved this chunk's page)
    if (has_codes && t0 < t_end) cta.stage_codes(t0, first_pages[(round % kSched) * C::kWarps + warp]);
    if (has_win) {
      const int64_t row = ((int64_t)it.row * a.num_kv_heads + hkv) * a.window * D;
      cta.wk = static_cast<const T*>(a.win_k) + row;
      cta.wv = static_cast<const T*>(a.win_v) + row;
      if (a.new_k != nullptr) {
        // This step's key and value into their window slot, which this item reads below
        // (a CTA of each head group writes the same bytes).
        const int64_t at = row + (int64_t)(w_end - 1 - n_codes) * D;  // (w_end: the request's length)
        const T* nk = static_cast<const T*>(a.new_k) + req * a.new_k_stride + (int64_t)hkv * D;
        const T* nv = static_cast<const T*>(a.new_v) + req * a.new_v_stride + (int64_t)hkv * D;
        for (int i = threadIdx.x; i < 2 * D; i += C::kThreads)
          (i < D ? static_cast<T*>(a.win_k) : static_cast<T*>(a.win_v))[at + i % D] = (i < D ? nk : nv)[i % D];
        __syncthreads();
      }
    }
    if constexpr (LUT) {
      if (has_codes) {
        __syncthreads();  // the previous item's lookups are over
        cta.build_lut(static_cast<const T*>(a.q) + req * a.q_stride + (int64_t)h0 * D);
      }
    }

    // Q^T as B fragments: head h0 + r, this lane's dims c*D/4 .. (zero for absent heads).
    uint32_t qf[C::KW];
    if (r < nh) {
      load_words<C::KW>(static_cast<const T*>(a.q) + req * a.q_stride + (int64_t)(h0 + r) * D + c * C::KQ, qf);
    } else {
#pragma unroll
      for (int i = 0; i < C::KW; ++i) qf[i] = 0u;
    }
    const float scale = a.scale * kLog2e;

    float o[C::NT][4];
#pragma unroll
    for (int i = 0; i < C::NT; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {-CUDART_INF_F, -CUDART_INF_F}, l_run[2] = {0.f, 0.f};

    // Keys t0 .. t0 + 31, of which [k_lo, k_hi) count.
    auto chunk = [&](auto win_tag, int t0, const ChunkCodes<C>& cc, int k_lo, int k_hi) {
      constexpr bool WIN = decltype(win_tag)::value;
      float s[2][4];
  #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pa = t0 + k_token(h, r), pb = pa + 2;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if constexpr (LUT && !WIN) {
          // Partial sums over this lane's subspaces, then over the 4 lanes of the row;
          // every column (query head slot) gets the one head's score.
          const float* lut = reinterpret_cast<const float*>(cta.bsm + C::kLutOffset);
          float sa = 0.f, sb = 0.f;
  #pragma unroll
          for (int mm = 0; mm < C::MQ; ++mm) {
            sa += lut[lut_unit<C::MQ>(c * C::MQ + mm, byte_of(cc.k[h][0], mm))];
            sb += lut[lut_unit<C::MQ>(c * C::MQ + mm, byte_of(cc.k[h][1], mm))];
          }
          sa += __shfl_xor_sync(0xffffffffu, sa, 1);
          sb += __shfl_xor_sync(0xffffffffu, sb, 1);
          sa += __shfl_xor_sync(0xffffffffu, sa, 2);
          sb += __shfl_xor_sync(0xffffffffu, sb, 2);
          acc[0] = acc[1] = sa;
          acc[2] = acc[3] = sb;
        } else {
          uint32_t ka[C::KW], kb[C::KW];
          cta.template fetch_k<WIN>(cc, h, 0, pa, ka);
          cta.template fetch_k<WIN>(cc, h, 1, pb, kb);
  #pragma unroll
          for (int j = 0; j < D / 16; ++j) {
            const uint32_t fa[4] = {ka[2 * j], kb[2 * j], ka[2 * j + 1], kb[2 * j + 1]};
            mma<T>(acc, fa, qf[2 * j], qf[2 * j + 1]);
          }
        }
        const bool va = pa >= k_lo && pa < k_hi, vb = pb >= k_lo && pb < k_hi;
        s[h][0] = va ? acc[0] * scale : -CUDART_INF_F;
        s[h][1] = va ? acc[1] * scale : -CUDART_INF_F;
        s[h][2] = vb ? acc[2] * scale : -CUDART_INF_F;
        s[h][3] = vb ? acc[3] * scale : -CUDART_INF_F;
      }
      // Online softmax for this lane's heads 2c (e = 0) and 2c + 1 (e = 1).
      float p[2][4], alpha[2];
      bool moved = false;
  #pragma unroll
      for (int e = 0; e < 2; ++e) {
        float mx = fmaxf(fmaxf(s[0][e], s[0][e + 2]), fmaxf(s[1][e], s[1][e + 2]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
        const float m_new = fmaxf(m_run[e], mx);
        const float m_use = m_new == -CUDART_INF_F ? 0.f : m_new;
        alpha[e] = exp2f(m_run[e] - m_use);
  #pragma unroll
        for (int h = 0; h < 2; ++h) {
          p[h][e] = exp2f(s[h][e] - m_use);
          p[h][e + 2] = exp2f(s[h][e + 2] - m_use);
        }
        l_run[e] = l_run[e] * alpha[e] + (p[0][e] + p[0][e + 2]) + (p[1][e] + p[1][e + 2]);
        moved |= m_new != m_run[e];
        m_run[e] = m_new;
      }
      // O is rescaled only when some lane's running max moved, which past the first chunks
      // of a split is rare; otherwise alpha is 1, or both maxima are -inf and O holds only
      // zeros or NaN, which alpha = 0 leaves as they are: the same result bit for bit.
      if (__any_sync(0xffffffffu, moved)) {
  #pragma unroll
        for (int e = 0; e < 2; ++e)
  #pragma unroll
          for (int i = 0; i < C::NT; ++i) o[i][e] *= alpha[e], o[i][e + 2] *= alpha[e];
      }
      // O^T += V^T P per half: P^T fragments by transposing the score fragments.
  #pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t pb0 = movmatrix_trans(Elem<T>::pack(p[h][0], p[h][1]));
        const uint32_t pb1 = movmatrix_trans(Elem<T>::pack(p[h][2], p[h][3]));
        const int tv = t0 + 8 * c + 4 * h;
        // P is 0 for keys outside [k_lo, k_hi), but 0 * NaN is NaN: such keys must not bring
        // in the NaN centroid of layout.NAN_CODE (subspace 0: tile 0, r = 0; stale page bytes,
        // keys before a sliding window), so their subspace-0 codes read centroid 0 instead.
        uint32_t cv[C::VSUB];
  #pragma unroll
        for (int i = 0; i < C::VSUB; ++i) cv[i] = cc.v[h][i];
        if constexpr (!WIN) {
          if (r == 0 && (t0 < k_lo || t0 + kChunk > k_hi)) {  // edge chunks only
            const int slot0 = (C::NV - cta.lk.rv) % C::NV;  // tile 0's slot (load_codes)
  #pragma unroll
            for (int j = 0; j < C::NV; ++j)
  #pragma unroll
              for (int k = 0; k < 4; ++k)
                if (j == slot0 && (tv + k < k_lo || tv + k >= k_hi)) cv[j] &= ~(0xffu << (8 * k));
          }
        }
  #pragma unroll
        for (int qb = 0; qb < C::VSUB / C::NV; ++qb) {
          uint32_t v[4][C::NV * C::DWV];
          cta.template fetch_v<WIN>(cv, qb, tv, k_lo, k_hi, v);
  #pragma unroll
          for (int i = 0; i < C::NV * C::DWV; ++i) {
            const uint32_t fa[4] = {__byte_perm(v[0][i], v[1][i], 0x5410), __byte_perm(v[0][i], v[1][i], 0x7632),
                                    __byte_perm(v[2][i], v[3][i], 0x5410), __byte_perm(v[2][i], v[3][i], 0x7632)};
            mma<T>(o[qb * C::NV * C::DWV + i], fa, pb0, pb1);
          }
        }
      }
    };

    constexpr int stride = C::kWarps * kChunk;
    int code_chunks = 0;
    if (has_codes) {
      code_chunks = ceil_div(t_end - first, kChunk);
      if constexpr (C::kCbSmem) {
        if (LUT || !books_ready) {
          cta.wait_books(books_bar);
          if (LUT) __syncthreads();  // this item's LUT is visible
          books_ready = true;
        }
      }
      for (; t0 < t_end; t0 += stride) {
        ChunkCodes<C> cur;
        cta.take_codes(cur);
        if constexpr (C::kCbSmem) cta.lk.load(lane_table, lane);
        if (t0 + stride < t_end) cta.stage_codes(t0 + stride, cta.bt[(t0 + stride) / a.pages.block_size]);
        chunk(std::false_type{}, t0, cur, t_begin, t_end);
      }
    }
    if (has_win) {  // the window's chunks go on round the warps where the codes' stopped
      ChunkCodes<C> none;
      for (int i = (warp - code_chunks % C::kWarps + C::kWarps) % C::kWarps; w_begin + i * kChunk < w_end;
           i += C::kWarps)
        chunk(std::true_type{}, w_begin + i * kChunk, none, w_begin, w_end);
    }

    // Combine the warps: each lane's l covers its rows only; sum over r.
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 4);
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 8);
      l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 16);
    }
    __syncthreads();  // the previous item's readers of the reduction region are done
    float* red = reinterpret_cast<float*>(pq_smem);  // [warp][head][D + 2]
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float* dst = red + (warp * kHeadsPerCta + 2 * c + e) * (D + 2);
#pragma unroll
      for (int i = 0; i < C::NT; ++i) {
        const int dim = (8 * (i / C::DWV) + r) * C::DSV + 2 * (i % C::DWV);
        dst[dim] = o[i][e];
        dst[dim + 1] = o[i][e + 2];
      }
      if (r == 0) dst[D] = m_run[e], dst[D + 1] = l_run[e];
    }
    __syncthreads();
    float* o_out = a.ws_o + (((int64_t)req * a.num_heads + h0) * slots + slot) * D;
    for (int idx = threadIdx.x; idx < nh * D; idx += C::kThreads) {
      const int head = idx / D, dim = idx % D;
      float mstar = -CUDART_INF_F;
#pragma unroll
      for (int w = 0; w < C::kWarps; ++w) mstar = fmaxf(mstar, red[(w * kHeadsPerCta + head) * (D + 2) + D]);
      float num = 0.f, den = 0.f;
      if (mstar != -CUDART_INF_F) {
#pragma unroll
        for (int w = 0; w < C::kWarps; ++w) {
          const float* src = red + (w * kHeadsPerCta + head) * (D + 2);
          const float f = exp2f(src[D] - mstar);
          num += f * src[dim];
          den += f * src[D + 1];
        }
      }
      // den is 0 (no keys), positive, or NaN (a NaN-marked key, layout.py): NaN propagates
      if (direct != nullptr) {
        // One split: the output, and where an attention sink joins its denominator (split
        // results stay sink-free; reduce_kernel adds it once to their merge).
        if (sinks && den != 0.f) den += exp2f(sink_l2[head] - mstar);
        direct[idx] = Elem<T>::from_float(den != 0.f ? num / den : 0.f);
        continue;
      }
      const float o_val = den != 0.f ? num / den : 0.f;
      o_out[(int64_t)head * slots * D + dim] = o_val;
      if (dim == 0) lse_out[head * slots] = den != 0.f ? mstar + log2f(den) : -CUDART_INF_F;
    }
  }
  // No copy outlives the CTA: every codes copy was taken by take_codes; the image's is
  // waited for here where no item had codes.
  if constexpr (C::kCbSmem) {
    if (!books_ready) DecodeCta<T, D, MK, MV>::wait_books(books_bar);
  }
}

// Every KV head's codebook image: K entry (s, code) at code * kRow + 4 k_word(s), V entry
// at kVBase + code * kRow + 4 v_word(s). A block per KV head; run once per layer.
template <typename T, int D, int MK, int MV>
__global__ void books_kernel(uint8_t* out, const T* k_cb, const T* v_cb) {
  using C = DecodeCfg<T, D, MK, MV>;
  uint8_t* img = out + (int64_t)blockIdx.x * C::kImgBytes;
  for (int u = threadIdx.x; u < (MK + MV) * kCentroids; u += blockDim.x) {
    const bool is_v = u >= MK * kCentroids;
    const int uu = is_v ? u - MK * kCentroids : u, s = uu / kCentroids, code = uu % kCentroids;
    const int ds = is_v ? C::DSV : C::DSK;
    const T* src = (is_v ? v_cb : k_cb) + ((int64_t)blockIdx.x * (is_v ? MV : MK) * kCentroids + uu) * ds;
    T* dst = reinterpret_cast<T*>(img + (is_v ? C::kVBase : 0) + code * C::kRow +
                                  4 * (is_v ? v_word<C>(s) : k_word<C>(s)));
    for (int i = 0; i < ds; ++i) dst[i] = src[i];
  }
}

template <typename T, int D, int MK, int MV>
cudaError_t launch_books(uint8_t* out, const void* k_cb, const void* v_cb, int kv_heads, cudaStream_t stream) {
  if constexpr (DecodeCfg<T, D, MK, MV>::kCbSmem) {
    books_kernel<T, D, MK, MV><<<kv_heads, 256, 0, stream>>>(out, static_cast<const T*>(k_cb),
                                                              static_cast<const T*>(v_cb));
    return cudaGetLastError();
  } else {
    return cudaSuccess;  // head_dim 256: no image
  }
}

template <typename T, int D, int MK, int MV, bool LUT>
cudaError_t launch_kernel(const DecodeArgs& a, cudaStream_t stream) {
  using C = DecodeCfg<T, D, MK, MV>;
  // Set per call, not cached per process: the attribute belongs to the current device.
  int dev = 0, reserved = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
  if (err != cudaSuccess) return err;
  const int smem = C::smem_bytes(reserved);
  err = cudaFuncSetAttribute(decode_kernel<T, D, MK, MV, LUT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             smem);
  if (err != cudaSuccess) return err;
  const int group = a.num_heads / a.num_kv_heads;
  const int items = a.num_reqs * a.num_splits;
  dim3 grid(a.num_ctas > 0 ? min(a.num_ctas, items) : items, a.num_kv_heads * ceil_div(group, kHeadsPerCta));
  decode_kernel<T, D, MK, MV, LUT><<<grid, C::kThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

// a.lut asks for lookup-table scores; they exist for one query head per KV head with the
// codebooks in shared memory, else the MMA path runs. Attention sinks take the MMA path (a
// model with sinks and one query head per KV head gives up the tables' 7% at most, and the
// LUT kernel carries no sink code).
template <typename T, int D, int MK, int MV>
cudaError_t launch_decode(const DecodeArgs& a, cudaStream_t stream) {
  if constexpr (DecodeCfg<T, D, MK, MV>::kCbSmem) {
    if (a.lut && a.sinks == nullptr && a.num_heads == a.num_kv_heads) return launch_kernel<T, D, MK, MV, true>(a, stream);
  }
  return launch_kernel<T, D, MK, MV, false>(a, stream);
}

}  // namespace pq
