// Gated DeltaNet's elementwise work around its projections, for the packed (bfloat16) path of `qwen3_5_gdn.py`:
// one call each where plain torch runs ~15 small ops, float32 inside. Rows are independent: a row's bits depend
// on that row alone (not its neighbours, the batch or the thread count), so every path of the layer that calls
// these for a token (in-pool decode, gathered one-token step, the output of any chunk) gives it the same bits.
//
//   gdn_gates(b, a [N, Hv], decay_rate, dt_bias [Hv] float32) -> g, beta [N, Hv] float32
//       beta = 1 / (1 + e^-b);  g = decay_rate * softplus(a + dt_bias), softplus(x) = log1p(e^x), x above 20
//   gdn_step_inputs(mixed [N, 2 Hk dk + Hv dv], g [N, Hv], Hk, dk) -> q, k [N, Hv, dk], v [N, Hv, dv], decay
//       [N, Hv], all float32: the conv's output (q, k, v channels, before silu) through silu; q and k
//       l2-normalised (x / sqrt(|x|^2 + 1e-6)), q scaled by dk^-1/2, value head h reading key head h / (Hv / Hk);
//       decay = e^g. The one-token step's inputs (`gated_deltanet.step_inputs` after silu, in one pass).
//   gated_rms_norm(o [N, Hv, dv], z [N, Hv dv], weight [dv] float32, eps) -> [N, Hv dv] in o's dtype:
//       per head o / sqrt(mean(o^2) + eps) * weight * silu(z), rounded once.
#include "torch_api.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "lanes.h"

namespace {

constexpr float kL2Eps = 1e-6f;  // `gated_deltanet.l2norm`'s

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// silu of n values of T into float32 `out`.
template <typename T>
void silu_row(const T* x, float* out, int64_t n) {
  int64_t i = 0;
#if defined(HYBRIDKV_LANES)
  for (; i + lanes::kWidth <= n; i += lanes::kWidth) lanes::store(out + i, lanes::silu(lanes::load(x + i)));
#endif
  for (; i < n; ++i) out[i] = silu(static_cast<float>(x[i]));
}

// sum of x^2 over n float32 values: lane sums in index order, then the lanes (a fixed order for a given n and
// vector width).
inline float square_sum(const float* x, int64_t n) {
  float ss = 0.f;
  int64_t i = 0;
#if defined(HYBRIDKV_LANES)
  lanes::V acc = lanes::zero();
  for (; i + lanes::kWidth <= n; i += lanes::kWidth) acc = lanes::fmadd(lanes::load(x + i), lanes::load(x + i), acc);
  ss = lanes::sum(acc);
#endif
  for (; i < n; ++i) ss += x[i] * x[i];
  return ss;
}

// out = x * s for n float32 values.
inline void scale_row(const float* x, float s, float* out, int64_t n) {
  int64_t i = 0;
#if defined(HYBRIDKV_LANES)
  for (; i + lanes::kWidth <= n; i += lanes::kWidth) lanes::store(out + i, lanes::mul(lanes::load(x + i), lanes::splat(s)));
#endif
  for (; i < n; ++i) out[i] = x[i] * s;
}

void check_matrix(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [N, C] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
}

template <typename T>
void gates_rows(const torch::Tensor& b, const torch::Tensor& a, const float* rate, const float* bias, float* g,
                float* beta, int64_t r0, int64_t r1) {
  const int64_t hv = b.size(1);
  const T *bp = b.data_ptr<T>(), *ap = a.data_ptr<T>();
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t h = 0; h < hv; ++h) {
      const float x = static_cast<float>(ap[r * a.stride(0) + h]) + bias[h];
      const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
      g[r * hv + h] = rate[h] * softplus;
      beta[r * hv + h] = 1.f / (1.f + std::exp(-static_cast<float>(bp[r * b.stride(0) + h])));
    }
  }
}

std::vector<torch::Tensor> gdn_gates(const torch::Tensor& b, const torch::Tensor& a, const torch::Tensor& rate,
                                     const torch::Tensor& bias) {
  check_matrix(b, "b");
  check_matrix(a, "a");
  TORCH_CHECK(a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type(), "a and b: the same shape and dtype");
  const int64_t n = b.size(0), hv = b.size(1);
  for (const auto* t : {&rate, &bias})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == hv, "[Hv] float32 constants");
  auto g = torch::empty({n, hv}, b.options().dtype(at::kFloat)), beta = torch::empty_like(g);
  const float *rp = rate.data_ptr<float>(), *bp = bias.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    if (b.scalar_type() == at::kBFloat16) {
      gates_rows<c10::BFloat16>(b, a, rp, bp, g.data_ptr<float>(), beta.data_ptr<float>(), r0, r1);
    } else {
      gates_rows<float>(b, a, rp, bp, g.data_ptr<float>(), beta.data_ptr<float>(), r0, r1);
    }
  });
  return {g, beta};
}

// One token: silu over its channels into `act` [2 Hk dk + Hv dv], then q, k per key head normalised and copied to
// each value head that reads it, v as is.
template <typename T>
void step_inputs_row(const T* x, const float* g, int64_t hk, int64_t hv, int64_t dk, int64_t dv, float* act,
                     float* q, float* k, float* v, float* decay) {
  const int64_t key_dim = hk * dk, per_key = hv / hk;
  silu_row(x, act, 2 * key_dim + hv * dv);
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  for (int64_t kh = 0; kh < hk; ++kh) {
    float* qh = act + kh * dk;
    float* kh_row = act + key_dim + kh * dk;
    const float q_inv = 1.f / std::sqrt(square_sum(qh, dk) + kL2Eps);
    const float k_inv = 1.f / std::sqrt(square_sum(kh_row, dk) + kL2Eps);
    for (int64_t j = 0; j < per_key; ++j) {
      const int64_t h = kh * per_key + j;
      scale_row(qh, q_inv, q + h * dk, dk);
      scale_row(q + h * dk, q_scale, q + h * dk, dk);
      scale_row(kh_row, k_inv, k + h * dk, dk);
    }
  }
  std::memcpy(v, act + 2 * key_dim, hv * dv * sizeof(float));
  for (int64_t h = 0; h < hv; ++h) decay[h] = std::exp(g[h]);
}

std::vector<torch::Tensor> gdn_step_inputs(const torch::Tensor& mixed, const torch::Tensor& g, int64_t hk,
                                           int64_t dk) {
  check_matrix(mixed, "mixed");
  TORCH_CHECK(g.dim() == 2 && g.is_contiguous() && g.scalar_type() == at::kFloat, "g must be [N, Hv] float32");
  const int64_t n = mixed.size(0), hv = g.size(1), width = mixed.size(1) - 2 * hk * dk;
  TORCH_CHECK(g.size(0) == n && hk > 0 && dk > 0 && hv % hk == 0 && width > 0 && width % hv == 0,
              "mixed [N, 2 Hk dk + Hv dv] and g [N, Hv] do not fit Hk ", hk, " and dk ", dk);
  const int64_t dv = width / hv;
  const auto f32 = mixed.options().dtype(at::kFloat);
  auto q = torch::empty({n, hv, dk}, f32), k = torch::empty({n, hv, dk}, f32);
  auto v = torch::empty({n, hv, dv}, f32), decay = torch::empty({n, hv}, f32);
  at::parallel_for(0, n, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> act(mixed.size(1));
    for (int64_t r = r0; r < r1; ++r) {
      float *qr = q.data_ptr<float>() + r * hv * dk, *kr = k.data_ptr<float>() + r * hv * dk;
      float *vr = v.data_ptr<float>() + r * hv * dv, *dr = decay.data_ptr<float>() + r * hv;
      const float* gr = g.data_ptr<float>() + r * hv;
      if (mixed.scalar_type() == at::kBFloat16) {
        const auto* x = mixed.data_ptr<c10::BFloat16>() + r * mixed.stride(0);
        step_inputs_row(x, gr, hk, hv, dk, dv, act.data(), qr, kr, vr, dr);
      } else {
        step_inputs_row(mixed.data_ptr<float>() + r * mixed.stride(0), gr, hk, hv, dk, dv, act.data(), qr, kr, vr, dr);
      }
    }
  });
  return {q, k, v, decay};
}

template <typename T, typename Z>
void gated_norm_rows(const T* o, const Z* z, int64_t z_stride, const float* w, T* out, int64_t hv, int64_t dv,
                     float eps, int64_t r0, int64_t r1, float* row, float* gate) {
  for (int64_t r = r0; r < r1; ++r) {
    silu_row(z + r * z_stride, gate, hv * dv);
    for (int64_t h = 0; h < hv; ++h) {
      const T* oh = o + (r * hv + h) * dv;
      T* dst = out + (r * hv + h) * dv;
      const float* zh = gate + h * dv;
      for (int64_t i = 0; i < dv; ++i) row[i] = static_cast<float>(oh[i]);
      const float inv = 1.f / std::sqrt(square_sum(row, dv) / static_cast<float>(dv) + eps);
      int64_t i = 0;
#if defined(HYBRIDKV_LANES)
      const lanes::V vinv = lanes::splat(inv);
      for (; i + lanes::kWidth <= dv; i += lanes::kWidth) {
        const lanes::V normed = lanes::mul(lanes::mul(lanes::load(row + i), vinv), lanes::load(w + i));
        lanes::store(dst + i, lanes::mul(normed, lanes::load(zh + i)));
      }
#endif
      for (; i < dv; ++i) dst[i] = static_cast<T>(row[i] * inv * w[i] * zh[i]);
    }
  }
}

torch::Tensor gated_rms_norm(const torch::Tensor& o, const torch::Tensor& z, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(o.dim() == 3 && o.is_contiguous(), "o must be [N, Hv, dv] contiguous");
  TORCH_CHECK(o.scalar_type() == at::kFloat || o.scalar_type() == at::kBFloat16, "o: float32 or bfloat16");
  check_matrix(z, "z");
  const int64_t n = o.size(0), hv = o.size(1), dv = o.size(2);
  TORCH_CHECK(z.size(0) == n && z.size(1) == hv * dv, "z must be [N, Hv dv]");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == dv, "weight: [dv] f32");
  auto out = torch::empty({n, hv * dv}, o.options());
  const float* w = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, n, 4, [&](int64_t r0, int64_t r1) {
    std::vector<float> row(dv), gate(hv * dv);
    auto run = [&](const auto* op, auto* dst) {
      if (z.scalar_type() == at::kBFloat16) {
        const auto* zp = z.data_ptr<c10::BFloat16>();
        gated_norm_rows(op, zp, z.stride(0), w, dst, hv, dv, e, r0, r1, row.data(), gate.data());
      } else {
        gated_norm_rows(op, z.data_ptr<float>(), z.stride(0), w, dst, hv, dv, e, r0, r1, row.data(), gate.data());
      }
    };
    if (o.scalar_type() == at::kBFloat16) {
      run(o.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
    } else {
      run(o.data_ptr<float>(), out.data_ptr<float>());
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gdn_gates", &gdn_gates, "g, beta [N, Hv] float32 from the b and a projections");
  m.def("gdn_step_inputs", &gdn_step_inputs, "q, k, v, decay of the one-token step from the conv's output");
  m.def("gated_rms_norm", &gated_rms_norm, "o / rms(o) * weight * silu(z) per head");
}
