// Decode attention straight from the paged KV cache: one query token per request, keys and values read in place
// from their blocks (no gather of the context into a contiguous copy), softmax online in float32.
//
// q       [B, Hq, D]                  query of each request (contiguous)
// cache   [num_blocks, bs, 2, Hk, D]  one layer's cache view (any strides, D contiguous); [:, :, 0] keys, 1 values
// tables  [B, span]                   request b's blocks from its `bases[b] / bs`-th block on (0 = null block)
// bases   [B]                         absolute position of tables[b][0]'s first slot
// positions [B]                       the query's absolute position: keys [lo, positions[b]] are visible,
//                                     lo = max(bases[b], positions[b] - window + 1) (window 0: full attention)
// sinks   [Hq] or empty               per-head sink logit added to the softmax denominator (attention sinks)
// out     [B, Hq, D]
//
// Each request's visible keys are cut into splits of kSplit positions (at absolute multiples of kSplit), one task
// each, merged in order: a request's result depends only on its own keys, not on the batch or the thread count.
#include "../../models/kernels/torch_api.h"

#include <ATen/Parallel.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kChunk = 32;   // keys per online-softmax update
constexpr int64_t kSplit = 512;  // keys per task: long contexts split over threads, merged by their softmax sums

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

// Four independent 16-wide partial sums (64 lanes): a single vector accumulator would chain every FMA.
inline float dot(const float* a, const float* b, int64_t n) {
  float part[64] = {0.f};
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
#pragma omp simd
    for (int64_t j = 0; j < 64; ++j) part[j] += a[i + j] * b[i + j];
  }
  float s = 0.f;
  for (; i < n; ++i) s += a[i] * b[i];
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < 64; ++j) s += part[j];
  return s;
}

// Keys [t0, t1) of one request, all heads: each token's keys (and then values) for every KV head are one
// contiguous row, read in order. Leaves the unnormalised output `acc` [Hq, D], the running max `m` and the sum `l`.
template <typename T>
void split_task(const T* q, const T* cache, const int64_t* table, int64_t base, int64_t t0, int64_t t1,
                float* acc, float* m, float* l, int64_t hq, int64_t groups, int64_t d, int64_t bs, int64_t s_block,
                int64_t s_tok, int64_t s_kv, int64_t s_head, float scale) {
  const int64_t hk = hq / groups;
  std::vector<float> qf(hq * d), row(hk * d), scores(hq * kChunk);
  to_float(q, qf.data(), hq * d);
  for (int64_t i = 0; i < hq * d; ++i) qf[i] *= scale;
  std::fill(acc, acc + hq * d, 0.f);
  std::fill(m, m + hq, -std::numeric_limits<float>::infinity());
  std::fill(l, l + hq, 0.f);
  for (int64_t c0 = t0; c0 < t1; c0 += kChunk) {
    const int64_t n = std::min(kChunk, t1 - c0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t local = c0 + t - base;
      const T* k = cache + table[local / bs] * s_block + (local % bs) * s_tok;
      for (int64_t h = 0; h < hk; ++h) to_float(k + h * s_head, row.data() + h * d, d);
      for (int64_t h = 0; h < hq; ++h) scores[h * kChunk + t] = dot(qf.data() + h * d, row.data() + (h / groups) * d, d);
    }
    for (int64_t h = 0; h < hq; ++h) {
      float* s = scores.data() + h * kChunk;
      float mx = m[h];
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
      const float corr = std::exp(m[h] - mx);
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - mx);
        sum += s[t];
      }
      l[h] = l[h] * corr + sum;
      m[h] = mx;
      float* a = acc + h * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) a[i] *= corr;
    }
    for (int64_t t = 0; t < n; ++t) {
      const int64_t local = c0 + t - base;
      const T* v = cache + table[local / bs] * s_block + (local % bs) * s_tok + s_kv;
      for (int64_t h = 0; h < hk; ++h) to_float(v + h * s_head, row.data() + h * d, d);
      for (int64_t h = 0; h < hq; ++h) {
        const float p = scores[h * kChunk + t];
        const float* vr = row.data() + (h / groups) * d;
        float* a = acc + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) a[i] += p * vr[i];
      }
    }
  }
}

#include "paged_decode_avx2.h"
#include "paged_decode_avx512.h"

torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
                           const torch::Tensor& bases, const torch::Tensor& positions, int64_t window, double scale,
                           const c10::optional<torch::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, Hq, D] tensor");
  TORCH_CHECK(cache.dim() == 5 && cache.stride(4) == 1, "cache must be [num_blocks, block_size, 2, Hk, D], D contiguous");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache dtypes differ");
  TORCH_CHECK(tables.scalar_type() == at::kLong && bases.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "tables, bases and positions must be int64");
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(2), hk = cache.size(3), bs = cache.size(1);
  TORCH_CHECK(d == cache.size(4) && hq % hk == 0, "head sizes of q and cache disagree");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == b && tables.is_contiguous(), "tables must be [B, span]");
  const int64_t groups = hq / hk, span = tables.size(1);
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* base = bases.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  torch::Tensor sink_f;
  if (sinks.has_value()) sink_f = sinks->to(at::kFloat).contiguous();
  const float* sink_p = sinks.has_value() ? sink_f.data_ptr<float>() : nullptr;
  // Splits of kSplit keys at absolute multiples of kSplit: a request's splits depend on its own positions only.
  std::vector<int64_t> lo(b), first_split(b + 1, 0);
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(pos[r] >= base[r] && pos[r] - base[r] < span * bs, "query position outside its block table");
    lo[r] = window > 0 ? std::max(base[r], pos[r] - window + 1) : base[r];
    first_split[r + 1] = first_split[r] + pos[r] / kSplit - lo[r] / kSplit + 1;
  }
  const int64_t splits = first_split[b];
  std::vector<float> acc(splits * hq * d), m(splits * hq), l(splits * hq);
  std::vector<int64_t> split_req(splits);
  for (int64_t r = 0; r < b; ++r)
    for (int64_t s = first_split[r]; s < first_split[r + 1]; ++s) split_req[s] = r;
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* cp = cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, splits, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const int64_t r = split_req[s], j = s - first_split[r];
        const int64_t t0 = std::max(lo[r], (lo[r] / kSplit + j) * kSplit);
        const int64_t t1 = std::min(pos[r] + 1, (lo[r] / kSplit + j + 1) * kSplit);
        auto task = split_task<scalar_t>;
#if defined(__AVX512F__)
        if constexpr (!std::is_same_v<scalar_t, double>)
          if (d % 16 == 0) task = split_task_avx512<scalar_t>;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        if constexpr (!std::is_same_v<scalar_t, double>)
          if (d % 8 == 0) task = split_task_avx2<scalar_t>;
#endif
        task(qp + r * hq * d, cp, tab + r * span, base[r], t0, t1, acc.data() + s * hq * d, m.data() + s * hq,
             l.data() + s * hq, hq, groups, d, bs, cache.stride(0), cache.stride(1), cache.stride(2),
             cache.stride(3), static_cast<float>(scale));
      }
    });
    // Merge each request's splits in order: out = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s [+ e^(sink - M)]).
    at::parallel_for(0, b * hq, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> o(d);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t r = task / hq, h = task % hq;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t s = first_split[r]; s < first_split[r + 1]; ++s) mx = std::max(mx, m[s * hq + h]);
        if (sink_p) mx = std::max(mx, sink_p[h]);
        float denom = sink_p ? std::exp(sink_p[h] - mx) : 0.f;
        std::fill(o.begin(), o.end(), 0.f);
        for (int64_t s = first_split[r]; s < first_split[r + 1]; ++s) {
          const float w = std::exp(m[s * hq + h] - mx);
          denom += w * l[s * hq + h];
          const float* a = acc.data() + (s * hq + h) * d;
          for (int64_t i = 0; i < d; ++i) o[i] += w * a[i];
        }
        const float inv = 1.f / denom;
        for (int64_t i = 0; i < d; ++i) op[task * d + i] = static_cast<scalar_t>(o[i] * inv);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention read in place from a paged KV cache");
}
