// Prefill attention straight from the paged KV cache, bfloat16 with AVX512-BF16 dot products (vdpbf16ps), or
// with both products on AMX tiles where the CPU has them (`tiles`, paged_prefill_amx.h; its own bits):
// the queries of each request's chunk attend to every key they can see (prefix, own keys causally, sliding
// window), read in place from the request's blocks. Scores, softmax and output accumulate in float32; the
// softmax weights are rounded to bfloat16 for the value product, as torch's CPU flash kernel does.
//
// q       [N, Hq, D]                  queries of B requests: rows [offsets[r], offsets[r + 1]) are request r's, at
//                                     positions [starts[r], starts[r] + n_r) (contiguous)
// cache   [num_blocks, bs, 2, Hk, D]  one layer's cache view (any strides, D contiguous); [:, :, 0] keys, 1 values
// tables  [B, span]                   request r's blocks from position bases[r] on (a multiple of bs)
// window                              0: key j visible to the query at p iff bases[r] <= j <= p; W: also p - j < W
// sinks   [Hq] or empty               per-head sink logit added to the softmax denominator
// out     [N, Hq, D]
//
// Keys are visited in blocks of kKeys at absolute multiples of kKeys, and every query row's arithmetic depends
// only on its own query, its visible keys and their positions: the same bits however the prompt was chunked,
// however queries were tiled, and on any thread count.
#include "../../models/kernels/torch_api.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../../models/kernels/amx.h"

#if defined(__AVX512BF16__)
#include "../../models/kernels/simd.h"

namespace {

constexpr int64_t kKeys = 64;      // keys per block: 4 vectors of scores per query row
constexpr int64_t kRows = 4;       // query rows per register block
constexpr int64_t kTileRows = 64;  // query rows (query x head of one KV head) per task


// One KV head's keys and values [kb0 * kKeys, (kb1 + 1) * kKeys), repacked for vdpbf16ps (pairs of 16-bit lanes):
// keys   k32[block][d / 2][key]   (32-bit: dims 2i, 2i + 1 of one key), scores of 16 keys per vector;
// values v16[block][key / 2][d][2] (keys 2j, 2j + 1 of one dim), outputs of 16 dims per vector.
// Keys outside [key_lo, key_hi] are zero (and masked).
struct PackedHead {
  std::vector<uint32_t> k32;
  std::vector<uint16_t> v16;
};

void pack_head(PackedHead& out, const uint16_t* cache, const int64_t* table, int64_t base, int64_t key_lo,
               int64_t key_hi, int64_t kb0, int64_t blocks, int64_t h, int64_t d, int64_t bs, int64_t s_block,
               int64_t s_tok, int64_t s_kv, int64_t s_head) {
  out.k32.assign(blocks * kKeys * d / 2, 0);
  out.v16.assign(blocks * kKeys * d, 0);
  for (int64_t j = key_lo; j <= key_hi; ++j) {
    const int64_t local = j - base, b = j / kKeys - kb0, jj = j % kKeys;
    const uint16_t* k = cache + table[local / bs] * s_block + (local % bs) * s_tok + h * s_head;
    const uint16_t* v = k + s_kv;
    uint32_t* kd = out.k32.data() + b * kKeys * d / 2 + jj;
    for (int64_t i = 0; i < d / 2; ++i) std::memcpy(kd + i * kKeys, k + 2 * i, 4);
    uint16_t* vd = out.v16.data() + (b * kKeys / 2 + jj / 2) * d * 2 + (jj % 2);
    for (int64_t i = 0; i < d; ++i) vd[2 * i] = v[i];
  }
}

// One row's raw scores against key block kb (4 vectors of 16 keys) -> its softmax weights in bfloat16 (p16,
// zero where masked), the factor its running output is scaled by, and its running max m and sum l. A key j is
// visible iff lo <= j <= pos.
inline void softmax_row(__m512 (&s)[4], int64_t kb, int64_t lo, int64_t pos, float scale, uint16_t* p16,
                        float& corr, float& m, float& l) {
  __mmask16 vis[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
  if (lo > kb * kKeys || pos < kb * kKeys + kKeys - 1) {  // a block partly out of view (the all-visible masks
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);  // change nothing)
    for (int64_t c = 0; c < 4; ++c) {
      const __m512i j = _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(kb * kKeys + c * 16)));
      vis[c] = _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32(static_cast<int32_t>(lo))) &
               _mm512_cmple_epi32_mask(j, _mm512_set1_epi32(static_cast<int32_t>(pos)));
    }
  }
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < 4; ++c) {
    s[c] = _mm512_mul_ps(s[c], _mm512_set1_ps(scale));
    mx = _mm512_mask_max_ps(mx, vis[c], mx, s[c]);
  }
  const float top = std::max(m, _mm512_reduce_max_ps(mx));
  if (top == -std::numeric_limits<float>::infinity()) {  // nothing visible to this row yet
    corr = 1.f;
    std::memset(p16, 0, kKeys * sizeof(uint16_t));
    return;
  }
  corr = top == m ? 1.f : std::exp(m - top);  // e^0 is 1: no call while the max holds
  __m512 sum = _mm512_setzero_ps();
  __m512 e[4];
  for (int64_t c = 0; c < 4; ++c) {
    e[c] = _mm512_maskz_mov_ps(vis[c], exp16(_mm512_sub_ps(s[c], _mm512_set1_ps(top))));
    sum = _mm512_add_ps(sum, e[c]);
  }
  l = l * corr + _mm512_reduce_add_ps(sum);
  m = top;
  _mm512_storeu_si512(p16, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
  _mm512_storeu_si512(p16 + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
}

// o [RB][d] columns [c0 * 16, (c0 + TV) * 16) = o * corr + p16 . V over one key block; TV 0: the head's last
// d / 16 - c0 < 4 vectors, counted at run time.
template <int64_t RB, int64_t TV>
inline void value_tile(const uint16_t (*p16)[kKeys], const float* corr, const uint16_t* vp, int64_t d, int64_t c0,
                       float* o) {
  const int64_t tv = TV > 0 ? TV : std::min<int64_t>(4, d / 16 - c0);
  __m512 acc[RB][4];
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t c = 0; c < tv; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * d + (c0 + c) * 16), _mm512_set1_ps(corr[r]));
  for (int64_t j = 0; j < kKeys / 2; ++j) {
    __m512bh vv[4];
    for (int64_t c = 0; c < tv; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (j * d + (c0 + c) * 16) * 2);
    for (int64_t r = 0; r < RB; ++r) {
      int32_t pair;
      std::memcpy(&pair, p16[r] + 2 * j, 4);
      const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
      for (int64_t c = 0; c < tv; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
    }
  }
  for (int64_t r = 0; r < RB; ++r)
    for (int64_t c = 0; c < tv; ++c) _mm512_storeu_ps(o + r * d + (c0 + c) * 16, acc[r][c]);
}

// Rows [r0, r0 + rb) of a tile (row = query x head) against key block `blk` (absolute index kb).
// o [rows][d] float32, m / l [rows]: running output (unnormalised), max and sum.
// RB: the rows, a compile-time count so that the score and output registers stay registers (indexed by a
// runtime count they live on the stack).
template <int64_t RB>
inline void block_rows(const uint16_t* const* qrow, const int64_t* pos, const int64_t* lo, const PackedHead& ph,
                       int64_t blk, int64_t kb, int64_t d, float scale, float* o, float* m, float* l) {
  constexpr int64_t rb = RB;
  const uint32_t* kp = ph.k32.data() + blk * kKeys * d / 2;
  const uint16_t* vp = ph.v16.data() + blk * kKeys * d;
  __m512 s[kRows][4];
  for (int64_t r = 0; r < kRows; ++r)
    for (int64_t c = 0; c < 4; ++c) s[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d / 2; ++i) {
    __m512bh kv[4];
    for (int64_t c = 0; c < 4; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + i * kKeys + c * 16);
    for (int64_t r = 0; r < rb; ++r) {
      int32_t pair;
      std::memcpy(&pair, qrow[r] + 2 * i, 4);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
      for (int64_t c = 0; c < 4; ++c) s[r][c] = _mm512_dpbf16_ps(s[r][c], qb, kv[c]);
    }
  }
  alignas(64) uint16_t p16[kRows][kKeys];
  float corr[kRows];
  for (int64_t r = 0; r < rb; ++r) softmax_row(s[r], kb, lo[r], pos[r], scale, p16[r], corr[r], m[r], l[r]);
  for (int64_t c0 = 0; c0 < d / 16; c0 += 4) {
    if (d / 16 - c0 >= 4)
      value_tile<RB, 4>(p16, corr, vp, d, c0, o);
    else
      value_tile<RB, 0>(p16, corr, vp, d, c0, o);
  }
}

using RowsKernel = void (*)(const uint16_t* const*, const int64_t*, const int64_t*, const PackedHead&, int64_t,
                           int64_t, int64_t, float, float*, float*, float*);

RowsKernel rows_kernel(int64_t rb) {
  static_assert(kRows == 4, "one instance per row count up to kRows");
  constexpr RowsKernel kernels[] = {block_rows<1>, block_rows<2>, block_rows<3>, block_rows<4>};
  return kernels[rb - 1];
}

// The vector path: one task's rows [0, rows) against its key blocks, kRows rows a register block.
void run_vectors(const uint16_t* const* qrow, const int64_t* pos, const int64_t* lo, int64_t rows,
                 const PackedHead& ph, int64_t kb0, int64_t d, float scale, float* o, float* m, float* l) {
  for (int64_t kb = lo[0] / kKeys; kb <= pos[rows - 1] / kKeys; ++kb)
    for (int64_t i0 = 0; i0 < rows; i0 += kRows)
      rows_kernel(std::min(kRows, rows - i0))(qrow + i0, pos + i0, lo + i0, ph, kb - kb0, kb, d, scale, o + i0 * d,
                                              m + i0, l + i0);
}

#include "paged_prefill_amx.h"

}  // namespace

constexpr bool kSupported = true;

torch::Tensor paged_prefill(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
                            const torch::Tensor& bases, const torch::Tensor& starts, const torch::Tensor& offsets,
                            int64_t window, double scale, const c10::optional<torch::Tensor>& sinks, bool tiles) {
  TORCH_CHECK(!tiles || (kTiles && tiles_granted()), "paged_prefill: no AMX tiles on this CPU (or not granted)");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16,
              "q must be a contiguous bfloat16 [N, Hq, D] tensor");
  TORCH_CHECK(cache.dim() == 5 && cache.stride(4) == 1 && cache.scalar_type() == at::kBFloat16,
              "cache must be bfloat16 [num_blocks, block_size, 2, Hk, D], D contiguous");
  for (const auto* t : {&tables, &bases, &starts, &offsets})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong, "tables, bases, starts, offsets: int64");
  const int64_t hq = q.size(1), d = q.size(2), hk = cache.size(3), bs = cache.size(1);
  const int64_t b = tables.size(0), span = tables.size(1);
  TORCH_CHECK(d == cache.size(4) && hq % hk == 0 && d % 32 == 0, "head sizes disagree or D is not a multiple of 32");
  TORCH_CHECK(bases.numel() == b && starts.numel() == b && offsets.numel() == b + 1, "one base and start a request");
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* base = bases.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[b] == q.size(0), "query offsets must cover q");
  std::vector<int64_t> key_lo(b), kb0(b), blocks(b);
  for (int64_t r = 0; r < b; ++r) {
    const int64_t n = off[r + 1] - off[r];
    TORCH_CHECK(n > 0 && base[r] % bs == 0 && start[r] >= base[r] && start[r] + n - base[r] <= span * bs,
                "queries outside their block table");
    key_lo[r] = window > 0 ? std::max(base[r], start[r] - window + 1) : base[r];
    kb0[r] = key_lo[r] / kKeys;
    blocks[r] = (start[r] + n - 1) / kKeys - kb0[r] + 1;
  }
  const uint16_t* cp = reinterpret_cast<const uint16_t*>(cache.data_ptr<at::BFloat16>());
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  torch::Tensor sink_f;
  if (sinks.has_value()) sink_f = sinks->to(at::kFloat).contiguous();
  const float* sink_p = sinks.has_value() ? sink_f.data_ptr<float>() : nullptr;
  std::vector<PackedHead> packed(b * hk);  // [request][KV head]
  at::parallel_for(0, b * hk, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / hk, h = task % hk;
      pack_head(packed[task], cp, tab + r * span, base[r], key_lo[r], start[r] + off[r + 1] - off[r] - 1, kb0[r],
                blocks[r], h, d, bs, cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3));
    }
  });
  // Tasks: (request, KV head, tile of queries); row t * groups + g of a tile is query t0 + t, head h * groups + g.
  const int64_t groups = hq / hk, tile_q = std::max<int64_t>(1, kTileRows / groups);
  std::vector<int64_t> first_task(b + 1, 0);
  for (int64_t r = 0; r < b; ++r) first_task[r + 1] = first_task[r] + hk * ((off[r + 1] - off[r] + tile_q - 1) / tile_q);
  std::vector<int64_t> task_req(first_task[b]);
  for (int64_t r = 0; r < b; ++r) std::fill(task_req.begin() + first_task[r], task_req.begin() + first_task[r + 1], r);
  auto out = torch::empty_like(q);
  const float fscale = static_cast<float>(scale);
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, first_task[b], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o, m, l;
    std::vector<const uint16_t*> qrow;
    std::vector<uint16_t> qtile;  // tiles: the task's query rows, contiguous, zero rows up to a multiple of 16
    std::vector<int64_t> pos, lo;
    if (tiles) configure_prefill_tiles();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task_req[task], n = off[r + 1] - off[r], q_tiles = (n + tile_q - 1) / tile_q;
      const int64_t h = (task - first_task[r]) / q_tiles, t0 = ((task - first_task[r]) % q_tiles) * tile_q;
      const int64_t rows = (std::min(n, t0 + tile_q) - t0) * groups, padded = (rows + 15) / 16 * 16;
      o.assign(padded * d, 0.f);
      m.assign(rows, -std::numeric_limits<float>::infinity());
      l.assign(rows, 0.f);
      qrow.resize(rows);
      pos.resize(rows);
      lo.resize(rows);
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = off[r] + t0 + i / groups, head = h * groups + i % groups;
        qrow[i] = qp + (t * hq + head) * d;
        pos[i] = start[r] + t0 + i / groups;
        lo[i] = window > 0 ? std::max(base[r], pos[i] - window + 1) : base[r];
      }
      const PackedHead& ph = packed[r * hk + h];
      if (tiles) {
        qtile.assign(padded * d, 0);
        for (int64_t i = 0; i < rows; ++i) std::memcpy(qtile.data() + i * d, qrow[i], d * 2);
        run_tiles(qtile.data(), pos.data(), lo.data(), rows, ph, kb0[r], d, fscale, o.data(), m.data(), l.data());
      } else {
        run_vectors(qrow.data(), pos.data(), lo.data(), rows, ph, kb0[r], d, fscale, o.data(), m.data(), l.data());
      }
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t t = off[r] + t0 + i / groups, head = h * groups + i % groups;
        const float inv = 1.f / (l[i] + (sink_p ? std::exp(sink_p[head] - m[i]) : 0.f));
        for (int64_t k = 0; k < d; k += 16)  // d is a multiple of 32; store16 rounds as at::BFloat16 does
          store16(reinterpret_cast<c10::BFloat16*>(op + (t * hq + head) * d + k),
                  _mm512_mul_ps(_mm512_loadu_ps(o.data() + i * d + k), _mm512_set1_ps(inv)));
      }
    }
    if (tiles) release_tiles();
  });
  return out;
}

#else

constexpr bool kSupported = false;

torch::Tensor paged_prefill(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                            const torch::Tensor&, const torch::Tensor&, int64_t, double,
                            const c10::optional<torch::Tensor>&, bool) {
  TORCH_CHECK(false, "paged_prefill needs AVX512-BF16 (this build's CPU has none)");
  return {};
}

#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", &paged_prefill, "prefill attention read in place from a paged KV cache (bfloat16)",
        py::arg("q"), py::arg("cache"), py::arg("tables"), py::arg("bases"), py::arg("starts"), py::arg("offsets"),
        py::arg("window"), py::arg("scale"), py::arg("sinks"), py::arg("tiles") = false);
  m.attr("supported") = kSupported;
  m.attr("tiles") = kTiles && tiles_granted();  // AMX: built for it, and the kernel granted the tile state
}
