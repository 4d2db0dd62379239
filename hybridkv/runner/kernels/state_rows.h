// Rows of a recurrent state between the pool and a float32 working copy (`state_step.cpp`): the delta rule's row
// passes over float32 and bfloat16 rows, int8 rows with one float32 scale (`models/state_store.py`, the same
// float32 operations, so the same bits). Included after `fp-contract=off`: no multiply-add is ever fused.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

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

// The delta rule's two row passes over one state row of dv (`state_step.cpp`'s delta_head), the same float32
// operations per element as written (no fused multiply-add), 16 lanes at a time where AVX-512 is there and dv is
// a multiple of 16: the lanes are the row's independent columns, so the bits are the scalar loop's.
//   decay_row: si = row * g; pred = pred + si * k_i          (row: the pool's float32 or bfloat16 row)
//   step_row:  s = si + k_i * delta; o = o + q_i * s; to = s  (to: float32 or bfloat16, rounded to nearest even)
// A 64-byte aligned float32 row goes to the pool by non-temporal stores: it is read again only at the next step,
// after every other state has streamed through the caches, so writing around them saves the write-allocate read
// and keeps the next head's prefetched rows in cache (measured ~20% off a decode step's state time, AMD EPYC).
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_lanes(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store_lanes(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_lanes(c10::BFloat16* p, __m512 v) {  // c10::BFloat16(float): nearest even, NaN -> 0x7FC0
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i up = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  up = _mm512_mask_mov_epi32(up, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(up));
}
#endif

template <typename T>
inline void decay_row(const T* __restrict row, float g, float ki, float* __restrict si, float* __restrict pred,
                      int64_t dv) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (dv % 16 == 0) {
    const __m512 gv = _mm512_set1_ps(g), kv = _mm512_set1_ps(ki);
    for (; j < dv; j += 16) {
      const __m512 decayed = _mm512_mul_ps(load_lanes(row + j), gv);
      _mm512_storeu_ps(si + j, decayed);
      _mm512_storeu_ps(pred + j, _mm512_add_ps(_mm512_loadu_ps(pred + j), _mm512_mul_ps(decayed, kv)));
    }
  }
#endif
  for (; j < dv; ++j) {
    si[j] = widen(row[j]) * g;
    pred[j] = pred[j] + si[j] * ki;
  }
}

template <typename T>
inline void step_row(const float* __restrict si, float ki, const float* __restrict delta, float qi,
                     float* __restrict o, T* __restrict to, int64_t dv) {
  int64_t j = 0;
#if defined(__AVX512F__)
  if (dv % 16 == 0) {
    const __m512 kv = _mm512_set1_ps(ki), qv = _mm512_set1_ps(qi);
    const bool aligned = reinterpret_cast<uintptr_t>(to) % 64 == 0;
    for (; j < dv; j += 16) {
      const __m512 stepped = _mm512_add_ps(_mm512_loadu_ps(si + j), _mm512_mul_ps(kv, _mm512_loadu_ps(delta + j)));
      _mm512_storeu_ps(o + j, _mm512_add_ps(_mm512_loadu_ps(o + j), _mm512_mul_ps(qv, stepped)));
      if constexpr (std::is_same_v<T, float>) {
        if (aligned) {
          _mm512_stream_ps(to + j, stepped);
          continue;
        }
      }
      store_lanes(to + j, stepped);
    }
  }
#endif
  for (; j < dv; ++j) {
    const float stepped = si[j] + ki * delta[j];
    o[j] = o[j] + qi * stepped;
    to[j] = static_cast<T>(stepped);
  }
}

}  // namespace
