// Few-row bfloat16 linears read straight from oneDNN's packed weight: y [M, N] = x [M, K] @ W^T (+ bias), for the
// M <= 32 rows of a decode step, where a linear streams its weight from memory. oneDNN's brgemm leaves that stream
// and its arithmetic one after the other (at 16 rows a Qwen3.5-0.8B step took the sum of both, ~84 ms = 36 + 50);
// this kernel keeps the stream under the arithmetic (measured 1.3x at 1-16 rows, one thread, AMD EPYC).
//
// The weight is oneDNN's blocked bf16 layout on AVX512-BF16 CPUs without AMX: [Np/64][Kp/2][64][2], Kp = K
// rounded up to 32 and Np = N up to 64, zero padded (the caller checks the size and a probe product before use).
// One task owns one 64-output block and streams its Kp * 128 bytes once:
//   M <= 4   the rows' sums stay in registers over each K block (`block_rows`);
//   M > 4    K in chunks of 64 pairs (16 KiB, in L1) that every group of 4 rows runs in turn, their sums
//            waiting in memory between chunks, while the groups prefetch the next chunk (`block_many`).
//
// The bits equal oneDNN's (torch 2.13's, measured on every shape the tests list, 1-32 rows): each output lane
// accumulates vdpbf16ps pair products in k order, in K blocks that start from zero and are added in order, then
// the bias, then one rounding. oneDNN's K block is 512, or 1024 for two rows or more when K > 1024.
#include "torch_api.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int64_t kBlockN = 64;  // outputs per weight block: 4 vectors of 16 float32 lanes

// acc[r] += the pair products of row r over pairs [p0, p1) of one 64-output block, in k order (x holds bf16 pairs
// as uint32, ldx pairs per row, zero past K); with kFetch, `per` lines from `ahead` on their way in per pair.
template <int R, bool kFetch>
inline __attribute__((always_inline)) void accumulate(__m512 (&acc)[R][4], const __m512i* w, const uint32_t* x,
                                                       int64_t ldx, int64_t p0, int64_t p1, const __m512i* ahead,
                                                       int per) {
  for (int64_t p = p0; p < p1; ++p) {
    const __m512i* wp = w + 4 * p;
    if constexpr (kFetch) {
      const auto* line = reinterpret_cast<const char*>(ahead + per * (p - p0));
      for (int j = 0; j < per; ++j) _mm_prefetch(line + 64 * j, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp), w1 = (__m512bh)_mm512_loadu_si512(wp + 1);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(wp + 2), w3 = (__m512bh)_mm512_loadu_si512(wp + 3);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], w2, xb);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], w3, xb);
    }
  }
}

// rows [0, R) x one 64-output block -> acc [R][64] float32 (bias and rounding come after): the sums stay in
// registers over each K block.
template <int R>
void block_rows(const __m512i* w, const uint32_t* x, int64_t ldx, int64_t pairs, int64_t block_pairs, float* acc_out) {
  __m512 acc[R][4], total[R][4];
  for (int64_t p0 = 0; p0 < pairs; p0 += block_pairs) {  // one K block: partial sums from zero, then total += them
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    accumulate<R, false>(acc, w, x, ldx, p0, std::min(pairs, p0 + block_pairs), nullptr, 0);
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) total[r][j] = p0 == 0 ? acc[r][j] : _mm512_add_ps(total[r][j], acc[r][j]);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc_out + r * kBlockN + j * 16, total[r][j]);
}

using BlockFn = void (*)(const __m512i*, const uint32_t*, int64_t, int64_t, int64_t, float*);
constexpr BlockFn kBlockFns[4] = {block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>};

// rows [0, R) x one 64-output block over pairs [p0, p1), continuing the partial sums in `part` [R][64]; `ahead`
// (null for none): lines to fetch, `per` a pair.
template <int R>
void chunk_rows(const __m512i* w, const uint32_t* x, int64_t ldx, int64_t p0, int64_t p1, float* part,
                const __m512i* ahead, int per) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_loadu_ps(part + r * kBlockN + j * 16);
  if (ahead != nullptr) {
    accumulate<R, true>(acc, w, x, ldx, p0, p1, ahead, per);
  } else {
    accumulate<R, false>(acc, w, x, ldx, p0, p1, nullptr, 0);
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(part + r * kBlockN + j * 16, acc[r][j]);
}

using ChunkFn = void (*)(const __m512i*, const uint32_t*, int64_t, int64_t, int64_t, float*, const __m512i*,
                         int);
constexpr ChunkFn kChunkFns[4] = {chunk_rows<1>, chunk_rows<2>, chunk_rows<3>, chunk_rows<4>};
constexpr int64_t kChunkPairs = 64;  // 16 KiB of one block's weight: read from memory once, from L1 by each group

// rows [0, m) x one 64-output block, m > 4: K in chunks of kChunkPairs, each chunk run by every group of 4 rows
// while it sits in L1 (the groups' partial sums wait in `part`). Per lane the same additions in the same order as
// block_rows, so the same bits. -> total [m][64].
void block_many(const __m512i* w, const uint32_t* x, int64_t ldx, int64_t m, int64_t pairs, int64_t block_pairs,
                float* total, float* part) {
  for (int64_t p0 = 0; p0 < pairs; p0 += block_pairs) {
    const int64_t p1 = std::min(pairs, p0 + block_pairs);
    std::fill(part, part + m * kBlockN, 0.f);
    for (int64_t c0 = p0; c0 < p1; c0 += kChunkPairs) {
      const int64_t c1 = std::min(p1, c0 + kChunkPairs);
      // The groups share fetching the next chunk's 4 * len lines (in this block, or the next block's first), `per`
      // lines an iteration each, so the memory stream runs under the arithmetic.
      const int64_t len = c1 - c0, groups = (m + 3) / 4;
      const int per = static_cast<int>((4 + groups - 1) / groups);
      for (int64_t g0 = 0, g = 0; g0 < m; g0 += 4, ++g) {
        const __m512i* ahead = g * per < 4 ? w + 4 * c1 + g * per * len : nullptr;
        kChunkFns[std::min<int64_t>(4, m - g0) - 1](w, x + g0 * ldx, ldx, c0, c1, part + g0 * kBlockN, ahead, per);
      }
    }
    for (int64_t i = 0; i < m * kBlockN; ++i) total[i] = p0 == 0 ? part[i] : total[i] + part[i];
  }
}

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
  if (m == 0) return out;  // a prefill chunk that samples nothing
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(m * kBlockN), part(m > 4 ? m * kBlockN : 0);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = blk * kBlockN, width = std::min(kBlockN, n_out - n0);
      if (m <= 4) {
        kBlockFns[m - 1](w + blk * pairs * 4, xs, pairs, pairs, block_pairs, acc.data());
      } else {
        block_many(w + blk * pairs * 4, xs, pairs, m, pairs, block_pairs, acc.data(), part.data());
      }
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < width; ++j) {
          const float v = acc[r * kBlockN + j];
          o[r * n_out + n0 + j] = static_cast<c10::BFloat16>(b ? v + static_cast<float>(b[n0 + j]) : v);
        }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "x [M, K] @ W^T (+ bias) from oneDNN's packed bf16 [N, K] weight at `address`");
  m.attr("block_n") = kBlockN;
  m.attr("name") = "packed_rows";
}

#else  // no AVX512-BF16: the module loads without the kernel and linears stay on oneDNN

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

#endif
