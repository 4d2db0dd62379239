// One-token recurrent-state steps that read each request's state where it lives in the block pool and write the
// state after the step to its destination entry: the same pages while a request decodes inside a block (in
// place), fresh pages once its step crosses a block end (copy-on-write without a separate copy).
//
// A state entry is a blob of bytes (`kv/state_plan.py`) cut into P segments: segment s holds blob bytes
// [starts[s], starts[s + 1]) at address addr[s] (one segment per page in the packed layout, one per page and
// region in the per-layer layout). Request r's source and destination segments are rows r of `src` and `dst`.
//
//   blob   |conv 0|ssm 0 (head 0 | head 1 | ...)|conv 1|ssm 1 ...|      one layer's slot: conv, then recurrent
//   pages  |  page 0      |  page 1      |  page 2      | ...             a head may straddle a page end
//
// Each (request, head) reads its [dk, dv] matrix row by row into a private buffer (64 KiB for Qwen3.5 in float32:
// it stays in L2) and writes it out row by row: the pool's bytes are read once and written once per step.
//
// Bits: the same as `models/gated_deltanet.gated_delta_step` and `causal_conv1d` in torch, by construction: the
// same float32 operations in the same order (sums run over dk in index order, one rounding per operation, no
// fused multiply-add: fp-contract is off for this file), whatever the batch or the thread count.
#pragma GCC optimize("fp-contract=off")

#include "../../models/kernels/torch_api.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "state_blob.h"
#include "state_rows.h"

namespace {

void check_blobs(const torch::Tensor& src, const torch::Tensor& dst, const torch::Tensor& starts, int64_t n,
                 int64_t end) {
  TORCH_CHECK(src.dtype() == torch::kInt64 && dst.dtype() == torch::kInt64 && starts.dtype() == torch::kInt64);
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous() && starts.is_contiguous());
  TORCH_CHECK(src.dim() == 2 && src.sizes() == dst.sizes() && src.size(0) == n);
  TORCH_CHECK(starts.numel() == src.size(1) + 1 && starts.data_ptr<int64_t>()[0] == 0);
  TORCH_CHECK(end <= starts.data_ptr<int64_t>()[src.size(1)], "the slot runs past the state blob");
}

// One request's window rows where they lie: rows[k] is row k's address, or null when some row straddles a segment
// end (then the caller gathers).
template <typename W>
bool window_rows(const Blob& blob, int64_t offset, int64_t rows, int64_t dim, W** out) {
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(W));
  for (int64_t k = 0; k < rows; ++k) {
    out[k] = reinterpret_cast<W*>(blob.span(offset + k * row_bytes, row_bytes));
    if (out[k] == nullptr) return false;
  }
  return true;
}

template <typename X, typename W>
void conv_rows(const X* x, const float* taps, X* y, int64_t taps_n, int64_t dim, const int64_t* src,
               const int64_t* dst, const int64_t* starts, int64_t segments, int64_t offset, int64_t r0, int64_t r1) {
  const int64_t keep = (taps_n - 1) * dim;  // the window: K - 1 rows of `dim`, oldest first
  std::vector<W> window(keep);
  std::vector<float> acc(dim);
  std::vector<W*> from(taps_n - 1), to(taps_n - 1);
  for (int64_t r = r0; r < r1; ++r) {
    const Blob source{starts, src + r * segments, segments}, dest{starts, dst + r * segments, segments};
    const X* xr = x + r * dim;
    // Rows where they lie (the common case) or gathered into `window`; the same sums either way.
    const bool direct = window_rows(source, offset, taps_n - 1, dim, from.data()) &&
                        window_rows(dest, offset, taps_n - 1, dim, to.data());
    if (!direct) {
      source.copy<true>(offset, keep * sizeof(W), reinterpret_cast<uint8_t*>(window.data()));
      for (int64_t k = 0; k < taps_n - 1; ++k) from[k] = to[k] = window.data() + k * dim;
    }
    // y = xp[0] * w[0] + xp[1] * w[1] + ... over xp = (window rows, x), left to right
    for (int64_t d = 0; d < dim; ++d) acc[d] = static_cast<float>(from[0][d]) * taps[d];
    for (int64_t k = 1; k < taps_n - 1; ++k) {
      for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] + static_cast<float>(from[k][d]) * taps[k * dim + d];
    }
    const float* last = taps + (taps_n - 1) * dim;
    for (int64_t d = 0; d < dim; ++d) {
      acc[d] = acc[d] + static_cast<float>(xr[d]) * last[d];
      y[r * dim + d] = static_cast<X>(acc[d]);
    }
    // The window moves on by one row, oldest first (so in place, each row is read before it is overwritten).
    for (int64_t k = 0; k + 1 < taps_n - 1; ++k) std::memcpy(to[k], from[k + 1], dim * sizeof(W));
    for (int64_t d = 0; d < dim; ++d) to[taps_n - 2][d] = static_cast<W>(static_cast<float>(xr[d]));
    if (!direct) dest.copy<false>(offset, keep * sizeof(W), reinterpret_cast<uint8_t*>(window.data()));
  }
}

// conv_step(x [N, D] float32|bfloat16, taps [K, D] float32, src [N, P], dst [N, P], starts [P + 1], offset,
// window_bf16) -> y [N, D]: the causal conv's output for each request's one new input, the window (K - 1 rows of
// D, float32 or bfloat16 when window_bf16) moving on by one row from src to dst.
torch::Tensor conv_step(const torch::Tensor& x, const torch::Tensor& taps, const torch::Tensor& src,
                        const torch::Tensor& dst, const torch::Tensor& starts, int64_t offset, bool window_bf16) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.dtype() == torch::kFloat32 || x.dtype() == torch::kBFloat16));
  TORCH_CHECK(taps.dim() == 2 && taps.is_contiguous() && taps.dtype() == torch::kFloat32);
  const int64_t n = x.size(0), dim = x.size(1), taps_n = taps.size(0);
  TORCH_CHECK(taps.size(1) == dim && taps_n >= 2 && offset >= 0);
  const int64_t window_bytes = (taps_n - 1) * dim * (window_bf16 ? 2 : 4);
  check_blobs(src, dst, starts, n, offset + window_bytes);
  auto y = torch::empty_like(x);
  const int64_t segments = src.size(1);
  const int64_t *s = src.data_ptr<int64_t>(), *d = dst.data_ptr<int64_t>(), *st = starts.data_ptr<int64_t>();
  const float* w = taps.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    if (x.dtype() == torch::kFloat32) {
      const float* xp = x.data_ptr<float>();
      float* yp = y.data_ptr<float>();
      if (window_bf16) {
        conv_rows<float, c10::BFloat16>(xp, w, yp, taps_n, dim, s, d, st, segments, offset, r0, r1);
      } else {
        conv_rows<float, float>(xp, w, yp, taps_n, dim, s, d, st, segments, offset, r0, r1);
      }
    } else {
      const auto* xp = x.data_ptr<c10::BFloat16>();
      auto* yp = y.data_ptr<c10::BFloat16>();
      if (window_bf16) {
        conv_rows<c10::BFloat16, c10::BFloat16>(xp, w, yp, taps_n, dim, s, d, st, segments, offset, r0, r1);
      } else {
        conv_rows<c10::BFloat16, float>(xp, w, yp, taps_n, dim, s, d, st, segments, offset, r0, r1);
      }
    }
  });
  return y;
}

// Where one (request, head)'s state lives in a blob: its rows from byte `at`, for int8 its row scales from byte
// `scale_at` (float32, one per row).
struct HeadAt {
  int64_t at;
  int64_t scale_at;
};

// The cache lines of the next row of `walk` on their way in (a straddling row is left to the hardware).
inline void prefetch_row(RowWalk& walk) {
  if (const uint8_t* row = walk.next()) {
    for (int64_t b = 0; b < walk.row_bytes; b += 64) __builtin_prefetch(row + b);
  }
}

// One (request, head): the [dk, dv] state, stored as `kind`, stepped in float32.
// Pass 1 reads each row where it lies in the pool, keeps it decayed in `state` (L2-sized) and folds it into pred;
// pass 2 steps each row and writes it to the destination at once. Both passes prefetch half the next head's rows
// (`next`, null for none): the pool's bytes stream in once and out once, and the arithmetic overlaps the memory
// traffic. row_buf [dv * 5 bytes]: a float32 row, then int8 codes (int8 rows, and a row that straddles a segment
// end, are gathered or scattered through it; every other row is read and written where it lies).
template <Storage kind>
void delta_head(const Blob& src, const Blob& dst, HeadAt head, int64_t dk, int64_t dv, const float* __restrict q,
                const float* __restrict k, const float* __restrict v, float g, float bt, float* __restrict o,
                uint8_t* __restrict row_buf, float* __restrict state, float* __restrict pred,
                float* __restrict delta, const Blob* next, HeadAt next_head) {
  using Item =
      std::conditional_t<kind == kFloat32, float, std::conditional_t<kind == kBFloat16, c10::BFloat16, int8_t>>;
  const int64_t row_bytes = dv * static_cast<int64_t>(sizeof(Item)), at = head.at;
  const int64_t size = dk * row_bytes;
  RowWalk from{src, at, row_bytes, at + size}, to{dst, at, row_bytes, at + size};
  RowWalk ahead{next != nullptr ? *next : src, next_head.at, row_bytes, next_head.at + size};
  std::fill(pred, pred + dv, 0.f);
  for (int64_t i = 0; i < dk; ++i) {  // half the next head's rows start on their way in during this pass
    if (next != nullptr && i % 2 == 0) prefetch_row(ahead);
    float* __restrict si = state + i * dv;
    if constexpr (kind == kInt8) {
      float scale;
      src.copy<true>(head.scale_at + i * 4, 4, reinterpret_cast<uint8_t*>(&scale));
      src.copy<true>(at + i * row_bytes, row_bytes, row_buf + dv * 4);
      dequantize_row(reinterpret_cast<const int8_t*>(row_buf + dv * 4), scale, reinterpret_cast<float*>(row_buf), dv);
      decay_row(reinterpret_cast<const float*>(row_buf), g, k[i], si, pred, dv);
    } else {
      const auto* row = reinterpret_cast<const Item*>(from.next());
      if (row == nullptr) {  // the row straddles a segment end: gathered
        src.copy<true>(at + i * row_bytes, row_bytes, row_buf);
        row = reinterpret_cast<const Item*>(row_buf);
      }
      decay_row(row, g, k[i], si, pred, dv);
    }
  }
  for (int64_t j = 0; j < dv; ++j) delta[j] = (v[j] - pred[j]) * bt;
  std::fill(o, o + dv, 0.f);
  auto* buf = reinterpret_cast<float*>(row_buf);
  for (int64_t i = 0; i < dk; ++i) {  // and the other half during this one
    if (next != nullptr && i % 2 == 0) prefetch_row(ahead);
    const float* si = state + i * dv;
    if constexpr (kind == kFloat32) {
      auto* row = reinterpret_cast<float*>(to.next());
      step_row(si, k[i], delta, q[i], o, row != nullptr ? row : buf, dv);
      if (row == nullptr) dst.copy<false>(at + i * row_bytes, row_bytes, row_buf);
    } else if constexpr (kind == kBFloat16) {
      auto* row = reinterpret_cast<c10::BFloat16*>(to.next());
      step_row(si, k[i], delta, q[i], o, row != nullptr ? row : reinterpret_cast<c10::BFloat16*>(row_buf), dv);
      if (row == nullptr) dst.copy<false>(at + i * row_bytes, row_bytes, row_buf);
    } else {
      step_row(si, k[i], delta, q[i], o, buf, dv);
      float scale = quantize_row(buf, reinterpret_cast<int8_t*>(row_buf) + dv * 4, dv);
      dst.copy<false>(at + i * row_bytes, row_bytes, row_buf + dv * 4);
      dst.copy<false>(head.scale_at + i * 4, 4, reinterpret_cast<uint8_t*>(&scale));
    }
  }
}

// delta_step(q, k [N, H, dk], v [N, H, dv], decay, beta [N, H], src, dst, starts, offset, storage) -> out
// [N, H, dv], all float32: one token of the gated delta rule per request and head on the state S [H, dk, dv] at
// blob byte `offset`, stored as `storage` (`Storage`: float32; bfloat16, widened and rounded back; int8 rows
// [H, dk, dv] then, 64-byte aligned, their float32 scales [H, dk]), stepped in float32, with decay = exp(g):
//   pred   = sum_i (decay S[i]) k_i            delta = (v - pred) beta
//   S'[i]  = decay S[i] + k_i delta            out   = sum_i q_i S'[i]
torch::Tensor delta_step(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& decay, const torch::Tensor& beta, const torch::Tensor& src,
                         const torch::Tensor& dst, const torch::Tensor& starts, int64_t offset, int64_t storage) {
  for (const auto* t : {&q, &k, &v, &decay, &beta}) TORCH_CHECK(t->dtype() == torch::kFloat32 && t->is_contiguous());
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && v.dim() == 3 && offset >= 0);
  TORCH_CHECK(storage == kFloat32 || storage == kBFloat16 || storage == kInt8, "storage: 0, 1 or 2");
  const int64_t n = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(v.size(0) == n && v.size(1) == heads && decay.numel() == n * heads && beta.numel() == n * heads);
  const int64_t item = storage == kFloat32 ? 4 : storage == kBFloat16 ? 2 : 1;
  const int64_t codes = heads * dk * dv * item;
  const int64_t scales = storage == kInt8 ? (codes + 63) / 64 * 64 : codes;  // where int8 row scales begin
  check_blobs(src, dst, starts, n, offset + (storage == kInt8 ? scales + heads * dk * 4 : codes));
  auto out = torch::empty_like(v);
  const int64_t segments = src.size(1);
  const int64_t *s = src.data_ptr<int64_t>(), *d = dst.data_ptr<int64_t>(), *st = starts.data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = decay.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto head_at = [&](int64_t h) { return HeadAt{offset + h * dk * dv * item, offset + scales + h * dk * 4}; };
  at::parallel_for(0, n * heads, 1, [&](int64_t b, int64_t e) {
    std::vector<float> state(dk * dv), pred(dv), delta(dv);
    std::vector<uint8_t> row(dv * 5);  // a float32 row, then int8 codes
    for (int64_t rh = b; rh < e; ++rh) {
      const int64_t r = rh / heads, h = rh % heads;
      const Blob from{st, s + r * segments, segments}, to{st, d + r * segments, segments};
      const float *qr = qp + rh * dk, *kr = kp + rh * dk, *vr = vp + rh * dv;
      float* o = op + rh * dv;
      const int64_t nr = (rh + 1) / heads, nh = (rh + 1) % heads;
      const Blob ahead{st, s + nr * segments, segments};
      const Blob* next = rh + 1 < e ? &ahead : nullptr;
      if (storage == kBFloat16) {
        delta_head<kBFloat16>(from, to, head_at(h), dk, dv, qr, kr, vr, gp[rh], bp[rh], o, row.data(),
                              state.data(), pred.data(), delta.data(), next, head_at(nh));
      } else if (storage == kInt8) {
        delta_head<kInt8>(from, to, head_at(h), dk, dv, qr, kr, vr, gp[rh], bp[rh], o, row.data(), state.data(),
                          pred.data(), delta.data(), next, head_at(nh));
      } else {
        delta_head<kFloat32>(from, to, head_at(h), dk, dv, qr, kr, vr, gp[rh], bp[rh], o, row.data(),
                             state.data(), pred.data(), delta.data(), next, head_at(nh));
      }
    }
#if defined(__AVX512F__)
    _mm_sfence();  // the streamed rows are visible before the step returns
#endif
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("conv_step", &conv_step, "causal conv, one token per request, window in the block pool");
  m.def("delta_step", &delta_step, "gated delta rule, one token per request, state in the block pool");
}
