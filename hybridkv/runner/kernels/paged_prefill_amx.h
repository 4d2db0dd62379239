// The AMX tile path of paged_prefill.cpp, included there after PackedHead and softmax_row (amx.h before them).
// Both products of a key block run on the tile unit (TDPBF16PS, 16 x 16 x 32 per instruction); the softmax
// between them is the vector path's own (softmax_row), so only how the dot products are summed differs:
//
//   scores  S[16 rows][64 keys] += Q[16][32 dims] . K-tile[16 dim pairs][16 keys][2]   (d / 32 steps, 4 tiles)
//   output  O[16 rows][16 dims] = O * corr + P[16][32 keys] . V-tile[16 key pairs][16 dims][2]   (2 steps)
//
// The tile unit sums a pair's two products and the accumulator in its own way (not VDPBF16PS's two rounded
// adds), so this path's bits differ from the vector path's; each output element still depends only on its
// own row, its own column and its accumulator, so a query's bits depend on its own query and keys, as there.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr int64_t kTileRows16 = 16;  // query rows per tile

// All eight tiles 16 rows x 64 bytes: 0-3 accumulators, 4-7 operands.
inline void configure_prefill_tiles() { configure_tiles({16, 16, 16, 16, 16, 16, 16, 16}); }

inline void zero_accumulators() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The stored scores s of rows [0, rb) against key block kb -> their weights p16 (rows [rb, rows) zero), each
// row's running output o [rows][d] scaled by its correction, and its running max m and sum l.
inline void softmax_rows(const float (*s)[kKeys], uint16_t (*p16)[kKeys], int64_t rb, int64_t rows, int64_t kb,
                         const int64_t* pos, const int64_t* lo, float scale, int64_t d, float* o, float* m, float* l) {
  for (int64_t r = 0; r < rb; ++r) {
    __m512 sr[4];
    for (int64_t c = 0; c < 4; ++c) sr[c] = _mm512_load_ps(s[r] + c * 16);
    float corr;
    softmax_row(sr, kb, lo[r], pos[r], scale, p16[r], corr, m[r], l[r]);
    for (int64_t k = 0; corr != 1.f && k < d; k += 16)  // o * 1 is o
      _mm512_storeu_ps(o + r * d + k, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + k), _mm512_set1_ps(corr)));
  }
  std::memset(p16[rb], 0, (rows - rb) * sizeof(p16[0]));
}

// Rows [0, rb) of a 16-row group against key block `blk` (absolute index kb): q [16][d] bfloat16 (rows past rb
// zero), o [16][d] float32, m / l [rb]: running output (unnormalised), max and sum.
inline void block_tiles(const uint16_t* q, const int64_t* pos, const int64_t* lo, int64_t rb, const PackedHead& ph,
                        int64_t blk, int64_t kb, int64_t d, float scale, float* o, float* m, float* l) {
  const uint32_t* kp = ph.k32.data() + blk * kKeys * d / 2;  // [d / 2][kKeys]
  const uint16_t* vp = ph.v16.data() + blk * kKeys * d;      // [kKeys / 2][d][2]
  alignas(64) float s[kTileRows16][kKeys];
  alignas(64) uint16_t p16[kTileRows16][kKeys];
  zero_accumulators();
  for (int64_t i0 = 0; i0 < d / 2; i0 += 16) {
    _tile_loadd(4, q + 2 * i0, d * 2);
    _tile_loadd(5, kp + i0 * kKeys, kKeys * 4);
    _tile_loadd(6, kp + i0 * kKeys + 16, kKeys * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(7, kp + i0 * kKeys + 32, kKeys * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, kp + i0 * kKeys + 48, kKeys * 4);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, s[0], kKeys * 4);
  _tile_stored(1, s[0] + 16, kKeys * 4);
  _tile_stored(2, s[0] + 32, kKeys * 4);
  _tile_stored(3, s[0] + 48, kKeys * 4);
  softmax_rows(s, p16, rb, kTileRows16, kb, pos, lo, scale, d, o, m, l);
  _tile_loadd(4, p16[0], kKeys * 2);       // keys [0, 32)
  _tile_loadd(5, p16[0] + 32, kKeys * 2);  // keys [32, 64)
  for (int64_t c = 0; c < d / 16; c += 2) {  // d is a multiple of 32
    _tile_loadd(0, o + c * 16, d * 4);
    _tile_loadd(1, o + c * 16 + 16, d * 4);
    _tile_loadd(6, vp + c * 16 * 2, d * 4);
    _tile_loadd(7, vp + (c * 16 + 16) * 2, d * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, vp + (16 * d + c * 16) * 2, d * 4);
    _tile_loadd(7, vp + (16 * d + c * 16 + 16) * 2, d * 4);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_stored(0, o + c * 16, d * 4);
    _tile_stored(1, o + c * 16 + 16, d * 4);
  }
}

// As block_tiles for two 16-row groups at once (rows [0, rb), 16 < rb <= 32; q and o hold 32 rows): each key
// and value tile is loaded once for both groups (2 x 2 blocking), which halves the traffic from L2, where a
// head's packed keys and values live. Every element sees the same tile operations in the same order as in
// block_tiles, so the bits are the same.
inline void block_tiles2(const uint16_t* q, const int64_t* pos, const int64_t* lo, int64_t rb, const PackedHead& ph,
                         int64_t blk, int64_t kb, int64_t d, float scale, float* o, float* m, float* l) {
  const uint32_t* kp = ph.k32.data() + blk * kKeys * d / 2;  // [d / 2][kKeys]
  const uint16_t* vp = ph.v16.data() + blk * kKeys * d;      // [kKeys / 2][d][2]
  const uint16_t* q1 = q + 16 * d;
  alignas(64) float s[2 * kTileRows16][kKeys];
  alignas(64) uint16_t p16[2 * kTileRows16][kKeys];
  for (int64_t half = 0; half < 2; ++half) {  // keys [32 * half, 32 * half + 32)
    zero_accumulators();
    for (int64_t i0 = 0; i0 < d / 2; i0 += 16) {
      _tile_loadd(4, q + 2 * i0, d * 2);
      _tile_loadd(6, kp + i0 * kKeys + 32 * half, kKeys * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, kp + i0 * kKeys + 32 * half + 16, kKeys * 4);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, q1 + 2 * i0, d * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, s[0] + 32 * half, kKeys * 4);
    _tile_stored(1, s[0] + 32 * half + 16, kKeys * 4);
    _tile_stored(2, s[16] + 32 * half, kKeys * 4);
    _tile_stored(3, s[16] + 32 * half + 16, kKeys * 4);
  }
  softmax_rows(s, p16, rb, 2 * kTileRows16, kb, pos, lo, scale, d, o, m, l);
  float* o1 = o + 16 * d;
  for (int64_t c = 0; c < d / 16; c += 2) {  // output columns [16 c, 16 c + 32)
    _tile_loadd(0, o + c * 16, d * 4);
    _tile_loadd(1, o + c * 16 + 16, d * 4);
    _tile_loadd(2, o1 + c * 16, d * 4);
    _tile_loadd(3, o1 + c * 16 + 16, d * 4);
    for (int64_t half = 0; half < 2; ++half) {
      const uint16_t* vh = vp + (16 * half * d + c * 16) * 2;
      _tile_loadd(4, p16[0] + 32 * half, kKeys * 2);
      _tile_loadd(6, vh, d * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, vh + 32, d * 4);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, p16[16] + 32 * half, kKeys * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o + c * 16, d * 4);
    _tile_stored(1, o + c * 16 + 16, d * 4);
    _tile_stored(2, o1 + c * 16, d * 4);
    _tile_stored(3, o1 + c * 16 + 16, d * 4);
  }
}

// One task's rows [0, rows) against its key blocks [lo[0] / kKeys, pos[rows - 1] / kKeys], 32 rows a pass:
// q [rows rounded up to 16][d] contiguous, rows past `rows` zero; kb0 is the first block `ph` holds.
inline void run_tiles(const uint16_t* q, const int64_t* pos, const int64_t* lo, int64_t rows, const PackedHead& ph,
                      int64_t kb0, int64_t d, float scale, float* o, float* m, float* l) {
  for (int64_t kb = lo[0] / kKeys; kb <= pos[rows - 1] / kKeys; ++kb)
    for (int64_t i0 = 0; i0 < rows; i0 += 32) {
      const auto tiles_fn = rows - i0 > 16 ? block_tiles2 : block_tiles;
      tiles_fn(q + i0 * d, pos + i0, lo + i0, std::min<int64_t>(32, rows - i0), ph, kb - kb0, kb, d, scale,
               o + i0 * d, m + i0, l + i0);
    }
}

#else  // paged_prefill refuses `tiles` before any of these is reached

inline void configure_prefill_tiles() {}
inline void run_tiles(const uint16_t*, const int64_t*, const int64_t*, int64_t, const PackedHead&, int64_t, int64_t,
                      float, float*, float*, float*) {}

#endif
