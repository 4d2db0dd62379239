// Rows of a recurrent state between the pool and a float32 working copy (`state_step.cpp`): streamed float32
// rows, int8 rows with one float32 scale (`models/state_store.py`, the same float32 operations, so the same bits).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// A stepped row to the pool. Non-temporal stores where they apply: the row is read again only at the next step,
// after every other state has streamed through the caches, so writing around them saves the write-allocate read
// and keeps the next head's prefetched rows in cache (measured ~20% off a decode step's state time, AMD EPYC).
inline void stream_row(float* __restrict to, const float* __restrict row, int64_t n) {
#if defined(__AVX512F__)
  if (reinterpret_cast<uintptr_t>(to) % 64 == 0 && n % 16 == 0) {
    for (int64_t j = 0; j < n; j += 16) _mm512_stream_ps(to + j, _mm512_loadu_ps(row + j));
    return;
  }
#endif
  std::memcpy(to, row, n * sizeof(float));
}

// Storage of the recurrent state (`runner/states.STORAGE_CODES`): float32, bfloat16, or int8 rows with one
// float32 scale each (`models/state_store.py`: codes at the region's start, scales at `scale_at`).
enum Storage : int64_t { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2 };

// A row of int8 codes -> float32: q * scale (state_store.dequantize_rows).
inline void dequantize_row(const int8_t* codes, float scale, float* out, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale);
  for (; j + 16 <= n; j += 16) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), s));
  }
#endif
  for (; j < n; ++j) out[j] = static_cast<float>(codes[j]) * scale;
}

// A float32 row -> int8 codes and its scale: scale = max|x| / 127, q = round_half_even(x * (127 / max|x|)), all
// zeros where 127 / max|x| is not finite (state_store.quantize_rows, the same float32 operations; the maximum is
// exact in any order; one division per row, not per element).
inline float quantize_row(const float* x, int8_t* codes, int64_t n) {
  float top = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
  top = _mm512_reduce_max_ps(m);
#endif
  for (; j < n; ++j) top = std::max(top, std::fabs(x[j]));
  const float inv = 127.f / top;
  if (!std::isfinite(inv)) {
    std::memset(codes, 0, n);
    return 0.f;
  }
  j = 0;
#if defined(__AVX512F__)
  const __m512 up = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; j + 16 <= n; j += 16) {
    const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(x + j), up);
    __m512 q = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(hi, _mm512_max_ps(lo, q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(q)));
  }
#endif
  for (; j < n; ++j) {
    const float q = std::nearbyint(x[j] * inv);
    codes[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
  }
  return top / 127.f;
}

}  // namespace
