// Exact sums for the few rows of a decode step (models/split_sum.py): out[r, n] = sum_k x[r, k] * w[n, k], where
// every x and w is an integer (x below 2^b, w below 2^24) and every partial sum stays below 2^53. float64 FMAs of
// such integers are exact, so this kernel, the BLAS and any order or split give the same integers: switching
// between them with the row count changes no bit. What it saves is bytes: the weight is read as float32 (its
// integers are exact there), half the float64 copy a BLAS call needs, and a decode step is a stream over weights.
//
// w    [Nb][K][32] float32: columns n = 32 * nb + j, zero past N (`pack_columns`)
// x    [R, K] float64, contiguous
// out  [R, N] float64
// One task per 32-column block; inside it, rows in groups of up to 4 while the block's K * 128 bytes stay cached.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 32;

#if defined(__AVX512F__)
template <int R>
void rows_block(const float* w, const double* x, int64_t k_size, double* acc_out) {
  __m512d acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_pd();
  for (int64_t k = 0; k < k_size; ++k) {
    const float* wk = w + k * kCols;
    __m512d wd[4];
    for (int j = 0; j < 4; ++j) wd[j] = _mm512_cvtps_pd(_mm256_loadu_ps(wk + 8 * j));
    for (int r = 0; r < R; ++r) {
      const __m512d xr = _mm512_set1_pd(x[r * k_size + k]);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_fmadd_pd(xr, wd[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_pd(acc_out + r * kCols + 8 * j, acc[r][j]);
}
#else
template <int R>
void rows_block(const float* w, const double* x, int64_t k_size, double* acc_out) {
  double acc[R][kCols] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    const float* wk = w + k * kCols;
    for (int r = 0; r < R; ++r) {
      const double xr = x[r * k_size + k];
      for (int64_t j = 0; j < kCols; ++j) acc[r][j] += xr * static_cast<double>(wk[j]);
    }
  }
  std::memcpy(acc_out, acc, sizeof(acc));
}
#endif

void group(int64_t rows, const float* w, const double* x, int64_t k_size, double* acc) {
  switch (rows) {
    case 1: return rows_block<1>(w, x, k_size, acc);
    case 2: return rows_block<2>(w, x, k_size, acc);
    case 3: return rows_block<3>(w, x, k_size, acc);
    default: return rows_block<4>(w, x, k_size, acc);
  }
}

}  // namespace

torch::Tensor exact_rows(const torch::Tensor& x, const torch::Tensor& w, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat64 && x.is_contiguous(), "x: [R, K] float64");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(2) == kCols,
              "w: [Nb, K, 32] float32");
  const int64_t rows = x.size(0), k_size = x.size(1), blocks = w.size(0);
  TORCH_CHECK(w.size(1) == k_size && blocks * kCols >= n && n > blocks * kCols - kCols, "w does not hold [N, K]");
  auto out = torch::empty({rows, n}, x.options());
  const float* wp = w.data_ptr<float>();
  const double* xp = x.data_ptr<double>();
  double* op = out.data_ptr<double>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    double acc[4 * kCols];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min(kCols, n - b * kCols);
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t r = std::min<int64_t>(4, rows - r0);
        group(r, wp + b * k_size * kCols, xp + r0 * k_size, k_size, acc);
        for (int64_t i = 0; i < r; ++i) std::memcpy(op + (r0 + i) * n + b * kCols, acc + i * kCols, cols * 8);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("exact_rows", &exact_rows, "exact integer sums, few rows"); }
