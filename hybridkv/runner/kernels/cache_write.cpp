// New tokens' keys and values written into their cache slots, one row copy per token and half:
//
//   kv     [N, 2, Hk, D]              contiguous; [:, 0] keys, [:, 1] values
//   cache  [num_blocks, bs, 2, Hk, D] one layer's view (any strides, D contiguous: per-layer or packed layout)
//   token t goes to cache[block_ids[t], offsets[t]]
//
// What `cache[block_ids, offsets] = kv` does, without advanced indexing's per-element index arithmetic (a
// 2k-token prefill chunk of Qwen3-0.6B: ~6 ms a layer through index_put, a memory copy here).
#include "../../models/kernels/torch_api.h"

#include <ATen/Parallel.h>

#include <cstring>

void write_slots(torch::Tensor& cache, const torch::Tensor& block_ids, const torch::Tensor& offsets,
                 const torch::Tensor& kv) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(2) == 2 && cache.stride(4) == 1, "cache must be [blocks, bs, 2, Hk, D]");
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.scalar_type() == cache.scalar_type(),
              "kv must be contiguous [N, 2, Hk, D] in the cache's dtype");
  TORCH_CHECK(kv.size(1) == 2 && kv.size(2) == cache.size(3) && kv.size(3) == cache.size(4), "kv and cache shapes");
  const int64_t n = kv.size(0), hk = kv.size(2), d = kv.size(3), blocks = cache.size(0), bs = cache.size(1);
  for (const auto* t : {&block_ids, &offsets})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kLong && t->numel() == n, "one int64 slot per token");
  const int64_t* bid = block_ids.data_ptr<int64_t>();
  const int64_t* off = offsets.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(bid[t] >= 0 && bid[t] < blocks && off[t] >= 0 && off[t] < bs, "slot outside the cache");
  const int64_t es = cache.element_size(), row = d * es;
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(kv.data_ptr());
  const int64_t s0 = cache.stride(0) * es, s1 = cache.stride(1) * es, s2 = cache.stride(2) * es;
  const int64_t s3 = cache.stride(3) * es;
  at::parallel_for(0, n, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      char* slot = dst + bid[t] * s0 + off[t] * s1;
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t h = 0; h < hk; ++h)
          std::memcpy(slot + half * s2 + h * s3, src + ((t * 2 + half) * hk + h) * row, row);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_slots", &write_slots, "cache[block_ids, offsets] = kv, a row copy per token");
}
