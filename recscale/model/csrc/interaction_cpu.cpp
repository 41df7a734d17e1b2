// Dot interaction of DLRM on the CPU: the pairwise dot products of each sample's F vectors
// (strictly lower triangle, row-major: (1,0), (2,0), (2,1), ...) and their gradient.
// One sample's vectors (F x D floats) stay in L1/L2 while all its pairs are formed, where a
// batched GEMM would compute the full F x F Gram matrix in many tiny calls.
//
// Only the headers it uses, not <torch/extension.h> (all of libtorch's C++ API): the first use
// compiles it in half the time (about 20 s instead of 40 s on two cores).
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstring>
#include <vector>

namespace {

template <typename scalar_t>
inline float dot(const scalar_t* a, const scalar_t* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < d; ++k) s += static_cast<float>(a[k]) * static_cast<float>(b[k]);
  return s;
}

// The F vectors of sample s: the dense (bottom-MLP) row, then the pooled embedding rows.
template <typename P>
inline void sample_rows(P* rows, P dense, P pooled, int64_t s, int64_t f, int64_t d) {
  rows[0] = dense + s * d;
  for (int64_t i = 1; i < f; ++i) rows[i] = pooled + (s * (f - 1) + (i - 1)) * d;
}

void check_inputs(const at::Tensor& dense, const at::Tensor& pooled, const char* what) {
  TORCH_CHECK(dense.dim() == 2 && pooled.dim() == 2 && dense.is_contiguous() && pooled.is_contiguous() &&
                  dense.scalar_type() == at::kFloat && pooled.scalar_type() == at::kFloat,
              what, ": expected contiguous float32 dense [B, D] and pooled [B, (F-1) D]");
  TORCH_CHECK(pooled.size(0) == dense.size(0) && dense.size(1) > 0 && pooled.size(1) % dense.size(1) == 0,
              what, ": pooled width ", pooled.size(1), " is not a multiple of the dense width ", dense.size(1));
}

}  // namespace

// [B, D] dense and [B, (F-1) D] pooled -> [B, D + P]: the dense row, then the pair dot products.
// Reading the two inputs in place and writing the output once replaces a concatenation of the
// vectors, a separate pairs tensor and a concatenation of the output.
at::Tensor interact_forward(const at::Tensor& dense, const at::Tensor& pooled) {
  check_inputs(dense, pooled, "interact_forward");
  const int64_t b = dense.size(0), d = dense.size(1), f = pooled.size(1) / d + 1;
  const int64_t p = f * (f - 1) / 2;
  auto out = at::empty({b, d + p}, dense.options());
  const float* xd = dense.data_ptr<float>();
  const float* xp = pooled.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, b, 16, [&](int64_t lo, int64_t hi) {
    std::vector<const float*> rows(f);
    for (int64_t s = lo; s < hi; ++s) {
      sample_rows(rows.data(), xd, xp, s, f, d);
      float* os = o + s * (d + p);
      std::memcpy(os, rows[0], d * sizeof(float));
      float* op = os + d;
      int64_t q = 0;
      for (int64_t i = 1; i < f; ++i)
        for (int64_t j = 0; j < i; ++j) op[q++] = dot(rows[i], rows[j], d);
    }
  });
  return out;
}

// Gradients of interact_forward for dense and pooled from the output gradient [B, D + P].
// Each vector's gradient row is summed in cache over its F - 1 partners and written once, so
// no zero-filled [B, F, D] buffer is needed; the dense gradient includes the pass-through.
std::vector<at::Tensor> interact_backward(const at::Tensor& dense, const at::Tensor& pooled,
                                          const at::Tensor& grad) {
  check_inputs(dense, pooled, "interact_backward");
  const int64_t b = dense.size(0), d = dense.size(1), f = pooled.size(1) / d + 1;
  const int64_t p = f * (f - 1) / 2;
  TORCH_CHECK(grad.is_contiguous() && grad.scalar_type() == at::kFloat && grad.dim() == 2 &&
                  grad.size(0) == b && grad.size(1) == d + p,
              "interact_backward: expected a contiguous float32 gradient [B, D + P]");
  auto gd = at::empty_like(dense);
  auto gp = at::empty_like(pooled);
  const float* xd = dense.data_ptr<float>();
  const float* xp = pooled.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* od = gd.data_ptr<float>();
  float* opool = gp.data_ptr<float>();
  at::parallel_for(0, b, 16, [&](int64_t lo, int64_t hi) {
    std::vector<const float*> rows(f);
    std::vector<float*> outs(f);
    for (int64_t s = lo; s < hi; ++s) {
      sample_rows(rows.data(), xd, xp, s, f, d);
      sample_rows(outs.data(), od, opool, s, f, d);
      const float* gs = g + s * (d + p);
      const float* gpairs = gs + d;
      for (int64_t i = 0; i < f; ++i) {
        float* oi = outs[i];
        if (i == 0) {
          std::memcpy(oi, gs, d * sizeof(float));
        } else {
          std::memset(oi, 0, d * sizeof(float));
        }
        for (int64_t j = 0; j < f; ++j) {
          if (j == i) continue;
          const int64_t hi_ = i > j ? i : j, lo_ = i > j ? j : i;
          const float w = gpairs[hi_ * (hi_ - 1) / 2 + lo_];
          const float* xj = rows[j];
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) oi[k] += w * xj[k];
        }
      }
    }
  });
  return {gd, gp};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("interact_forward", &interact_forward, "DLRM dot interaction: dense row, then lower-triangle pair dot products");
  m.def("interact_backward", &interact_backward, "gradients of interact_forward for dense and pooled");
}
