// Fused elementwise kernels for the models' hot path, one pass over memory each, float32 inside, one rounding
// to the tensor's dtype at the end (plain torch rounds after every op in bfloat16):
//   act_and_mul(x [n, 2I]) -> [n, I]: act(x[:, :I]) * x[:, I:], act = silu or GELU (tanh approximation);
//   rms_norm(x [n, d] or [n, h, d], w [d] float32, eps) -> x / sqrt(mean(x^2) + eps) * w per row of d (w holds
//   any 1 + offset), contiguous out; x's rows may be strided (q and k heads viewed out of a fused projection);
//   rope(x [n, h, d] (d contiguous; rows and heads may be strided), cos, sin [n, 1, d] in x's dtype) -> contiguous
//   [n, h, d]: x * cos + roll(x, d / 2) * sin, rounded to x's dtype after each product and after the sum as torch
//   rounds those three ops, so its bits are `rope.apply_rope`'s (`sin` holds -sin, sin as `RopeTables` does);
//   row_argmax(x [n, v]) -> int64 [n]: torch.argmax's answer per row (the first largest value; a row holding NaN
//   gives its first NaN), read in place from bfloat16 rows (no float32 copy of the logits).
// Rows are independent: a row's bits do not depend on the rows beside it or on the thread count. The vector loops
// run at `lanes.h`'s width (16 lanes with AVX-512, 8 with AVX2), a scalar loop after them for the tail.
#include "torch_api.h"

#include <ATen/Parallel.h>

#include <cmath>

#include "lanes.h"
#include "simd.h"

namespace {

enum Act : int64_t { kSilu = 0, kGeluTanh = 1 };

inline float act_scalar(float g, int64_t act) {
  if (act == kSilu) return g / (1.f + std::exp(-g));
  const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return g / (1.f + std::exp(-2.f * u));
}

#if defined(HYBRIDKV_LANES)
inline lanes::V act_lanes(lanes::V g, int64_t act) {
  using namespace lanes;
  if (act == kSilu) return silu(g);
  // 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)): no cancellation where tanh(u) nears -1
  const V u = mul(splat(0.7978845608028654f), fmadd(splat(0.044715f), mul(mul(g, g), g), g));
  return div(g, add(splat(1.f), exp(mul(splat(-2.f), u))));
}
#endif

template <typename T>
void act_and_mul_rows(const T* x, T* out, int64_t r0, int64_t r1, int64_t inter, int64_t act) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = x + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
    int64_t i = 0;
#if defined(HYBRIDKV_LANES)
    for (; i + lanes::kWidth <= inter; i += lanes::kWidth)
      lanes::store(o + i, lanes::mul(act_lanes(lanes::load(g + i), act), lanes::load(u + i)));
#endif
    for (; i < inter; ++i) o[i] = static_cast<T>(act_scalar(static_cast<float>(g[i]), act) * static_cast<float>(u[i]));
  }
}

template <typename T>
void rms_norm_rows(const T* x, const float* w, T* out, int64_t r0, int64_t r1, int64_t d, float eps, int64_t heads,
                   int64_t s0, int64_t s1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + (r / heads) * s0 + (r % heads) * s1;
    T* o = out + r * d;
    float ss = 0.f;
    int64_t i = 0;
#if defined(HYBRIDKV_LANES)
    lanes::V acc = lanes::zero();
    for (; i + lanes::kWidth <= d; i += lanes::kWidth) {
      const lanes::V v = lanes::load(xr + i);
      acc = lanes::fmadd(v, v, acc);
    }
    ss = lanes::sum(acc);
#endif
    for (; i < d; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    i = 0;
#if defined(HYBRIDKV_LANES)
    const lanes::V vinv = lanes::splat(inv);
    for (; i + lanes::kWidth <= d; i += lanes::kWidth)
      lanes::store(o + i, lanes::mul(lanes::mul(lanes::load(xr + i), vinv), lanes::load(w + i)));
#endif
    for (; i < d; ++i) o[i] = static_cast<T>(static_cast<float>(xr[i]) * inv * w[i]);
  }
}

void check_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
}

torch::Tensor act_and_mul(const torch::Tensor& x, int64_t act) {
  check_rows(x);
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "act: 0 silu, 1 gelu_tanh");
  TORCH_CHECK(x.size(-1) % 2 == 0, "x's last dim must be gate and up side by side");
  const int64_t inter = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, x.options());
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == at::kBFloat16)
      act_and_mul_rows(x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), r0, r1, inter, act);
    else
      act_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), r0, r1, inter, act);
  });
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "x must be [n, d] or [n, h, d], d contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t d = x.size(-1), heads = x.dim() == 3 ? x.size(1) : 1, rows = x.numel() / std::max<int64_t>(d, 1);
  const int64_t s0 = x.stride(0), s1 = x.dim() == 3 ? x.stride(1) : d;
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == d,
              "weight must be float32 [d]");
  auto out = torch::empty(x.sizes(), x.options());
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == at::kBFloat16)
      rms_norm_rows(x.data_ptr<c10::BFloat16>(), w, out.data_ptr<c10::BFloat16>(), r0, r1, d, e, heads, s0, s1);
    else
      rms_norm_rows(x.data_ptr<float>(), w, out.data_ptr<float>(), r0, r1, d, e, heads, s0, s1);
  });
  return out;
}

// out[i] = T(T(x[i] * cos[i]) + T(x[i +- d/2] * sin[i])): the product of two bfloat16 values is exact in float32,
// so each T(...) is the one rounding torch's bfloat16 op makes; in float32 every T(...) is a no-op, and the sum
// must not become a fused multiply-add (g++ contracts C++ by default): torch rounds each product first.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t r0, int64_t r1, int64_t heads, int64_t d,
               int64_t s0, int64_t s1) {
  const int64_t half = d / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t n = r / heads;
    const T* xr = x + n * s0 + (r % heads) * s1;
    const T *c = cos + n * d, *s = sin + n * d;
    T* o = out + r * d;
    for (int64_t i = 0; i < d; ++i) {
      const T straight = static_cast<T>(static_cast<float>(xr[i]) * static_cast<float>(c[i]));
      const T turned = static_cast<T>(static_cast<float>(xr[i < half ? i + half : i - half]) * static_cast<float>(s[i]));
      o[i] = static_cast<T>(static_cast<float>(straight) + static_cast<float>(turned));
    }
  }
}

torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0, "x must be [n, h, d], d even and contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t n = x.size(0), heads = x.size(1), d = x.size(2);
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == n && t->size(1) == 1 && t->size(2) == d && t->is_contiguous() &&
                    t->scalar_type() == x.scalar_type(),
                "cos and sin must be contiguous [n, 1, d] in x's dtype");
  auto out = torch::empty({n, heads, d}, x.options());
  at::parallel_for(0, n * heads, 16, [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == at::kBFloat16)
      rope_rows(x.data_ptr<c10::BFloat16>(), cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(),
                out.data_ptr<c10::BFloat16>(), r0, r1, heads, d, x.stride(0), x.stride(1));
    else
      rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(), r0, r1,
                heads, d, x.stride(0), x.stride(1));
  });
  return out;
}

template <typename T>
int64_t argmax_row(const T* x, int64_t v) {
  int64_t i = 0, best_i = 0;
  float best = v > 0 ? static_cast<float>(x[0]) : 0.f;
  bool nan = false;
#if defined(__AVX512F__)
  if (v >= 16) {
    // Lane l keeps the first largest of x[l], x[l + 16], ...; the answer is the smallest index among the lanes
    // that hold the row's largest value.
    __m512 lane_max = load16(x);
    __m512i lane_idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = lane_idx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 unordered = _mm512_cmp_ps_mask(lane_max, lane_max, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= v; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 y = load16(x + i);
      unordered |= _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(y, lane_max, _CMP_GT_OQ);
      lane_max = _mm512_mask_mov_ps(lane_max, gt, y);
      lane_idx = _mm512_mask_mov_epi32(lane_idx, gt, idx);
    }
    nan = unordered != 0;
    best = _mm512_reduce_max_ps(lane_max);
    const __mmask16 at_best = _mm512_cmp_ps_mask(lane_max, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_i = _mm512_mask_reduce_min_epi32(at_best, lane_idx);
  }
#elif defined(HYBRIDKV_LANES)
  if (v >= 8) {  // the AVX-512 walk on 8 lanes, with blends for its masks
    __m256 lane_max = lanes::load(x);
    __m256i lane_idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i idx = lane_idx;
    const __m256i step = _mm256_set1_epi32(8);
    __m256 unordered = _mm256_cmp_ps(lane_max, lane_max, _CMP_UNORD_Q);
    for (i = 8; i + 8 <= v; i += 8) {
      idx = _mm256_add_epi32(idx, step);
      const __m256 y = lanes::load(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(y, lane_max, _CMP_GT_OQ);
      lane_max = _mm256_blendv_ps(lane_max, y, gt);
      lane_idx = _mm256_blendv_epi8(lane_idx, idx, _mm256_castps_si256(gt));
    }
    nan = _mm256_movemask_ps(unordered) != 0;
    best = reduce_max8(lane_max);
    alignas(32) float maxes[8];
    alignas(32) int32_t where[8];
    _mm256_store_ps(maxes, lane_max);
    _mm256_store_si256(reinterpret_cast<__m256i*>(where), lane_idx);
    best_i = v;
    for (int l = 0; l < 8; ++l)
      if (maxes[l] == best) best_i = std::min<int64_t>(best_i, where[l]);
  }
#endif
  for (; i < v && !nan; ++i) {
    const float y = static_cast<float>(x[i]);
    if (std::isnan(y)) nan = true;
    if (y > best) best = y, best_i = i;
  }
  if (nan)
    for (i = 0; i < v; ++i)
      if (std::isnan(static_cast<float>(x[i]))) return i;
  return best_i;
}

torch::Tensor row_argmax(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [n, v] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t{1} << 31), "x's rows must hold 1 to 2^31 - 1 values");
  const int64_t rows = x.size(0), v = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    o[r] = x.scalar_type() == at::kBFloat16 ? argmax_row(x.data_ptr<c10::BFloat16>() + r * stride, v)
                                            : argmax_row(x.data_ptr<float>() + r * stride, v);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("act_and_mul", &act_and_mul, "act(gate) * up over [n, 2I] -> [n, I] (0 silu, 1 gelu_tanh)");
  m.def("rms_norm", &rms_norm, "x / rms(x) * weight per row, float32 inside");
  m.def("rope", &rope, "x * cos + roll(x, d / 2) * sin per head, torch's roundings");
  m.def("row_argmax", &row_argmax, "torch.argmax(x, dim=1) of [n, v] rows, bfloat16 read in place");
}
