// Few-row bfloat16 linears on AMX tiles, read straight from oneDNN's packed weight as an AMX CPU's oneDNN packs
// it: y [M, N] = x [M, K] @ W^T (+ bias) for the M <= 32 rows of a decode step. The packed_rows kernel's sibling
// for the other packing: there oneDNN packs 64 outputs a block for VDPBF16PS, here 32 for its tiles.
//
//   weight  [Np/32][Kp/2][32][2]   Kp = K up to 32, Np = N up to 32, zero padded; one block's k pair is one
//                                  128-byte line of 32 outputs x 2, so a 16-pair B tile is 16 such lines and the
//                                  block's outputs [0, 16) and [16, 32) are its left and right 64 bytes
//   per block  C[rows][32] = sum over K tiles of A[rows][32 k] . B[16 k pairs][32][2], k in order, one
//              accumulator from zero; then the bias, then one rounding
//
// oneDNN's AMX brgemm sums the same way: a row's bits equal oneDNN's at every row count (measured on the shapes
// the tests list, 1-32 rows, torch 2.13), which the caller's load-time probe checks before trusting an address.
// The stream: a block's Kp * 64 bytes are read once for all rows; lines a few K tiles ahead are prefetched.
#include "torch_api.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int64_t kBlockN = 32;     // outputs per weight block: two 16-column accumulator tiles
constexpr int64_t kAhead = 4;       // K tiles (2 KiB of weight each) prefetched ahead of the one in use

// Tiles 0-3 accumulators (rows of group 0: 0, 1; group 1: 2, 3), 4-5 the groups' x, 6-7 weight.
void configure(int64_t rows0, int64_t rows1) {
  const uint8_t r0 = static_cast<uint8_t>(rows0), r1 = static_cast<uint8_t>(std::max<int64_t>(rows1, 1));
  configure_tiles({r0, r0, r1, r1, r0, r1, 16, 16});
}

// One 32-output block: acc [m][32] float32 (stride 32) = xs [m][kp] . block, m <= 32.
template <bool kTwoGroups>
void block(const uint16_t* w, const uint16_t* xs, int64_t kp, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwoGroups) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < kp; k0 += 32) {
    const char* ahead = reinterpret_cast<const char*>(w + (k0 + kAhead * 32) * kBlockN);
    if (k0 + kAhead * 32 < kp)
      for (int j = 0; j < 32; ++j) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
    _tile_loadd(6, w + k0 * kBlockN, kBlockN * 4);
    _tile_loadd(7, w + k0 * kBlockN + 32, kBlockN * 4);
    _tile_loadd(4, xs + k0, kp * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwoGroups) {
      _tile_loadd(5, xs + 16 * kp + k0, kp * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, kBlockN * 4);
  _tile_stored(1, acc + 16, kBlockN * 4);
  if constexpr (kTwoGroups) {
    _tile_stored(2, acc + 16 * kBlockN, kBlockN * 4);
    _tile_stored(3, acc + 16 * kBlockN + 16, kBlockN * 4);
  }
}

}  // namespace

torch::Tensor linear_rows(const torch::Tensor& x, int64_t address, int64_t n_out, int64_t k_in,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(tiles_granted(), "packed_tiles: the OS did not grant the AMX tile state");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be [M, K] bfloat16 rows");
  TORCH_CHECK(x.size(0) <= 32, "packed_tiles takes at most 32 rows, got ", x.size(0));
  TORCH_CHECK(x.size(1) == k_in, "x has ", x.size(1), " features, the weight ", k_in);
  TORCH_CHECK(address != 0 && address % 64 == 0, "the packed weight's address must be 64-byte aligned");
  if (bias) TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n_out,
                        "bias must be bfloat16 [N]");
  const int64_t m = x.size(0), kp = (k_in + 31) / 32 * 32, blocks = (n_out + kBlockN - 1) / kBlockN;
  auto out = torch::empty({m, n_out}, x.options());
  if (m == 0) return out;  // a prefill chunk that samples nothing
  // rows zero padded to Kp (oneDNN pads the weight with zeros) and, past the last row, to whole tiles
  std::vector<uint16_t> xs((m > 16 ? 32 : 16) * kp, 0);
  for (int64_t r = 0; r < m; ++r)
    std::memcpy(xs.data() + r * kp, reinterpret_cast<const uint16_t*>(x.data_ptr()) + r * x.stride(0), k_in * 2);
  const auto* w = reinterpret_cast<const uint16_t*>(address);
  const c10::BFloat16* b = bias ? bias->data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    alignas(64) float acc[32 * kBlockN];
    configure(std::min<int64_t>(m, 16), m - 16);
    for (int64_t blk = b0; blk < b1; ++blk) {
      if (m > 16)
        block<true>(w + blk * kp * kBlockN, xs.data(), kp, acc);
      else
        block<false>(w + blk * kp * kBlockN, xs.data(), kp, acc);
      const int64_t n0 = blk * kBlockN, width = std::min(kBlockN, n_out - n0);
      for (int64_t r = 0; r < m; ++r)
        for (int64_t j = 0; j < width; ++j) {
          const float v = acc[r * kBlockN + j];
          o[r * n_out + n0 + j] = static_cast<c10::BFloat16>(b ? v + static_cast<float>(b[n0 + j]) : v);
        }
    }
    _tile_release();
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_rows", &linear_rows, "x [M, K] @ W^T (+ bias) from oneDNN's AMX-packed bf16 [N, K] weight");
  m.attr("supported") = tiles_granted();
  m.attr("block_n") = kBlockN;
  m.attr("name") = "packed_tiles";
}

#else  // no AMX: the module loads without the kernel and linears stay on oneDNN

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.attr("supported") = false; }

#endif
