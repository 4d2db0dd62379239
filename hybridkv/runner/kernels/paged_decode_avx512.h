// The AVX-512 split task of paged_decode.cpp, included there after the generic helpers (to_float).
#pragma once

#if defined(__AVX512F__)
#include "../../models/kernels/simd.h"

// AVX-512 path (head size a multiple of 16): per KV head and block of up to 4 of its query heads, the split's
// scores are computed into a buffer (two keys at a time for independent FMA chains), soft-maxed in one pass,
// then values are accumulated in registers over tiles of 64 lanes. Same split and merge as the generic path.

constexpr int64_t kHeadBlock = 4;  // query heads of one KV head handled together (register budget)
constexpr int64_t kTile = 4;       // 16-lane vectors of the output per value pass
constexpr int64_t kAhead = 16;     // keys prefetched ahead: one head's slice of each key sits on its own page

// One head's slice of a key (or value): `bytes` from p, a cache line at a time.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// Softmax of s[0, n) in place: returns (max, sum of e^(s - max)), tail lanes masked.
inline std::pair<float, float> softmax_inplace(float* s, int64_t n) {
  __m512 vm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    vm = _mm512_mask_max_ps(vm, k, vm, _mm512_maskz_loadu_ps(k, s + t));
  }
  const float mx = _mm512_reduce_max_ps(vm);
  __m512 vs = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 k = n - t >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), _mm512_set1_ps(mx)));
    vs = _mm512_mask_add_ps(vs, k, vs, e);
    _mm512_mask_storeu_ps(s + t, k, e);
  }
  return {mx, _mm512_reduce_add_ps(vs)};
}

#if defined(__AVX512BF16__)
// Scores of keys [0, n) (rows[t] + off) for gb query heads at qh (unscaled bfloat16, d a multiple of 32) by
// bfloat16 pair dot products (vdpbf16ps: products exact, sums in float32), two keys at a time; scaled after.
inline void scores_bf16(const c10::BFloat16* qh, const c10::BFloat16* const* rows, int64_t off, int64_t n,
                        int64_t gb, int64_t d, float scale, float* scores) {
  const int64_t vecs = d / 32, slice = d * 2;
  for (int64_t u = 0; u < std::min(kAhead, n); ++u) prefetch(rows[u] + off, slice);
  auto load = [](const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t t = 0;
  for (; t + 2 <= n; t += 2) {
    if (t + kAhead < n) prefetch(rows[t + kAhead] + off, slice);
    if (t + kAhead + 1 < n) prefetch(rows[t + kAhead + 1] + off, slice);
    const c10::BFloat16* k0 = rows[t] + off;
    const c10::BFloat16* k1 = rows[t + 1] + off;
    __m512 a0[kHeadBlock], a1[kHeadBlock];
    for (int64_t g = 0; g < kHeadBlock; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < vecs; ++c) {
      const __m512bh x0 = load(k0 + c * 32), x1 = load(k1 + c * 32);
      for (int64_t g = 0; g < gb; ++g) {
        const __m512bh qv = load(qh + g * d + c * 32);
        a0[g] = _mm512_dpbf16_ps(a0[g], qv, x0);
        a1[g] = _mm512_dpbf16_ps(a1[g], qv, x1);
      }
    }
    for (int64_t g = 0; g < gb; ++g) {
      scores[g * n + t] = _mm512_reduce_add_ps(a0[g]) * scale;
      scores[g * n + t + 1] = _mm512_reduce_add_ps(a1[g]) * scale;
    }
  }
  for (; t < n; ++t)
    for (int64_t g = 0; g < gb; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < vecs; ++c) a = _mm512_dpbf16_ps(a, load(qh + g * d + c * 32), load(rows[t] + off + c * 32));
      scores[g * n + t] = _mm512_reduce_add_ps(a) * scale;
    }
}
#endif

template <typename T>
void split_task_avx512(const T* q, const T* cache, const int64_t* table, int64_t base, int64_t t0, int64_t t1,
                       float* acc, float* m, float* l, int64_t hq, int64_t groups, int64_t d, int64_t bs,
                       int64_t s_block, int64_t s_tok, int64_t s_kv, int64_t s_head, float scale) {
  const int64_t hk = hq / groups, n = t1 - t0, vecs = d / 16;
  std::vector<float> qf(hq * d), scores(kHeadBlock * n);
  to_float(q, qf.data(), hq * d);
  for (int64_t i = 0; i < hq * d; ++i) qf[i] *= scale;
  std::vector<const T*> rows(n);  // rows[t]: key t0 + t's slot (keys of all KV heads; values at + s_kv)
  for (int64_t t = 0; t < n; ++t) {
    const int64_t local = t0 + t - base;
    rows[t] = cache + table[local / bs] * s_block + (local % bs) * s_tok;
  }
  for (int64_t h = 0; h < hk; ++h) {
    for (int64_t g0 = 0; g0 < groups; g0 += kHeadBlock) {
      const int64_t gb = std::min(kHeadBlock, groups - g0), head0 = h * groups + g0;
      const float* qh = qf.data() + head0 * d;
      // scores[g * n + t] = q_(head0 + g) . k_t
      bool scored = false;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (d % 32 == 0) {
          scores_bf16(q + head0 * d, rows.data(), h * s_head, n, gb, d, scale, scores.data());
          scored = true;
        }
      }
#endif
      if (!scored) {
        int64_t t = 0;
        const int64_t slice = d * static_cast<int64_t>(sizeof(T));
        for (int64_t u = 0; u < std::min(kAhead, n); ++u) prefetch(rows[u] + h * s_head, slice);
        for (; t + 2 <= n; t += 2) {
          if (t + kAhead < n) prefetch(rows[t + kAhead] + h * s_head, slice);
          if (t + kAhead + 1 < n) prefetch(rows[t + kAhead + 1] + h * s_head, slice);
          const T* k0 = rows[t] + h * s_head;
          const T* k1 = rows[t + 1] + h * s_head;
          __m512 a0[kHeadBlock], a1[kHeadBlock];
          for (int64_t g = 0; g < kHeadBlock; ++g) a0[g] = a1[g] = _mm512_setzero_ps();
          for (int64_t c = 0; c < vecs; ++c) {
            const __m512 x0 = load16(k0 + c * 16), x1 = load16(k1 + c * 16);
            for (int64_t g = 0; g < gb; ++g) {
              const __m512 qv = _mm512_loadu_ps(qh + g * d + c * 16);
              a0[g] = _mm512_fmadd_ps(qv, x0, a0[g]);
              a1[g] = _mm512_fmadd_ps(qv, x1, a1[g]);
            }
          }
          for (int64_t g = 0; g < gb; ++g) {
            scores[g * n + t] = _mm512_reduce_add_ps(a0[g]);
            scores[g * n + t + 1] = _mm512_reduce_add_ps(a1[g]);
          }
        }
        for (; t < n; ++t) {
          const T* k0 = rows[t] + h * s_head;
          for (int64_t g = 0; g < gb; ++g) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t c = 0; c < vecs; ++c)
              a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + g * d + c * 16), load16(k0 + c * 16), a);
            scores[g * n + t] = _mm512_reduce_add_ps(a);
          }
        }
      }
      for (int64_t g = 0; g < gb; ++g) std::tie(m[head0 + g], l[head0 + g]) = softmax_inplace(&scores[g * n], n);
      // acc[head0 + g] = sum_t p[g][t] v_t, over output tiles of kTile vectors
      for (int64_t c0 = 0; c0 < vecs; c0 += kTile) {
        const int64_t tv = std::min(kTile, vecs - c0);
        __m512 o[kHeadBlock][kTile];
        for (int64_t g = 0; g < kHeadBlock; ++g)
          for (int64_t c = 0; c < kTile; ++c) o[g][c] = _mm512_setzero_ps();
        const int64_t part = tv * 16 * static_cast<int64_t>(sizeof(T));
        for (int64_t u = 0; u < std::min(kAhead, n); ++u) prefetch(rows[u] + s_kv + h * s_head + c0 * 16, part);
        for (int64_t u = 0; u < n; ++u) {
          if (u + kAhead < n) prefetch(rows[u + kAhead] + s_kv + h * s_head + c0 * 16, part);
          const T* v = rows[u] + s_kv + h * s_head + c0 * 16;
          __m512 x[kTile];
          for (int64_t c = 0; c < tv; ++c) x[c] = load16(v + c * 16);
          for (int64_t g = 0; g < gb; ++g) {
            const __m512 p = _mm512_set1_ps(scores[g * n + u]);
            for (int64_t c = 0; c < tv; ++c) o[g][c] = _mm512_fmadd_ps(p, x[c], o[g][c]);
          }
        }
        for (int64_t g = 0; g < gb; ++g)
          for (int64_t c = 0; c < tv; ++c) _mm512_storeu_ps(acc + (head0 + g) * d + (c0 + c) * 16, o[g][c]);
      }
    }
  }
}
#endif
