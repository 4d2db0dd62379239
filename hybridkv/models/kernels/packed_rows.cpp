// Few-row bfloat16 linears read straight from oneDNN's packed weight: y [M, N] = x [M, K] @ W^T (+ bias), for the
// M <= 4 rows of a decode step, where a linear is a stream over its weight and oneDNN's brgemm reaches 9-13 GB/s
// of this core's ~25 (measured: 1.3-2x faster at 1-4 rows, one thread, Qwen3-0.6B's projection shapes).
//
// The weight is oneDNN's blocked bf16 layout on AVX512-BF16 CPUs without AMX: [Np/64][Kp/2][64][2], Kp = K
// rounded up to 32 and Np = N up to 64, zero padded (the caller checks the size and a probe product before use).
// One task owns one 64-output block and streams its Kp * 128 bytes once for every four rows.
//
// The bits equal oneDNN's (torch 2.13's, measured on every shape the tests list): each output lane accumulates
// vdpbf16ps pair products in k order, in K blocks of `k_block` that start from zero and are added in order,
// then the bias, then one rounding. oneDNN's K block is 512, or 1024 for two rows or more when K > 1024.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kBlockN = 64;  // outputs per weight block: 4 vectors of 16 float32 lanes

// rows [m0, m0 + R) x one 64-output block -> acc [R][64] float32 (bias and rounding come after).
// x holds bf16 pairs as uint32, ldx pairs per row, zero past K.
template <int R>
void block_rows(const __m512i* w, const uint32_t* x, int64_t ldx, int64_t pairs, int64_t block_pairs, float* acc_out) {
  __m512 acc[R][4], total[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = total[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p, w += 4) {
    if (p > 0 && p % block_pairs == 0) {  // a K block ends: total += its partial sums
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) {
          total[r][j] = p == block_pairs ? acc[r][j] : _mm512_add_ps(total[r][j], acc[r][j]);
          acc[r][j] = _mm512_setzero_ps();
        }
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 1);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 2), w3 = (__m512bh)_mm512_loadu_si512(w + 3);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xb);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xb);
    }
  }
  const bool blocked = pairs > block_pairs;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm512_storeu_ps(acc_out + r * kBlockN + j * 16, blocked ? _mm512_add_ps(total[r][j], acc[r][j]) : acc[r][j]);
}

using BlockFn = void (*)(const __m512i*, const uint32_t*, int64_t, int64_t, int64_t, float*);
constexpr BlockFn kBlockFns[4] = {block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>};

}  // namespace

torch::Tensor linear_rows(const torch::Tensor& x, int64_t address, int64_t n_out, int64_t k_in,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bfloat16 rows");
  TORCH_CHECK(x.size(1) == k_in, "x has ", x.size(1), " features, the weight ", k_in);
  TORCH_CHECK(address != 0 && address % 64 == 0, "the packed weight's address must be 64-byte aligned");
  const int64_t m = x.size(0), k = x.size(1), kp = (k + 31) / 32 * 32, pairs = kp / 2;
  const int64_t blocks = (n_out + kBlockN - 1) / kBlockN;
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n_out,
                        "bias must be bfloat16 [N]");
  // rows as uint32 pairs, zero padded to Kp (oneDNN pads the weight with zeros, so 0 * 0 keeps the sums)
  const torch::Tensor xp = (k == kp && x.stride(0) == k) ? x : at::constant_pad_nd(x, {0, kp - k}, 0).contiguous();
  const auto* xs = reinterpret_cast<const uint32_t*>(xp.data_ptr());
  const auto* w = reinterpret_cast<const __m512i*>(address);
  const int64_t block_pairs = (m >= 2 && k > 1024 ? 1024 : 512) / 2;
  const c10::BFloat16* b = bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  auto out = torch::empty({m, n_out}, x.options());
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[4 * kBlockN];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kBlockN, width = std::min(kBlockN, n_out - n0);
      for (int64_t m0 = 0; m0 < m; m0 += 4) {  // rows after the first four re-read the block from L2
        const int64_t rows = std::min<int64_t>(4, m - m0);
        kBlockFns[rows - 1](w + blk * pairs * 4, xs + m0 * pairs, pairs, pairs, block_pairs, acc);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < width; ++j) {
            const float v = acc[r * kBlockN + j];
            o[(m0 + r) * n_out + n0 + j] = static_cast<c10::BFloat16>(b ? v + static_cast<float>(b[n0 + j]) : v);
          }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "x [M, K] @ W^T (+ bias) from oneDNN's packed bf16 [N, K] weight at `address`");
}

#else  // no AVX512-BF16: the module loads without the kernel and linears stay on oneDNN

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

#endif
