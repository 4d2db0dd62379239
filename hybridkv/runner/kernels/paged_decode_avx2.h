// The AVX2 split task of paged_decode.cpp (CPUs without AVX-512: AMD Zen 2/3, older Xeons), included there after
// the generic helpers. The same token-major walk as paged_decode_avx512.h, on 8-lane vectors: a split's keys
// are taken kRows8 slots at a time (at absolute multiples of kRows8), each slot's row -- every KV head's key,
// then every value -- read from memory once, and all query heads work on the chunk from cache.
//
//   row of slot t:  [ K: head 0 | head 1 | ... | head Hk-1 ] ... s_kv ... [ V: head 0 | ... | head Hk-1 ]
//
// A request's result depends on its own keys only (chunks and splits sit at absolute positions).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <type_traits>

#include "../../models/kernels/simd_avx2.h"

constexpr int64_t kRows8 = 8;    // slots per chunk: one 8-lane score vector per query head
constexpr int64_t kVTile8 = 4;   // 8-lane output vectors per value pass: 2 heads x 4 accumulators + 4 loads

// Scores of one query head (q scaled) against rows[0, kRows8) + off, lane t for row t; rows past the chunk's
// end repeat a valid one and the caller masks their lanes. The slot loop is innermost: 8 independent sums.
template <typename T>
inline __m256 chunk_scores8(const float* q, const T* const* rows, int64_t off, int64_t d) {
  __m256 a[kRows8];
#pragma GCC unroll 8
  for (int64_t t = 0; t < kRows8; ++t) a[t] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int64_t t = 0; t < kRows8; ++t) a[t] = _mm256_fmadd_ps(qv, load8(rows[t] + off + c), a[t]);
  }
  return sum_lanes8(a);
}

// `chunk_scores8` for two query heads of one KV head at once, each key vector widened once for both: rows
// [0, 4) then [4, 8), 8 accumulators a pass. Each score is summed as `chunk_scores8` sums it (the same lane
// sums over c, the same `sum_lanes8` tree), so the bits are the same. out[0], out[1]: the two heads' scores.
template <typename T>
inline void chunk_scores8_two(const float* q0, const float* q1, const T* const* rows, int64_t off, int64_t d,
                              __m256* out) {
  __m256 half[2];
  for (int64_t t0 = 0; t0 < kRows8; t0 += 4) {
    __m256 a[8];  // a[t] head 0, a[4 + t] head 1, row t0 + t
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) a[t] = _mm256_setzero_ps();
    for (int64_t c = 0; c < d; c += 8) {
      const __m256 qa = _mm256_loadu_ps(q0 + c), qb = _mm256_loadu_ps(q1 + c);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m256 k = load8(rows[t0 + t] + off + c);
        a[t] = _mm256_fmadd_ps(qa, k, a[t]);
        a[4 + t] = _mm256_fmadd_ps(qb, k, a[4 + t]);
      }
    }
    half[t0 / 4] = sum_lanes8(a);  // lanes: head 0 rows t0 .. t0 + 3, then head 1's
  }
  out[0] = _mm256_permute2f128_ps(half[0], half[1], 0x20);
  out[1] = _mm256_permute2f128_ps(half[0], half[1], 0x31);
}

// acc[j] = acc[j] * corr[j] + sum_t p[j][t] v_t over QB query heads and TV 8-lane vectors of one KV head's
// values (v_t = rows[t] + off).
template <int QB, int TV, typename T>
inline void chunk_values8(float* acc, int64_t d, const float* corr, const float* p, const T* const* rows,
                          int64_t off, int64_t n) {
  __m256 o[QB][TV];
#pragma GCC unroll 4
  for (int j = 0; j < QB; ++j)
#pragma GCC unroll 4
    for (int c = 0; c < TV; ++c) o[j][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + j * d + c * 8), _mm256_set1_ps(corr[j]));
  for (int64_t t = 0; t < n; ++t) {
    __m256 x[TV];
#pragma GCC unroll 4
    for (int c = 0; c < TV; ++c) x[c] = load8(rows[t] + off + c * 8);
#pragma GCC unroll 4
    for (int j = 0; j < QB; ++j) {
      const __m256 pt = _mm256_set1_ps(p[j * kRows8 + t]);
#pragma GCC unroll 4
      for (int c = 0; c < TV; ++c) o[j][c] = _mm256_fmadd_ps(pt, x[c], o[j][c]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < QB; ++j)
#pragma GCC unroll 4
    for (int c = 0; c < TV; ++c) _mm256_storeu_ps(acc + j * d + c * 8, o[j][c]);
}

template <int QB, typename T>
inline void chunk_values8_tiled(float* acc, int64_t d, const float* corr, const float* p, const T* const* rows,
                                int64_t off, int64_t n) {
  for (int64_t v0 = 0; v0 < d; v0 += kVTile8 * 8) {
    float* a = acc + v0;
    const int64_t o = off + v0;
    switch (std::min<int64_t>(kVTile8, (d - v0) / 8)) {
      case 4: chunk_values8<QB, 4>(a, d, corr, p, rows, o, n); break;
      case 3: chunk_values8<QB, 3>(a, d, corr, p, rows, o, n); break;
      case 2: chunk_values8<QB, 2>(a, d, corr, p, rows, o, n); break;
      default: chunk_values8<QB, 1>(a, d, corr, p, rows, o, n); break;
    }
  }
}

template <typename T>
void split_task_avx2(const T* q, const T* cache, const int64_t* table, int64_t base, int64_t t0, int64_t t1,
                     float* acc, float* m, float* l, int64_t hq, int64_t groups, int64_t d, int64_t bs,
                     int64_t s_block, int64_t s_tok, int64_t s_kv, int64_t s_head, float scale) {
  std::vector<float> qf(hq * d), p(hq * kRows8), corr(hq);
  to_float(q, qf.data(), hq * d);
  for (int64_t i = 0; i < hq * d; ++i) qf[i] *= scale;
  std::fill(acc, acc + hq * d, 0.f);
  std::fill(m, m + hq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + hq, 0.f);
  const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const T* r[kRows8];  // the chunk's slots; past its end, repeats of the first (read, scored, masked out)
  for (int64_t c0 = t0, c1 = 0; c0 < t1; c0 = c1) {
    c1 = std::min(t1, (c0 / kRows8 + 1) * kRows8);
    const int64_t n = c1 - c0;
    const __m256 valid = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
    for (int64_t t = 0; t < kRows8; ++t) {
      const int64_t local = (t < n ? c0 + t : c0) - base;
      r[t] = cache + table[local / bs] * s_block + (local % bs) * s_tok;
    }
    // Scores, then the online softmax step: p = e^(s - m_new), acc *= e^(m_old - m_new) below. 16-bit keys are
    // scored for the heads of a group in pairs (0, 1), (2, 3), ..., an odd group's last head alone; float32 keys
    // need no widening to share and measured slower paired (0.84-0.97x), so each of their heads goes alone.
    __m256 two[2];
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t off = (h / groups) * s_head, i = h % groups;
      const bool paired = !std::is_same_v<T, float> && (i % 2 == 1 || i + 1 < groups);
      if (paired && i % 2 == 0) chunk_scores8_two(qf.data() + h * d, qf.data() + (h + 1) * d, r, off, d, two);
      const __m256 dots = paired ? two[i % 2] : chunk_scores8(qf.data() + h * d, r, off, d);
      const __m256 s = _mm256_blendv_ps(minus_inf, dots, valid);
      const float mx = std::max(m[h], reduce_max8(s));
      const __m256 e = _mm256_and_ps(valid, exp8(_mm256_sub_ps(s, _mm256_set1_ps(mx))));
      _mm256_storeu_ps(p.data() + h * kRows8, e);
      corr[h] = std::exp(m[h] - mx);  // 0 on the first chunk (m = -inf)
      l[h] = l[h] * corr[h] + reduce_add8(e);
      m[h] = mx;
    }
    // Values: two query heads of one KV head at a time.
    for (int64_t h0 = 0, qb = 0; h0 < hq; h0 += qb) {
      qb = std::min<int64_t>(2, groups - h0 % groups);  // never across two KV heads
      const int64_t off = s_kv + (h0 / groups) * s_head;
      if (qb == 2)
        chunk_values8_tiled<2>(acc + h0 * d, d, corr.data() + h0, p.data() + h0 * kRows8, r, off, n);
      else
        chunk_values8_tiled<1>(acc + h0 * d, d, corr.data() + h0, p.data() + h0 * kRows8, r, off, n);
    }
  }
}
#endif
