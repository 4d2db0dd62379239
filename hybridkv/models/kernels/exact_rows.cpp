// Exact sums for the few rows of a decode step (models/split_sum.py): out[r, n] = sum_k x[r, k] * w[n, k], where
// every x and w is an integer (x below 2^b, w below 2^24) and every partial sum stays below 2^53. float64 FMAs of
// such integers are exact, so this kernel, the BLAS and any order or split give the same integers: switching
// between them with the row count changes no bit. What it saves is bytes: the weight is read as float32 (its
// integers are exact there), half the float64 copy a BLAS call needs, and a decode step is a stream over weights.
//
// w    [Nb][K][32] float32: columns n = 32 * nb + j, zero past N (`pack_columns`)
// x    [R, K] float64, contiguous
// out  [R, N] float64
// One task per 32-column block; its sums, every row (and slice) against the block, are exact_sums.h's.
//
// `exact_linear` is `SplitWeight.__call__` in one call for float32 x: the split of x into slices, the integer sums
// and the fixed combination, each the same float64 operation in the same order as the torch code, so the same
// bits; it only saves the ~20 small torch ops per projection. `exact_row_sums` is `split_sum.row_sum` (of x, or
// of x * x in float64: `rms_scale`'s and `l2norm`'s square sums) the same way.
#pragma GCC optimize("fp-contract=off")  // the combination rounds where the torch code rounds, no fused steps

#include "torch_api.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "exact_sums.h"

namespace {

using exact_sums::kCols;

// split_sum.pow2: 2^e as float64 from its bits, e clamped to the normal range.
double pow2(int64_t e) {
  const int64_t bits = (std::clamp<int64_t>(e, -1022, 1023) + 1023) << 52;
  double out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// split_sum._row_exponent of one row: e with every |x| < 2^e, from the largest magnitude (in x's type).
template <typename T>
int64_t row_exponent(const T* x, int64_t k_size) {
  T top = 0;
  for (int64_t k = 0; k < k_size; ++k) top = std::max(top, static_cast<T>(std::fabs(x[k])));
  int e = 0;
  std::frexp(top, &e);
  return e;
}

// Rows [r0, r0 + rows) of one 32-column block from their slices' integer sums acc[s * rows + i][0:32]: combined
// smallest slice first and scaled, rounded once to float32 (split_sum.SplitWeight.__call__).
void combine_block(const double* const* acc, const int64_t* ex, const int64_t* wex, int64_t n, int64_t b, int64_t r0,
                   int64_t rows, int64_t bits, int64_t slices, float* out) {
  const double down = std::ldexp(1.0, -static_cast<int>(bits));
  const int64_t cols = std::min(kCols, n - b * kCols);
  const int64_t* we = wex + b * kCols;
  for (int64_t i = 0; i < rows; ++i) {
    double total[kCols];
    std::memcpy(total, acc[(slices - 1) * rows + i], sizeof(total));
    for (int64_t s = slices - 2; s >= 0; --s) {
      const double* a = acc[s * rows + i];
      for (int64_t j = 0; j < kCols; ++j) total[j] = a[j] + total[j] * down;
    }
    // total * 2^(e_row + e_column - bits - 24)
    const int64_t shift = ex[r0 + i] - (bits + 24);
    float* o = out + (r0 + i) * n + b * kCols;
    for (int64_t j = 0; j < cols; ++j) o[j] = static_cast<float>(total[j] * pow2(shift + we[j]));
  }
}

}  // namespace

// x [M, K] float32, w [Nb, K, 32] float32 (`pack_columns`), w_exponent [N] int64 -> [M, N] float32: x @ W^T with
// x cut into `slices` slices of `bits` bits (split_sum.split) and the sums exact.
torch::Tensor exact_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& w_exponent, int64_t n,
                           int64_t bits, int64_t slices) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.size(2) == kCols,
              "w: [Nb, K, 32] float32");
  TORCH_CHECK(w_exponent.scalar_type() == torch::kInt64 && w_exponent.is_contiguous() && w_exponent.numel() == n);
  TORCH_CHECK(slices >= 1 && slices <= 8 && bits >= 8 && bits <= 52, "slices in [1, 8], bits in [8, 52]");
  const int64_t m_size = x.size(0), k_size = x.size(1), blocks = w.size(0);
  TORCH_CHECK(w.size(1) == k_size && blocks * kCols >= n && n > blocks * kCols - kCols, "w does not hold [N, K]");
  auto out = torch::empty({m_size, n}, x.options());
  if (m_size == 0) return out;
  // The slices [S, M, K] and row exponents [M]: rest = x 2^-e; per slice rest *= 2^bits, part = trunc(rest),
  // rest -= part (every step exact).
  std::vector<double> parts(slices * m_size * k_size);
  std::vector<int64_t> ex(m_size);
  const float* xp = x.data_ptr<float>();
  const double up = std::ldexp(1.0, static_cast<int>(bits));
  at::parallel_for(0, m_size, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xp + m * k_size;
      ex[m] = row_exponent(xr, k_size);
      const double scale = pow2(-ex[m]);
      for (int64_t k = 0; k < k_size; ++k) {
        double rest = static_cast<double>(xr[k]) * scale;
        for (int64_t s = 0; s < slices; ++s) {
          rest = rest * up;
          const double part = std::trunc(rest);
          parts[(s * m_size + m) * k_size + k] = part;
          rest = rest - part;
        }
      }
    }
  });
  const float* wp = w.data_ptr<float>();
  const int64_t* wex = w_exponent.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  constexpr int64_t kChunk = 96;  // rows whose slices' sums stay cached while every column block streams by
  for (int64_t c0 = 0; c0 < m_size; c0 += kChunk) {
    const int64_t rows = std::min(m_size, c0 + kChunk) - c0, listed = slices * rows;
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      // The listed rows, slice-major: entry s * rows + i is slice s of row c0 + i.
      std::vector<double> chunk(exact_sums::kDepth * kCols), sums(listed * kCols);
      std::vector<const double*> x_rows(listed);
      std::vector<double*> acc(listed);
      for (int64_t s = 0; s < slices; ++s) {
        for (int64_t i = 0; i < rows; ++i) {
          x_rows[s * rows + i] = parts.data() + (s * m_size + c0 + i) * k_size;
          acc[s * rows + i] = sums.data() + (s * rows + i) * kCols;
        }
      }
      for (int64_t b = b0; b < b1; ++b) {
        exact_sums::block_sums(wp + b * k_size * kCols, k_size, x_rows.data(), acc.data(), listed, chunk.data());
        combine_block(acc.data(), ex.data(), wex, n, b, c0, rows, bits, slices, op);
      }
    });
  }
  return out;
}

// x [R, K] float32 or float64 -> [R, 1] float64: split_sum.row_sum of each row, or of its squares (`square`,
// float32 x: (x as float64)^2, exact) - one slice of 53 - ceil(log2 K) bits below the row's top, summed exactly.
torch::Tensor exact_row_sums(const torch::Tensor& x, bool square) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: [R, K] contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kFloat64 || (x.scalar_type() == torch::kFloat32 && square),
              "x: float64, or float32 with square");
  const int64_t r_size = x.size(0), k_size = x.size(1);
  int64_t log_k = 1;
  while ((int64_t{1} << log_k) < k_size) ++log_k;
  const int64_t bits = 53 - log_k;
  auto out = torch::empty({r_size, 1}, x.options().dtype(torch::kFloat64));
  double* op = out.data_ptr<double>();
  at::parallel_for(0, r_size, 16, [&](int64_t r0, int64_t r1) {
    std::vector<double> row(k_size);
    for (int64_t r = r0; r < r1; ++r) {
      if (square) {
        const float* xr = x.data_ptr<float>() + r * k_size;
        for (int64_t k = 0; k < k_size; ++k) row[k] = static_cast<double>(xr[k]) * static_cast<double>(xr[k]);
      } else {
        std::memcpy(row.data(), x.data_ptr<double>() + r * k_size, k_size * sizeof(double));
      }
      const int64_t e = row_exponent(row.data(), k_size);
      const double scale = pow2(-e), up = std::ldexp(1.0, static_cast<int>(bits));
      // Integers below 2^53 all along: any order gives these bits, so 8 lanes sum them side by side.
      double lanes[8] = {};
      int64_t k = 0;
      for (; k + 8 <= k_size; k += 8) {
        for (int64_t l = 0; l < 8; ++l) lanes[l] += std::trunc(row[k + l] * scale * up);
      }
      for (; k < k_size; ++k) lanes[0] += std::trunc(row[k] * scale * up);
      double sum = 0;
      for (double lane : lanes) sum += lane;
      op[r] = sum * pow2(e - bits);
    }
  });
  return out;
}

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
    std::vector<double> chunk(exact_sums::kDepth * kCols), sums(rows * kCols);
    std::vector<const double*> x_rows(rows);
    std::vector<double*> acc(rows);
    for (int64_t r = 0; r < rows; ++r) {
      x_rows[r] = xp + r * k_size;
      acc[r] = sums.data() + r * kCols;
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min(kCols, n - b * kCols);
      exact_sums::block_sums(wp + b * k_size * kCols, k_size, x_rows.data(), acc.data(), rows, chunk.data());
      for (int64_t r = 0; r < rows; ++r) std::memcpy(op + r * n + b * kCols, acc[r], cols * sizeof(double));
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("exact_rows", &exact_rows, "exact integer sums, few rows");
  m.def("exact_linear", &exact_linear, "x @ W^T with exact sums: split, sum, combine (float32)");
  m.def("exact_row_sums", &exact_row_sums, "row sums (or sums of squares) with exact partial sums");
}
