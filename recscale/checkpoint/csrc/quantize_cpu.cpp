// Native CPU kernel of the adaptive row quantizer's range search (Check-N-Run's greedy search).
//
// For each row: start from [min, max], and for `steps` steps move one end by (max - min) / bins
// toward the other, whichever lowers the squared error of quantizing the row more; keep the
// range of lowest error seen. recscale/checkpoint/quantize.py's `_greedy_block` is the one
// reference definition: every float32 operation below is the same operation, in the same order
// (no FMA contraction: -ffp-contract=off), each row's error summed in float32 over its columns
// in order, so the two agree bit for bit (the tests compare them).
//
// Sixteen rows are searched at once, one per vector lane, from a transposed copy that sits in
// L1 cache; both candidate errors of a step come from one pass over it. It runs on the calling
// thread only, with the GIL released: the checkpoint writer calls it from a background thread,
// and a second OpenMP team there would take cores from training.

#include <torch/python.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace {

// Rows searched together, one per vector lane: the search of a row is a chain of dependent
// steps (each move waits for the previous errors), so running kLanes independent rows side by
// side turns a latency-bound, branchy loop into straight-line vector code.
constexpr int kLanes = 16;

// Squared errors of quantizing each lane's row on [lo_a, hi_a] and on [lo_b, hi_b] (values
// outside are clamped) with `levels` steps, in one pass over the transposed block t[d][kLanes].
// Each lane sums its row in float32 in column order, as the PyTorch definition does. Local
// copies and plain selects (not std::min/max on array elements) let the compiler keep
// everything in vector registers.
inline void sq_errors(const float* t, int64_t d, const float* lo_a, const float* hi_a, const float* lo_b,
                      const float* hi_b, float levels, float* out_a, float* out_b) {
  float la[kLanes], ha[kLanes], lb[kLanes], hb[kLanes], s_a[kLanes], inv_a[kLanes], s_b[kLanes], inv_b[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    la[k] = lo_a[k];
    ha[k] = hi_a[k];
    lb[k] = lo_b[k];
    hb[k] = hi_b[k];
    const float wa = (ha[k] - la[k]) / levels, wb = (hb[k] - lb[k]) / levels;
    s_a[k] = wa < 1e-30f ? 1e-30f : wa;
    s_b[k] = wb < 1e-30f ? 1e-30f : wb;
    inv_a[k] = 1.0f / s_a[k];
    inv_b[k] = 1.0f / s_b[k];
  }
  float acc_a[kLanes] = {0.0f}, acc_b[kLanes] = {0.0f};  // 0 + e * e is e * e exactly
  for (int64_t j = 0; j < d; ++j) {
    const float* v = t + j * kLanes;
    for (int k = 0; k < kLanes; ++k) {
      const float x = v[k];
      float ca = x < la[k] ? la[k] : x;
      ca = ha[k] < ca ? ha[k] : ca;
      float cb = x < lb[k] ? lb[k] : x;
      cb = hb[k] < cb ? hb[k] : cb;
      const float ea = (std::nearbyint((ca - la[k]) * inv_a[k]) * s_a[k] + la[k]) - x;
      const float eb = (std::nearbyint((cb - lb[k]) * inv_b[k]) * s_b[k] + lb[k]) - x;
      acc_a[k] += ea * ea;
      acc_b[k] += eb * eb;
    }
  }
  for (int k = 0; k < kLanes; ++k) {
    out_a[k] = acc_a[k];
    out_b[k] = acc_b[k];
  }
}

// The search of rows r0 .. r0 + count - 1 (count <= kLanes; spare lanes repeat the last row and
// are dropped). `t` is scratch of d * kLanes floats.
void search_group(const float* xp, int64_t r0, int count, int64_t d, float lv, float nb, int64_t steps, float* t,
                  float* blo, float* bhi) {
  for (int k = 0; k < kLanes; ++k) {
    const float* row = xp + (r0 + std::min(k, count - 1)) * d;
    for (int64_t j = 0; j < d; ++j) t[j * kLanes + k] = row[j];
  }
  float lo[kLanes], hi[kLanes], step[kLanes], b_lo[kLanes], b_hi[kLanes], cand_lo[kLanes], cand_hi[kLanes];
  float best[kLanes], unused[kLanes], e_lo[kLanes], e_hi[kLanes];
  for (int k = 0; k < kLanes; ++k) lo[k] = hi[k] = t[k];
  for (int64_t j = 1; j < d; ++j) {
    for (int k = 0; k < kLanes; ++k) {
      lo[k] = std::min(lo[k], t[j * kLanes + k]);
      hi[k] = std::max(hi[k], t[j * kLanes + k]);
    }
  }
  for (int k = 0; k < kLanes; ++k) {
    step[k] = (hi[k] - lo[k]) / nb;
    b_lo[k] = lo[k];
    b_hi[k] = hi[k];
  }
  sq_errors(t, d, lo, hi, lo, hi, lv, best, unused);
  for (int64_t s = 0; s < steps; ++s) {
    for (int k = 0; k < kLanes; ++k) {
      cand_lo[k] = lo[k] + step[k];
      cand_hi[k] = hi[k] - step[k];
    }
    sq_errors(t, d, cand_lo, hi, lo, cand_hi, lv, e_lo, e_hi);
    for (int k = 0; k < kLanes; ++k) {
      const bool take_lo = e_lo[k] < e_hi[k];
      lo[k] = take_lo ? cand_lo[k] : lo[k];
      hi[k] = take_lo ? hi[k] : cand_hi[k];
      const float err = e_hi[k] < e_lo[k] ? e_hi[k] : e_lo[k];
      const bool better = err < best[k];
      best[k] = better ? err : best[k];
      b_lo[k] = better ? lo[k] : b_lo[k];
      b_hi[k] = better ? hi[k] : b_hi[k];
    }
  }
  for (int k = 0; k < count; ++k) {
    blo[r0 + k] = b_lo[k];
    bhi[r0 + k] = b_hi[k];
  }
}

std::tuple<at::Tensor, at::Tensor> greedy_range(const at::Tensor& x, int64_t levels, int64_t bins, int64_t steps) {
  if (x.dim() != 2 || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.device().type() != at::kCPU) {
    throw std::invalid_argument("greedy_range: x must be a contiguous 2-d float32 CPU tensor");
  }
  if (levels < 1 || bins < 1 || steps < 0) throw std::invalid_argument("greedy_range: levels, bins >= 1, steps >= 0");
  const int64_t n = x.size(0), d = x.size(1);
  at::Tensor best_lo = at::empty({n}, x.options());
  at::Tensor best_hi = at::empty({n}, x.options());
  if (n == 0 || d == 0) return {best_lo, best_hi};
  std::vector<float> scratch(static_cast<size_t>(d) * kLanes);
  const float* xp = x.data_ptr<float>();
  float* blo = best_lo.data_ptr<float>();
  float* bhi = best_hi.data_ptr<float>();
  const float lv = static_cast<float>(levels);
  const float nb = static_cast<float>(bins);
  for (int64_t r0 = 0; r0 < n; r0 += kLanes) {
    const int count = static_cast<int>(std::min<int64_t>(kLanes, n - r0));
    search_group(xp, r0, count, d, lv, nb, steps, scratch.data(), blo, bhi);
  }
  return {best_lo, best_hi};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("greedy_range", &greedy_range, "per-row [lo, hi] of the adaptive quantizer's greedy range search",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
