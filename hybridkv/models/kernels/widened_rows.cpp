// Few-row bfloat16 linears on CPUs whose oneDNN has no bfloat16 path (AVX2 without AVX-512: AMD Zen 2/3, older
// Xeons). There torch's bfloat16 matmul runs a scalar loop at ~10 GFLOP/s whatever the row count (one thread,
// AMD EPYC Zen 3: 16 rows x a 3072 x 1024 weight took 9.9 ms, float32 MKL 2.7 ms). This kernel widens the weight
// to float32 in registers-sized pieces and multiplies with 8-lane FMAs: y [M, N] = x [M, K] @ W^T (+ bias).
//
// x     [M, K] bfloat16, contiguous
// w     [N, K] bfloat16, rows contiguous (row stride ldw >= K): the checkpoint's own layout, no packed copy
// bias  [N] bfloat16 or none
// out   [M, N] bfloat16
//
// One task per block of kN = 4 outputs: the block's weight rows are widened once into a float32 scratch (4 * K
// floats, in L1/L2), then every group of up to 3 rows runs over it: 12 accumulators, lane i of accumulator (r, j)
// summing x[r, k] w[j, k] over k = 8s + i in order of s; then a fixed tree of the 8 lanes, the bias, one rounding.
// One row with K <= kPairK takes two blocks at a time (8 weight rows in flight, widened in registers): the same
// arithmetic per output, more lines in flight: one thread, Zen 3, against 4 rows in one A/B run, 262144 x 640 (a
// Gemma 3 lm_head) +7%, 1024 x 640 +7%, K = 1024 +0-3%; at K = 2048 it was 13% slower (the 8 rows and the next 8
// it prefetches outgrow L1), so it is not taken there.
// A row's bits depend on that row and the weight alone: not on the rows beside it or the thread count.
#include "torch_api.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr bool kSupported = true;
constexpr int64_t kN = 4;      // outputs per task block
constexpr int64_t kGroup = 2;  // rows per register block: 2 x 4 accumulators, 4 weight vectors, 1 of x
constexpr int64_t kDirectRows = 2;  // up to this many rows the weight is widened in registers, not in a scratch
constexpr int64_t kPairK = 1024;    // one row takes two blocks at once up to this K

inline void widen(const c10::BFloat16* src, float* dst, int64_t k, int64_t kp) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
  for (; i < k; ++i) dst[i] = static_cast<float>(src[i]);
  for (; i < kp; ++i) dst[i] = 0.f;
}

// The four sums of a[0..3]'s lanes, each a fixed tree: [sum a0, sum a1, sum a2, sum a3].
inline __m128 sum4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Lines of the next block to prefetch at each of a block's `steps` prefetch points so that all `bytes` of it are
// asked for, in address order. The rows themselves are read side by side (J streams 2 ldw bytes apart); asking
// for the next block as one sequential stream keeps the hardware's prefetch running ahead of them (AMD EPYC Zen 3,
// 262144 x 640 bf16, widen-and-add only: 11.4 GB/s with a line per row per point, 13.2-14.0 in address order,
// 13.6-14.2 for one plain sequential stream; the kernel on Gemma 3's 262144 x 640 lm_head, one row: 26.0 -> 19.8
// ms, the same bits).
inline int64_t ahead_lines(int64_t bytes, int64_t steps) {
  return steps <= 0 ? 0 : (bytes + 64 * steps - 1) / (64 * steps);
}

// sums[r * kN + j] = x[r] . w[j] over kp (a multiple of 8) for R rows of x (stride ldx) and J rows of w, the
// weight either widened already (float32 scratch, stride kp) or read as bfloat16 and widened here (stride ldw,
// the tail past k taken from `tail`, each row's last 8 values zero padded). Both give the same arithmetic: lane i
// of (r, j) sums x[r, k] w[j, k] over k = 8s + i in order of s, then `sum4`'s tree.
template <int R, int J, bool kWide>
__attribute__((always_inline)) inline void block(const void* w, int64_t ldw, const float* tail, const float* x, int64_t ldx, int64_t kp,
                  float* sums, const char* next = nullptr) {
  static_assert(J % 4 == 0 && R * J <= 8, "the accumulators, the weight vector and x fit the 16 registers");
  __m256 acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t body = kWide ? kp : kp - 8;  // bf16 rows: the last step comes from `tail`
  // The pair path's 8 short rows (K <= kPairK) prefetch the next block in address order; 4 rows of K > kPairK a
  // line of each row at the same k (in address order there: 18% slower at K = 2048 and 4096).
  constexpr bool kInOrder = J == 2 * kN;
  const int64_t ahead = kInOrder && next != nullptr ? ahead_lines(J * ldw * 2, (body + 31) / 32) : 0;
  for (int64_t k = 0; k < body; k += 8) {
    if (next != nullptr && k % 32 == 0) {  // the next block, one block ahead of the stream
      if constexpr (kInOrder)
        for (int64_t i = 0; i < ahead; ++i) _mm_prefetch(next + (k / 32 * ahead + i) * 64, _MM_HINT_T0);
      else
        for (int j = 0; j < J; ++j) _mm_prefetch(next + 2 * (j * ldw + k), _MM_HINT_T0);
    }
    const auto weight = [&](int j) {
      if constexpr (kWide) {
        return _mm256_loadu_ps(static_cast<const float*>(w) + j * ldw + k);
      } else {
        const auto* bits = static_cast<const uint16_t*>(w) + j * ldw + k;
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
      }
    };
    if constexpr (R == 1) {  // each weight vector used once: widened next to its FMA, so 8 of them never sit in
      // registers at once beside 8 accumulators (GCC hoisted all 8 and spilled 3 accumulators to the stack)
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (int j = 0; j < J; ++j) acc[0][j] = _mm256_fmadd_ps(xv, weight(j), acc[0][j]);
    } else {
      __m256 wv[J];
      for (int j = 0; j < J; ++j) wv[j] = weight(j);
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
        for (int j = 0; j < J; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
  }
  if constexpr (!kWide) {
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * ldx + kp - 8);
      for (int j = 0; j < J; ++j) acc[r][j] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(tail + j * 8), acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; j += 4) _mm_storeu_ps(sums + r * kN + j, sum4(acc[r] + j));
}

torch::Tensor widened_rows(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be contiguous [M, K] bf16");
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && w.scalar_type() == at::kBFloat16, "w must be [N, K] bf16, K contiguous");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0), ldw = w.stride(0);
  TORCH_CHECK(w.size(1) == k, "x and w disagree on K");
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() && bias->scalar_type() == at::kBFloat16,
                "bias must be a contiguous [N] bf16 tensor");
    bp = bias->data_ptr<c10::BFloat16>();
  }
  const int64_t kp = (k + 7) / 8 * 8;
  std::vector<float> xf(m * kp);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t r = 0; r < m; ++r) widen(xp + r * k, xf.data() + r * kp, k, kp);
  auto out = torch::empty({m, n}, x.options());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  const int64_t blocks = (n + kN - 1) / kN;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> wf(kN * kp), tail(2 * kN * 8), sums(2 * kN);
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n0 = blk * kN, nn = std::min(kN, n - n0);
      const c10::BFloat16* wb = wp + n0 * ldw;
      if (m == 1 && k <= kPairK && blk + 1 < end && n0 + 2 * kN <= n) {  // blocks blk and blk + 1, both whole
        const bool more = blk + 2 < end && n0 + 4 * kN <= n;
        const char* ahead = more ? reinterpret_cast<const char*>(wb + 2 * kN * ldw) : nullptr;
        for (int64_t j = 0; j < 2 * kN; ++j) widen(wb + j * ldw + kp - 8, tail.data() + j * 8, k - (kp - 8), 8);
        block<1, 2 * kN, false>(wb, ldw, tail.data(), xf.data(), kp, kp, sums.data(), ahead);
        for (int64_t j = 0; j < 2 * kN; ++j)
          op[n0 + j] = c10::BFloat16(sums[j] + (bp ? static_cast<float>(bp[n0 + j]) : 0.f));
        ++blk;
        continue;
      }
      const bool direct = m <= kDirectRows && nn == kN;  // few rows: widen in registers as the weight streams by
      const char* ahead = blk + 1 < end && n0 + 2 * kN <= n ? reinterpret_cast<const char*>(wb + kN * ldw) : nullptr;
      for (int64_t j = 0; j < kN; ++j) {
        if (direct)
          widen(wb + j * ldw + kp - 8, tail.data() + j * 8, k - (kp - 8), 8);
        else if (j < nn)
          widen(wb + j * ldw, wf.data() + j * kp, k, kp);
        else
          std::fill(wf.begin() + j * kp, wf.begin() + (j + 1) * kp, 0.f);
      }
      for (int64_t r0 = 0; r0 < m; r0 += kGroup) {
        const int64_t rows = std::min(kGroup, m - r0);
        const float* xr = xf.data() + r0 * kp;
        if (direct && rows == 2)
          block<2, kN, false>(wb, ldw, tail.data(), xr, kp, kp, sums.data(), ahead);
        else if (direct)
          block<1, kN, false>(wb, ldw, tail.data(), xr, kp, kp, sums.data(), ahead);
        else if (rows == 2)
          block<2, kN, true>(wf.data(), kp, nullptr, xr, kp, kp, sums.data());
        else
          block<1, kN, true>(wf.data(), kp, nullptr, xr, kp, kp, sums.data());
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < nn; ++j) {
            const float s = sums[r * kN + j] + (bp ? static_cast<float>(bp[n0 + j]) : 0.f);
            op[(r0 + r) * n + n0 + j] = c10::BFloat16(s);  // round to nearest even
          }
      }
    }
  });
  return out;
}

}  // namespace

#else
namespace {

constexpr bool kSupported = false;

torch::Tensor widened_rows(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "widened_rows was built without AVX2 and FMA");
}

}  // namespace
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("widened_rows", &widened_rows, "x [M, K] @ W^T (+ bias), bf16 weight widened to float32 (AVX2)");
  m.attr("supported") = kSupported;
}
