// One vector of float32 lanes for the element-wise kernels (fused_ops, gdn_ops), so each loop is written once:
//   AVX-512          16 lanes (simd.h)
//   AVX2+FMA+F16C     8 lanes (simd_avx2.h)      AMD Zen 2/3, older Xeons
//   neither           no lanes: HYBRIDKV_LANES is undefined and the callers' scalar loops do every element.
// Every operation acts on each lane alone and as written (a multiply and an add stay two roundings unless the
// name says fmadd), so a lane's bits are the same at either width. Only `sum` (one number from the lanes) orders
// its additions by the width: a kernel that sums lanes gives each width its own bits, the same on every call.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include "simd.h"
#define HYBRIDKV_LANES 16

namespace lanes {
using V = __m512;
constexpr int64_t kWidth = 16;

template <typename T>
inline V load(const T* p) { return load16(p); }
template <typename T>
inline void store(T* p, V v) { store16(p, v); }
inline V splat(float x) { return _mm512_set1_ps(x); }
inline V zero() { return _mm512_setzero_ps(); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline V exp(V x) { return exp16(x); }
inline float sum(V v) { return _mm512_reduce_add_ps(v); }
}  // namespace lanes

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd_avx2.h"
#define HYBRIDKV_LANES 8

namespace lanes {
using V = __m256;
constexpr int64_t kWidth = 8;

template <typename T>
inline V load(const T* p) { return load8(p); }
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, V v) {  // round to nearest even, NaN kept quiet (as store16)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i high = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
  // 8 values of 16 bits: pack each 128-bit half's four, then take the two halves' low 64 bits in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline V splat(float x) { return _mm256_set1_ps(x); }
inline V zero() { return _mm256_setzero_ps(); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline V exp(V x) { return exp8(x); }
inline float sum(V v) { return reduce_add8(v); }
}  // namespace lanes
#endif

#if defined(HYBRIDKV_LANES)
namespace lanes {
// x / (1 + e^-x)
inline V silu(V x) { return div(x, add(splat(1.f), exp(sub(zero(), x)))); }
}  // namespace lanes
#endif
