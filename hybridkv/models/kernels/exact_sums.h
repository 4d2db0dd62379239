// The integer sums of exact_rows.cpp: one 32-column weight block against a list of row vectors (rows of x, or of
// its slices), every product and partial sum an integer below 2^53, so FMA or not, any order, any split over K gives
// the same bits.
//
//   w block  [K][32] float32 (its integers exact)  --(kDepth steps at a time)-->  chunk [kDepth][32] float64
//   acc[r][0:32] += sum_k x[r][k] * chunk[k][0:32]     for each listed row r, kDepth steps, then the next chunk
//
// The chunk is converted once and read by every row (16 KiB: it stays in L1), so a register block spends its
// cycles on FMAs rather than on float32 -> float64 conversions, one per weight vector per row pair before.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace exact_sums {

constexpr int64_t kCols = 32;
constexpr int64_t kDepth = 64;  // K steps per converted chunk: 64 * 32 float64 = 16 KiB

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#if defined(__AVX512F__)
using Vec = __m512d;  // 8 float64
inline Vec load(const double* p) { return _mm512_loadu_pd(p); }
inline Vec load(const float* p) { return _mm512_cvtps_pd(_mm256_loadu_ps(p)); }
inline Vec broadcast(const double* p) { return _mm512_set1_pd(*p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_pd(a, b, c); }
inline void store(double* p, Vec v) { _mm512_storeu_pd(p, v); }
#else
using Vec = __m256d;  // 4 float64
inline Vec load(const double* p) { return _mm256_loadu_pd(p); }
inline Vec load(const float* p) { return _mm256_cvtps_pd(_mm_loadu_ps(p)); }
inline Vec broadcast(const double* p) { return _mm256_broadcast_sd(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_pd(a, b, c); }
inline void store(double* p, Vec v) { _mm256_storeu_pd(p, v); }
#endif
constexpr int kLanes = sizeof(Vec) / sizeof(double);
constexpr int kPass = 4 * kLanes;  // columns per pass: 4 vectors (AVX-512: the whole block, AVX2: half of it)
constexpr int kRowsPerBlock = 2;

// Rows x[0], x[P - 1] against columns [c, c + kPass): 4 P accumulators + 4 weight vectors + a broadcast, 13
// registers (AVX2 has 16). The accumulators are named, not an array: GCC kept an array of them on the stack and
// stored it at every step (a store per FMA: a third of the FMA rate on Zen 3).
template <int P, typename W>
void pass_block(const W* w, const double* const* x, int64_t depth, int c, double* const* acc) {
  static_assert(P == 1 || P == 2);
  double* const p0 = acc[0] + c;
  double* const p1 = acc[P - 1] + c;
  Vec a00 = load(p0), a01 = load(p0 + kLanes), a02 = load(p0 + 2 * kLanes), a03 = load(p0 + 3 * kLanes);
  Vec a10 = a00, a11 = a01, a12 = a02, a13 = a03;  // row 1's, loaded below where it exists
  if constexpr (P == 2) {
    a10 = load(p1), a11 = load(p1 + kLanes), a12 = load(p1 + 2 * kLanes), a13 = load(p1 + 3 * kLanes);
  }
  const double* x0 = x[0];
  const double* x1 = x[P - 1];
  for (int64_t k = 0; k < depth; ++k) {
    const W* wk = w + k * kCols + c;
    const Vec w0 = load(wk), w1 = load(wk + kLanes), w2 = load(wk + 2 * kLanes), w3 = load(wk + 3 * kLanes);
    const Vec b0 = broadcast(x0 + k);
    a00 = fma(b0, w0, a00), a01 = fma(b0, w1, a01), a02 = fma(b0, w2, a02), a03 = fma(b0, w3, a03);
    if constexpr (P == 2) {
      const Vec b1 = broadcast(x1 + k);
      a10 = fma(b1, w0, a10), a11 = fma(b1, w1, a11), a12 = fma(b1, w2, a12), a13 = fma(b1, w3, a13);
    }
  }
  store(p0, a00), store(p0 + kLanes, a01), store(p0 + 2 * kLanes, a02), store(p0 + 3 * kLanes, a03);
  if constexpr (P == 2) {
    store(p1, a10), store(p1 + kLanes, a11), store(p1 + 2 * kLanes, a12), store(p1 + 3 * kLanes, a13);
  }
}

template <int P, typename W>
void rows_block(const W* w, const double* const* x, int64_t depth, double* const* acc) {
  for (int c = 0; c < kCols; c += kPass) pass_block<P>(w, x, depth, c, acc);
}
#else
constexpr int kRowsPerBlock = 4;
template <int P, typename W>
void rows_block(const W* chunk, const double* const* x, int64_t depth, double* const* acc) {
  for (int r = 0; r < P; ++r) {
    double a[kCols];
    std::memcpy(a, acc[r], sizeof(a));
    for (int64_t k = 0; k < depth; ++k) {
      const double xr = x[r][k];
      for (int64_t j = 0; j < kCols; ++j) a[j] += xr * static_cast<double>(chunk[k * kCols + j]);
    }
    std::memcpy(acc[r], a, sizeof(a));
  }
}
#endif

// Up to kRowsPerBlock rows through the register block of that many rows; W float (the block as stored) or double
// (a converted chunk).
template <typename W>
void some_rows(int64_t rows, const W* w, const double* const* x, int64_t depth, double* const* acc) {
  static_assert(kRowsPerBlock <= 4, "one case per row count below");
  switch (rows) {
    case 1: return rows_block<1>(w, x, depth, acc);
    case 2: return rows_block<std::min(2, kRowsPerBlock)>(w, x, depth, acc);
    case 3: return rows_block<std::min(3, kRowsPerBlock)>(w, x, depth, acc);
    default: return rows_block<std::min(4, kRowsPerBlock)>(w, x, depth, acc);
  }
}

// acc[r][0:32] = sum_k x[r][k] * w[k][0:32] for r in [0, rows): w one [K][32] float32 block, x[r] and acc[r] row
// pointers (x[r] reads K float64), chunk a [kDepth][32] float64 scratch of the caller's. Rows that fit one register
// block read the float32 block directly: there a conversion per weight vector is all a chunk would save.
inline void block_sums(const float* w, int64_t k_size, const double* const* x, double* const* acc, int64_t rows,
                       double* chunk) {
  for (int64_t r = 0; r < rows; ++r) std::memset(acc[r], 0, kCols * sizeof(double));
  if (rows <= kRowsPerBlock) return some_rows(rows, w, x, k_size, acc);
  const double* at_k[kRowsPerBlock];  // x[r] + k0 for one register block's rows
  for (int64_t k0 = 0; k0 < k_size; k0 += kDepth) {
    const int64_t depth = std::min(kDepth, k_size - k0);
    for (int64_t i = 0; i < depth * kCols; ++i) chunk[i] = static_cast<double>(w[k0 * kCols + i]);
    for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerBlock) {
      const int64_t n = std::min<int64_t>(kRowsPerBlock, rows - r0);
      for (int64_t i = 0; i < n; ++i) at_k[i] = x[r0 + i] + k0;
      some_rows(n, chunk, at_k, depth, acc + r0);
    }
  }
}

}  // namespace exact_sums
