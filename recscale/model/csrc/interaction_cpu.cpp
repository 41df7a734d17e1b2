// Dot interaction of DLRM on the CPU: the pairwise dot products of each sample's F vectors
// (strictly lower triangle, row-major: (1,0), (2,0), (2,1), ...) and their gradient.
// One sample's vectors (F x D floats) stay in L1/L2 while all its pairs are formed, where a
// batched GEMM would compute the full F x F Gram matrix in many tiny calls.
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

template <typename scalar_t>
inline float dot(const scalar_t* a, const scalar_t* b, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < d; ++k) s += static_cast<float>(a[k]) * static_cast<float>(b[k]);
  return s;
}

}  // namespace

torch::Tensor pairs_forward(const torch::Tensor& vectors) {
  TORCH_CHECK(vectors.dim() == 3 && vectors.is_contiguous() && vectors.scalar_type() == at::kFloat,
              "pairs_forward: expected contiguous float32 [B, F, D]");
  const int64_t b = vectors.size(0), f = vectors.size(1), d = vectors.size(2);
  const int64_t p = f * (f - 1) / 2;
  auto out = torch::empty({b, p}, vectors.options());
  const float* x = vectors.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, b, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const float* xs = x + s * f * d;
      float* os = o + s * p;
      int64_t q = 0;
      for (int64_t i = 1; i < f; ++i) {
        const float* xi = xs + i * d;
        for (int64_t j = 0; j < i; ++j) os[q++] = dot(xi, xs + j * d, d);
      }
    }
  });
  return out;
}

torch::Tensor pairs_backward(const torch::Tensor& vectors, const torch::Tensor& grad) {
  TORCH_CHECK(vectors.is_contiguous() && grad.is_contiguous() && grad.scalar_type() == at::kFloat,
              "pairs_backward: expected contiguous float32 inputs");
  const int64_t b = vectors.size(0), f = vectors.size(1), d = vectors.size(2);
  const int64_t p = f * (f - 1) / 2;
  auto gx = torch::zeros_like(vectors);
  const float* x = vectors.data_ptr<float>();
  const float* g = grad.data_ptr<float>();
  float* out = gx.data_ptr<float>();
  at::parallel_for(0, b, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t s = lo; s < hi; ++s) {
      const float* xs = x + s * f * d;
      const float* gs = g + s * p;
      float* os = out + s * f * d;
      int64_t q = 0;
      for (int64_t i = 1; i < f; ++i) {
        float* oi = os + i * d;
        const float* xi = xs + i * d;
        for (int64_t j = 0; j < i; ++j, ++q) {
          const float w = gs[q];
          float* oj = os + j * d;
          const float* xj = xs + j * d;
#pragma omp simd
          for (int64_t k = 0; k < d; ++k) {
            oi[k] += w * xj[k];
            oj[k] += w * xi[k];
          }
        }
      }
    }
  });
  return gx;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pairs_forward", &pairs_forward, "DLRM dot interaction: lower-triangle pair dot products");
  m.def("pairs_backward", &pairs_backward, "gradient of pairs_forward with respect to the vectors");
}
