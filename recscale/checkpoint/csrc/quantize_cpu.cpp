// Native CPU kernel of the adaptive row quantizer's range search (Check-N-Run's greedy search).
//
// For each row: start from [min, max], and for `steps` steps move one end by (max - min) / bins
// toward the other, whichever lowers the squared error of quantizing the row more; keep the
// range of lowest error seen. recscale/checkpoint/quantize.py's `_greedy_block` is the one
// reference definition: every float32 operation below is the same operation, in the same order
// (no FMA contraction: -ffp-contract=off), and each row's error is summed in double, so the
// two agree whatever order either sums in (the tests compare them).
//
// The whole search of a row runs while the row sits in L1 cache, both candidate errors of a
// step in one pass over it. It runs on the calling thread only, with the GIL released: the
// checkpoint writer calls it from a background thread, and a second OpenMP team there would
// take cores from training.

#include <torch/python.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <tuple>

namespace {

constexpr int kLanes = 16;  // values per vector block; each lane keeps its own double sum

inline float sq(float v, float lo, float hi, float s, float inv) {
  const float c = std::min(std::max(v, lo), hi);
  const float e = (std::nearbyint((c - lo) * inv) * s + lo) - v;
  return e * e;
}

// Squared errors of quantizing x on [lo_a, hi_a] and on [lo_b, hi_b] (values outside are
// clamped) with `levels` steps, in one pass. Lane-wise double sums let the compiler vectorize.
inline void sq_error_pair(const float* x, int64_t d, float lo_a, float hi_a, float lo_b, float hi_b, float levels,
                          double* out_a, double* out_b) {
  const float s_a = std::max((hi_a - lo_a) / levels, 1e-30f);
  const float s_b = std::max((hi_b - lo_b) / levels, 1e-30f);
  const float inv_a = 1.0f / s_a;
  const float inv_b = 1.0f / s_b;
  double acc_a[kLanes] = {0.0}, acc_b[kLanes] = {0.0};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      acc_a[k] += static_cast<double>(sq(x[j + k], lo_a, hi_a, s_a, inv_a));
      acc_b[k] += static_cast<double>(sq(x[j + k], lo_b, hi_b, s_b, inv_b));
    }
  }
  for (int k = 0; j < d; ++j, ++k) {
    acc_a[k] += static_cast<double>(sq(x[j], lo_a, hi_a, s_a, inv_a));
    acc_b[k] += static_cast<double>(sq(x[j], lo_b, hi_b, s_b, inv_b));
  }
  // A tree over the lanes: the next step waits for this sum, so its latency is what counts.
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int k = 0; k < w; ++k) {
      acc_a[k] += acc_a[k + w];
      acc_b[k] += acc_b[k + w];
    }
  }
  *out_a = acc_a[0];
  *out_b = acc_b[0];
}

std::tuple<at::Tensor, at::Tensor> greedy_range(const at::Tensor& x, int64_t levels, int64_t bins, int64_t steps) {
  if (x.dim() != 2 || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.device().type() != at::kCPU) {
    throw std::invalid_argument("greedy_range: x must be a contiguous 2-d float32 CPU tensor");
  }
  if (levels < 1 || bins < 1 || steps < 0) throw std::invalid_argument("greedy_range: levels, bins >= 1, steps >= 0");
  const int64_t n = x.size(0), d = x.size(1);
  at::Tensor best_lo = at::empty({n}, x.options());
  at::Tensor best_hi = at::empty({n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* blo = best_lo.data_ptr<float>();
  float* bhi = best_hi.data_ptr<float>();
  const float lv = static_cast<float>(levels);
  const float nb = static_cast<float>(bins);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = xp + r * d;
    float lo = row[0], hi = row[0];
    for (int64_t j = 1; j < d; ++j) {
      lo = std::min(lo, row[j]);
      hi = std::max(hi, row[j]);
    }
    const float step = (hi - lo) / nb;
    float b_lo = lo, b_hi = hi;
    double best, unused;
    sq_error_pair(row, d, lo, hi, lo, hi, lv, &best, &unused);
    for (int64_t k = 0; k < steps; ++k) {
      double e_lo, e_hi;
      sq_error_pair(row, d, lo + step, hi, lo, hi - step, lv, &e_lo, &e_hi);
      const bool take_lo = e_lo < e_hi;
      if (take_lo) lo = lo + step; else hi = hi - step;
      const double err = std::min(e_lo, e_hi);
      if (err < best) {
        best = err;
        b_lo = lo;
        b_hi = hi;
      }
    }
    blo[r] = b_lo;
    bhi[r] = b_hi;
  }
  return {best_lo, best_hi};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("greedy_range", &greedy_range, "per-row [lo, hi] of the adaptive quantizer's greedy range search",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
