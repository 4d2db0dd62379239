// The AVX-512 split task of paged_decode.cpp, included there after the generic helpers (to_float).
#pragma once

#if defined(__AVX512F__)
#include "../../models/kernels/simd.h"

// AVX-512 path (head size a multiple of 16), token-major: a split's keys are taken kRows slots at a time (at
// absolute multiples of kRows), each chunk's rows -- every KV head's key and value of a slot, one contiguous run
// each, a cache block's worth (64 KiB for Qwen3-0.6B) -- come from memory once, and all heads work on them from
// cache. Per query head a chunk gives one vector of kRows scores, folded into the split's running max, sum and
// output (online softmax). Before, each KV head walked the whole split on its own, a slice of every row each time
// (24 passes over 2 MiB per 512 keys for Qwen3-0.6B). One thread, 4k keys, 28 layers (AMD EPYC): 11.4 -> 18 GB/s
// from memory, 31 GB/s from cache (the arithmetic: 512-bit FMAs and bf16 widening, ~490 cycles a key for 16
// heads). Prefetching the next chunk by hand, all at once or spread over the heads, measured no faster than the
// hardware's prefetch, so there is none.
//
//   row of slot t:  [ K: head 0 | head 1 | ... | head Hk-1 ] ... s_kv ... [ V: head 0 | ... | head Hk-1 ]
//   chunk:          kRows such rows (one cache block when the block size is kRows)
//
// A request's result still depends on its own keys only (chunks and splits sit at absolute positions).

constexpr int64_t kRows = 16;    // slots per chunk: one 16-lane score vector per query head
constexpr int64_t kQBlock = 2;   // query heads whose outputs accumulate together in the value pass
constexpr int64_t kVTile = 8;    // 16-lane output vectors per value pass (d = 128: the whole head)

// Lane t of the result = the sum of the 16 lanes of a[t], t < 16: a transpose-and-add tree (45 operations for
// 16 sums, where 16 horizontal reductions take ~130).
inline __m512 sum_lanes16(const __m512* a) {
  __m512 y[4];
  for (int64_t i = 0; i < 4; ++i) {
    const __m512* b = a + 4 * i;
    const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
    const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
    // per 128-bit lane: [b0, b1, b2, b3] partial sums over that lane's 4 values
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x01), _mm512_castps_pd(x23))));
  }
  // 128-bit lane j of the result = the sum of y[j]'s four 128-bit lanes
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

// Scores of one query head against rows[0, kRows) + off, lane t for row t (rows past the chunk's end repeat a
// valid one; the caller masks their lanes): products summed in float32, bfloat16 pairs by vdpbf16ps where the
// CPU has it (q unscaled, scaled after), else float32 FMAs (q scaled before). The slot loop is innermost and
// unrolled: kRows independent sums, where one slot at a time would wait on each FMA's latency.
template <typename T>
inline __m512 chunk_scores(const T* q_raw, const float* q_scaled, const T* const* rows, int64_t off, int64_t d,
                           float scale) {
  __m512 a[kRows];
#pragma GCC unroll 16
  for (int64_t t = 0; t < kRows; ++t) a[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (d % 32 == 0) {
      for (int64_t c = 0; c < d; c += 32) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(q_raw + c);
#pragma GCC unroll 16
        for (int64_t t = 0; t < kRows; ++t)
          a[t] = _mm512_dpbf16_ps(a[t], qv, (__m512bh)_mm512_loadu_si512(rows[t] + off + c));
      }
      return _mm512_mul_ps(sum_lanes16(a), _mm512_set1_ps(scale));
    }
  }
#endif
  for (int64_t c = 0; c < d; c += 16) {
    const __m512 qv = _mm512_loadu_ps(q_scaled + c);
#pragma GCC unroll 16
    for (int64_t t = 0; t < kRows; ++t) a[t] = _mm512_fmadd_ps(qv, load16(rows[t] + off + c), a[t]);
  }
  return sum_lanes16(a);
}

// acc[j] = acc[j] * corr[j] + sum_t p[j][t] v_t over QB query heads and TV 16-lane vectors of one KV head's
// values (v_t = rows[t] + off), the tile in registers for the whole chunk.
template <int QB, int TV, typename T>
inline void chunk_values(float* acc, int64_t d, const float* corr, const float* p, const T* const* rows,
                         int64_t off, int64_t n) {
  __m512 o[QB][TV];
#pragma GCC unroll 8
  for (int j = 0; j < QB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < TV; ++c) o[j][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * d + c * 16), _mm512_set1_ps(corr[j]));
  for (int64_t t = 0; t < n; ++t) {
    __m512 x[TV];
#pragma GCC unroll 8
    for (int c = 0; c < TV; ++c) x[c] = load16(rows[t] + off + c * 16);
#pragma GCC unroll 8
    for (int j = 0; j < QB; ++j) {
      const __m512 pt = _mm512_set1_ps(p[j * kRows + t]);
#pragma GCC unroll 8
      for (int c = 0; c < TV; ++c) o[j][c] = _mm512_fmadd_ps(pt, x[c], o[j][c]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < QB; ++j)
#pragma GCC unroll 8
    for (int c = 0; c < TV; ++c) _mm512_storeu_ps(acc + j * d + c * 16, o[j][c]);
}

template <int QB, typename T>
inline void chunk_values_tiled(float* acc, int64_t d, const float* corr, const float* p, const T* const* rows,
                               int64_t off, int64_t n) {
  for (int64_t v0 = 0; v0 < d; v0 += kVTile * 16) {
    float* a = acc + v0;
    const int64_t o = off + v0;
    switch (std::min<int64_t>(kVTile, (d - v0) / 16)) {
      case 8: chunk_values<QB, 8>(a, d, corr, p, rows, o, n); break;
      case 7: chunk_values<QB, 7>(a, d, corr, p, rows, o, n); break;
      case 6: chunk_values<QB, 6>(a, d, corr, p, rows, o, n); break;
      case 5: chunk_values<QB, 5>(a, d, corr, p, rows, o, n); break;
      case 4: chunk_values<QB, 4>(a, d, corr, p, rows, o, n); break;
      case 3: chunk_values<QB, 3>(a, d, corr, p, rows, o, n); break;
      case 2: chunk_values<QB, 2>(a, d, corr, p, rows, o, n); break;
      default: chunk_values<QB, 1>(a, d, corr, p, rows, o, n); break;
    }
  }
}

template <typename T>
void split_task_avx512(const T* q, const T* cache, const int64_t* table, int64_t base, int64_t t0, int64_t t1,
                       float* acc, float* m, float* l, int64_t hq, int64_t groups, int64_t d, int64_t bs,
                       int64_t s_block, int64_t s_tok, int64_t s_kv, int64_t s_head, float scale) {
  std::vector<float> qf(hq * d), p(hq * kRows), corr(hq);
  to_float(q, qf.data(), hq * d);
  for (int64_t i = 0; i < hq * d; ++i) qf[i] *= scale;
  std::fill(acc, acc + hq * d, 0.f);
  std::fill(m, m + hq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + hq, 0.f);
  const T* r[kRows];  // the chunk's slots; past its end, repeats of the first (read, scored, masked out)
  for (int64_t c0 = t0, c1 = 0; c0 < t1; c0 = c1) {
    c1 = std::min(t1, (c0 / kRows + 1) * kRows);
    const int64_t n = c1 - c0;
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1);
    for (int64_t t = 0; t < kRows; ++t) {
      const int64_t local = (t < n ? c0 + t : c0) - base;
      r[t] = cache + table[local / bs] * s_block + (local % bs) * s_tok;
    }
    // Scores, then the online softmax step: p = e^(s - m_new), acc *= e^(m_old - m_new) below.
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kv = h / groups;
      __m512 s = chunk_scores(q + h * d, qf.data() + h * d, r, kv * s_head, d, scale);
      s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), s);
      const float mx = std::max(m[h], _mm512_reduce_max_ps(s));
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
      _mm512_storeu_ps(p.data() + h * kRows, e);
      corr[h] = std::exp(m[h] - mx);  // 0 on the first chunk (m = -inf)
      l[h] = l[h] * corr[h] + _mm512_reduce_add_ps(e);
      m[h] = mx;
    }
    // Values: acc[h] = acc[h] * corr[h] + sum_t p[h][t] v_t, kQBlock query heads of one KV head at a time.
    for (int64_t h0 = 0, qb = 0; h0 < hq; h0 += qb) {
      qb = std::min(kQBlock, groups - h0 % groups);  // never across two KV heads
      const int64_t off = s_kv + (h0 / groups) * s_head;
      if (qb == 2)
        chunk_values_tiled<2>(acc + h0 * d, d, corr.data() + h0, p.data() + h0 * kRows, r, off, n);
      else
        chunk_values_tiled<1>(acc + h0 * d, d, corr.data() + h0, p.data() + h0 * kRows, r, off, n);
    }
  }
}
#endif
