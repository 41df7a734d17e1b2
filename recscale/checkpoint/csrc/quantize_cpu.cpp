// Native CPU kernels of the row quantizer: the adaptive range search (Check-N-Run's greedy
// search) and the codes of rows on their scales, packed (`pack_codes`), or both in one pass
// (`search_pack`: each group of rows quantized and packed right after its search).
//
// For each row: start from [min, max], and for at most `steps` steps move one end by `move`
// steps of (max - min) / bins toward the other, whichever lowers the squared error of quantizing
// the row more; keep the range of lowest error seen; stop early once `patience` moves in a row
// found nothing better; then try the best range moved by one step at either end, `refine` times,
// then refit it by least squares `cold_fits` times (`refit`; quantize.py's `search_schedule`
// picks these per bit width). A row with a stored start (its last result, in steps in from min
// and from max) is searched warm instead: that range, then a refining round per stride of
// `warm` (moves of that many steps), then `fits` refits.
// recscale/checkpoint/quantize.py's `range_search` is the one reference definition: every
// float32 operation below is the same operation, in the same order (no FMA contraction:
// -ffp-contract=off), each row's error summed in float32 over its columns in order,
// so the two agree bit for bit (the tests compare them).
//
// Sixteen rows are searched at once, one per vector lane, from a transposed copy that sits in
// L1 cache; both candidate errors of a step come from one pass over it. It runs on the calling
// thread only, with the GIL released: the checkpoint writer calls it from a background thread,
// and a second OpenMP team there would take cores from training.

#include <torch/python.h>
#include <pybind11/stl.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <tuple>
#include <vector>

namespace {

// Rows searched together, one per vector lane: the search of a row is a chain of dependent
// steps (each move waits for the previous errors), so running kLanes independent rows side by
// side turns a latency-bound, branchy loop into straight-line vector code.
constexpr int kLanes = 16;
// A row's stored start when it was never searched.
constexpr uint8_t kNever = 255;

// Squared errors of quantizing each lane's row on two ranges of one width (scale s, inv = 1 / s)
// starting at a_a * s and a_b * s, in units of s^2, in one pass over the transposed block
// t[d][kLanes]. Working in units of the scale (t = x * inv - a, codes round(clamp(t, 0, levels)))
// shares the product x * inv between the two candidates and needs no multiply back: about 17
// vector operations per value for both candidates, against 22 in range units. Each lane sums its
// row in float32 in column order, as the PyTorch definition does. Local copies and plain selects
// keep everything in vector registers.
template <bool kTwo>
inline void scaled_sq_errors(const float* t, int64_t d, const float* inv, const float* a_a, const float* a_b,
                             float levels, float* out_a, float* out_b) {
  float iv[kLanes], aa[kLanes], ab[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    iv[k] = inv[k];
    aa[k] = a_a[k];
    ab[k] = a_b[k];
  }
  float acc_a[kLanes] = {0.0f}, acc_b[kLanes] = {0.0f};  // 0 + e * e is e * e exactly
  for (int64_t j = 0; j < d; ++j) {
    const float* v = t + j * kLanes;
    for (int k = 0; k < kLanes; ++k) {
      const float xs = v[k] * iv[k];
      const float ta = xs - aa[k];
      float ca = ta < 0.0f ? 0.0f : ta;
      ca = levels < ca ? levels : ca;
      const float ea = std::nearbyint(ca) - ta;
      acc_a[k] += ea * ea;
      if (kTwo) {
        const float tb = xs - ab[k];
        float cb = tb < 0.0f ? 0.0f : tb;
        cb = levels < cb ? levels : cb;
        const float eb = std::nearbyint(cb) - tb;
        acc_b[k] += eb * eb;
      }
    }
  }
  for (int k = 0; k < kLanes; ++k) {
    out_a[k] = acc_a[k];
    out_b[k] = acc_b[k];
  }
}

inline float scale_of(float width, float levels) {
  const float s = width / levels;
  return s < 1e-30f ? 1e-30f : s;
}

// Pair errors (scaled to range units) of two candidate ranges of one width `w` per lane starting
// at lo_a and lo_b.
inline void pair_errors(const float* t, int64_t d, const float* w, const float* lo_a, const float* lo_b, float lv,
                        float* e_a, float* e_b) {
  float sc[kLanes], inv[kLanes], a_a[kLanes], a_b[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    sc[k] = scale_of(w[k], lv);
    inv[k] = 1.0f / sc[k];
    a_a[k] = lo_a[k] * inv[k];
    a_b[k] = lo_b[k] * inv[k];
  }
  scaled_sq_errors<true>(t, d, inv, a_a, a_b, lv, e_a, e_b);
  for (int k = 0; k < kLanes; ++k) {
    const float ss = sc[k] * sc[k];
    e_a[k] = e_a[k] * ss;
    e_b[k] = e_b[k] * ss;
  }
}

#if defined(__AVX512F__)
// In-register transpose of 16 x 16 floats: r[i] holds row i on entry, column i on return.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int h = 0; h < 16; h += 8) {
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0x88);
      t[h + 4 + i] = _mm512_shuffle_f32x4(r[h + i], r[h + 4 + i], 0xDD);
    }
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
  }
}
#elif defined(__AVX__)
// In-register transpose of 8 x 8 floats: r[i] holds row i on entry, column i on return.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {
    u[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}
#endif

// Copies rows idx[0 .. count) transposed into t[d][kLanes] (spare lanes repeat the last row).
// With AVX-512 in 16 x 16 register blocks, with AVX in 8 x 8 ones (a scalar copy is a fifth of
// a 2-bit cold search, more than a warm one).
inline void load_group(const float* xp, const int64_t* idx, int count, int64_t d, float* t) {
  const float* rows[kLanes];
  for (int k = 0; k < kLanes; ++k) rows[k] = xp + idx[std::min(k, count - 1)] * d;
  int64_t j0 = 0;
#if defined(__AVX512F__)
  for (; j0 + 16 <= d; j0 += 16) {
    __m512 r[16];
    for (int k = 0; k < 16; ++k) r[k] = _mm512_loadu_ps(rows[k] + j0);
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(t + (j0 + j) * kLanes, r[j]);
  }
#elif defined(__AVX__)
  for (; j0 + 8 <= d; j0 += 8) {
    for (int h = 0; h < kLanes; h += 8) {
      __m256 r[8];
      for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(rows[h + k] + j0);
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(t + (j0 + j) * kLanes + h, r[j]);
    }
  }
#endif
  for (int k = 0; k < kLanes; ++k) {
    for (int64_t j = j0; j < d; ++j) t[j * kLanes + k] = rows[k][j];
  }
}

struct Search {
  float lv, nb;            // levels, bins
  int64_t moves;           // the cold walk's moves, `mv` steps each
  float mv;
  int64_t patience, refine;
  std::vector<int64_t> warm;  // strides of the warm search's rounds
  int64_t fits, cold_fits;    // least-squares refits ending a warm and a cold search
};

// One group's lanes: each row's [min, max], its step, and the best range seen with its error
// and its distance from [min, max] in steps (k_lo in from min, k_hi in from max).
struct Lanes {
  float mn[kLanes], mx[kLanes], step[kLanes], best[kLanes], b_lo[kLanes], b_hi[kLanes], k_lo[kLanes], k_hi[kLanes];
};

inline void min_max(const float* t, int64_t d, Lanes& L, float nb) {
  float mn[kLanes], mx[kLanes];
  int64_t j = 1;
  for (int k = 0; k < kLanes; ++k) mn[k] = mx[k] = t[k];
#if defined(__AVX__)
  // Explicitly vectorized: compiled without AVX-512 the plain loop below stays scalar, and took
  // more time than a refit. min_ps(v, m) is v < m ? v : m, the loop's selection.
  static_assert(kLanes == 16, "two 8-float registers per row of lanes");
  __m256 mn0 = _mm256_loadu_ps(mn), mn1 = _mm256_loadu_ps(mn + 8), mx0 = mn0, mx1 = mn1;
  for (; j < d; ++j) {
    const __m256 v0 = _mm256_loadu_ps(t + j * kLanes), v1 = _mm256_loadu_ps(t + j * kLanes + 8);
    mn0 = _mm256_min_ps(v0, mn0);
    mn1 = _mm256_min_ps(v1, mn1);
    mx0 = _mm256_max_ps(v0, mx0);
    mx1 = _mm256_max_ps(v1, mx1);
  }
  _mm256_storeu_ps(mn, mn0);
  _mm256_storeu_ps(mn + 8, mn1);
  _mm256_storeu_ps(mx, mx0);
  _mm256_storeu_ps(mx + 8, mx1);
#endif
  for (; j < d; ++j) {
    for (int k = 0; k < kLanes; ++k) {
      const float v = t[j * kLanes + k];
      mn[k] = v < mn[k] ? v : mn[k];
      mx[k] = v > mx[k] ? v : mx[k];
    }
  }
  for (int k = 0; k < kLanes; ++k) {
    L.mn[k] = mn[k];
    L.mx[k] = mx[k];
    L.step[k] = (mx[k] - mn[k]) / nb;
  }
}

// Error of each lane's range [lo, hi] alone.
inline void single_error(const float* t, int64_t d, const float* lo, const float* hi, float lv, float* e) {
  float sc[kLanes], inv[kLanes], a[kLanes], unused[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    sc[k] = scale_of(hi[k] - lo[k], lv);
    inv[k] = 1.0f / sc[k];
    a[k] = lo[k] * inv[k];
  }
  scaled_sq_errors<false>(t, d, inv, a, a, lv, e, unused);
  for (int k = 0; k < kLanes; ++k) e[k] = e[k] * (sc[k] * sc[k]);
}

// One refining round: the best range moved by `m` steps (st = step * m) at either end, inward
// [lo + st, hi], [lo, hi - st] and outward [lo - st, hi], [lo, hi + st]; with `bounded`, an
// inward move is tried only while the range keeps at least one step (k_lo + k_hi + m < bins).
// Returns whether any lane found a better range.
inline bool refine_round(const float* t, int64_t d, Lanes& L, float lv, float nb, float m, bool bounded) {
  float in_lo[kLanes], out_lo[kLanes], base_lo[kLanes], base_hi[kLanes], w_in[kLanes], w_out[kLanes], st[kLanes];
  float e_a[kLanes], e_b[kLanes], e_c[kLanes], e_d[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    st[k] = L.step[k] * m;
    base_lo[k] = L.b_lo[k];
    base_hi[k] = L.b_hi[k];
    w_in[k] = (L.b_hi[k] - L.b_lo[k]) - st[k];
    w_out[k] = (L.b_hi[k] - L.b_lo[k]) + st[k];
    in_lo[k] = L.b_lo[k] + st[k];
    out_lo[k] = L.b_lo[k] - st[k];
  }
  pair_errors(t, d, w_in, in_lo, base_lo, lv, e_a, e_b);
  pair_errors(t, d, w_out, out_lo, base_lo, lv, e_c, e_d);
  bool any = false;
  for (int k = 0; k < kLanes; ++k) {
    const bool inward = !bounded || L.k_lo[k] + L.k_hi[k] + m < nb;
    const float kl = L.k_lo[k], kh = L.k_hi[k];
    const float c_lo[4] = {in_lo[k], base_lo[k], out_lo[k], base_lo[k]};
    const float c_hi[4] = {base_hi[k], base_hi[k] - st[k], base_hi[k], base_hi[k] + st[k]};
    const float c_kl[4] = {kl + m, kl, kl - m, kl};
    const float c_kh[4] = {kh, kh + m, kh, kh - m};
    const float c_e[4] = {e_a[k], e_b[k], e_c[k], e_d[k]};
    for (int c = 0; c < 4; ++c) {
      const bool better = (c >= 2 || inward) && c_e[c] < L.best[k];
      L.best[k] = better ? c_e[c] : L.best[k];
      L.b_lo[k] = better ? c_lo[c] : L.b_lo[k];
      L.b_hi[k] = better ? c_hi[c] : L.b_hi[k];
      L.k_lo[k] = better ? c_kl[c] : L.k_lo[k];
      L.k_hi[k] = better ? c_kh[c] : L.k_hi[k];
      any |= better;
    }
  }
  return any;
}

// One refit of each lane's range [lo, hi] (scale s): the codes c = round(clamp(t, 0, levels)) of
// the row on it (t = x / s - lo / s, as scaled_sq_errors computes them), then the line
// t ~ alpha + beta * c of least squares over the row, from the sums of e = c - t, c, c * c and
// e * c (each lane's in float32 over its columns in order): with N columns and
// det = N * sum(c * c) - sum(c)^2, beta = 1 - (N * sum(e * c) - sum(c) * sum(e)) / det and
// alpha = ((sum(c) - sum(e)) - beta * sum(c)) / N. The new range starts at lo + s * alpha with
// scale s * beta: for these codes, the offset and scale of least squared error, so the error
// never grows (then each value's nearest code only lowers it). A lane whose codes are all
// equal (det 0) or whose fit is not a widening line (beta <= 0) keeps its range.
inline void refit(const float* t, int64_t d, const float* lo, const float* hi, float lv, float* n_lo, float* n_hi) {
  float sc[kLanes], iv[kLanes], aa[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    sc[k] = scale_of(hi[k] - lo[k], lv);
    iv[k] = 1.0f / sc[k];
    aa[k] = lo[k] * iv[k];
  }
  float se[kLanes] = {0.0f}, sc1[kLanes] = {0.0f}, sc2[kLanes] = {0.0f}, sec[kLanes] = {0.0f};
  for (int64_t j = 0; j < d; ++j) {
    const float* v = t + j * kLanes;
    for (int k = 0; k < kLanes; ++k) {
      const float ta = v[k] * iv[k] - aa[k];
      float ca = ta < 0.0f ? 0.0f : ta;
      ca = lv < ca ? lv : ca;
      const float c = std::nearbyint(ca);
      const float e = c - ta;
      se[k] += e;
      sc1[k] += c;
      sc2[k] += c * c;
      sec[k] += e * c;
    }
  }
  const float nd = static_cast<float>(d);
  for (int k = 0; k < kLanes; ++k) {
    const float det = nd * sc2[k] - sc1[k] * sc1[k];
    const float beta = 1.0f - (nd * sec[k] - sc1[k] * se[k]) / det;
    const float alpha = ((sc1[k] - se[k]) - beta * sc1[k]) / nd;
    const bool ok = det > 0.0f && beta > 0.0f;
    const float h = hi[k];
    n_lo[k] = ok ? lo[k] + sc[k] * alpha : lo[k];
    n_hi[k] = ok ? n_lo[k] + (sc[k] * beta) * lv : h;
  }
}

// `fits` refits of each lane's best range, then its steps in from [min, max] rounded to whole
// steps (half to even; a constant row, whose step is 0, keeps its steps).
inline void refit_lanes(const float* t, int64_t d, float lv, int64_t fits, Lanes& L) {
  if (fits <= 0) return;
  for (int64_t f = 0; f < fits; ++f) refit(t, d, L.b_lo, L.b_hi, lv, L.b_lo, L.b_hi);
  for (int k = 0; k < kLanes; ++k) {
    const bool moves = L.step[k] > 0.0f;
    L.k_lo[k] = moves ? std::nearbyint((L.b_lo[k] - L.mn[k]) / L.step[k]) : L.k_lo[k];
    L.k_hi[k] = moves ? std::nearbyint((L.mx[k] - L.b_hi[k]) / L.step[k]) : L.k_hi[k];
  }
}

// The cold search of one group: from [min, max], moves of `mv` steps, at most `moves` of them; a
// lane stops once `patience` moves in a row found nothing better than its best, the group when
// every lane has. Then `refine` rounds.
void cold_group(const float* t, int64_t d, const Search& p, Lanes& L) {
  float lo[kLanes], hi[kLanes], stride[kLanes], cand[kLanes], w[kLanes], e_lo[kLanes], e_hi[kLanes];
  float kl[kLanes], kh[kLanes];
  int64_t bad[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    lo[k] = L.b_lo[k] = L.mn[k];
    hi[k] = L.b_hi[k] = L.mx[k];
    stride[k] = L.step[k] * p.mv;
    kl[k] = kh[k] = L.k_lo[k] = L.k_hi[k] = 0.0f;
    bad[k] = 0;
  }
  single_error(t, d, lo, hi, p.lv, L.best);
  for (int64_t s = 0; s < p.moves; ++s) {
    bool any = false;
    for (int k = 0; k < kLanes; ++k) any |= bad[k] < p.patience;
    if (!any) break;
    // Both moves leave a range of width (hi - lo) - stride: one scale for the pair.
    for (int k = 0; k < kLanes; ++k) {
      w[k] = (hi[k] - lo[k]) - stride[k];
      cand[k] = lo[k] + stride[k];
    }
    pair_errors(t, d, w, cand, lo, p.lv, e_lo, e_hi);
    for (int k = 0; k < kLanes; ++k) {
      if (bad[k] >= p.patience) continue;  // this lane's search is over
      const float el = e_lo[k], eh = e_hi[k];
      const bool take_lo = el < eh;
      lo[k] = take_lo ? cand[k] : lo[k];
      hi[k] = take_lo ? hi[k] : hi[k] - stride[k];
      kl[k] = take_lo ? kl[k] + p.mv : kl[k];
      kh[k] = take_lo ? kh[k] : kh[k] + p.mv;
      const float err = eh < el ? eh : el;
      const bool better = err < L.best[k];
      L.best[k] = better ? err : L.best[k];
      L.b_lo[k] = better ? lo[k] : L.b_lo[k];
      L.b_hi[k] = better ? hi[k] : L.b_hi[k];
      L.k_lo[k] = better ? kl[k] : L.k_lo[k];
      L.k_hi[k] = better ? kh[k] : L.k_hi[k];
      bad[k] = better ? 0 : bad[k] + 1;
    }
  }
  for (int64_t r = 0; r < p.refine; ++r) refine_round(t, d, L, p.lv, p.nb, 1.0f, false);
  refit_lanes(t, d, p.lv, p.cold_fits, L);
}

// The warm search of one group: from the range `start` steps in from [min, max] (the row's
// last result), a bounded refining round of `warm[r]` steps for each r (a round is skipped when
// the one before it had the same stride and found nothing better in any lane: it would try the
// same ranges again), then `fits` refits.
void warm_group(const float* t, int64_t d, const Search& p, const float* s_lo, const float* s_hi, Lanes& L) {
  for (int k = 0; k < kLanes; ++k) {
    L.k_lo[k] = s_lo[k];
    L.k_hi[k] = s_hi[k];
    L.b_lo[k] = L.mn[k] + s_lo[k] * L.step[k];
    L.b_hi[k] = L.mx[k] - s_hi[k] * L.step[k];
  }
  if (!p.warm.empty()) {
    single_error(t, d, L.b_lo, L.b_hi, p.lv, L.best);
    float last = 0.0f;
    bool moved = true;
    for (size_t r = 0; r < p.warm.size(); ++r) {
      const float m = static_cast<float>(p.warm[r]);
      if (m == last && !moved) continue;
      moved = refine_round(t, d, L, p.lv, p.nb, m, true);
      last = m;
    }
  }
  refit_lanes(t, d, p.lv, p.fits, L);
}

inline uint8_t steps_byte(float k) { return static_cast<uint8_t>(k < 0.0f ? 0.0f : (k > 254.0f ? 254.0f : k)); }

// Codes of one row, round(clamp((x - bias) * inv, 0, levels)) as quantize.py's `_codes`
// computes them (float32 sub and mul, rounding half to even, then the clamp), into c[0..d).
inline void row_codes(const float* x, int64_t d, float bias, float inv, float levels, uint8_t* c) {
  int64_t j = 0;
#if defined(__AVX512F__)
  // Sixteen codes at a time: the same sub, mul, rounding to nearest even and clamp.
  const __m512 vb = _mm512_set1_ps(bias), vi = _mm512_set1_ps(inv), vl = _mm512_set1_ps(levels);
  const __m512 zero = _mm512_setzero_ps();
  for (; j + 16 <= d; j += 16) {
    __m512 q = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), vb), vi);
    q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, zero), vl);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + j), _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)));
  }
#endif
  for (; j < d; ++j) {
    float q = std::nearbyint((x[j] - bias) * inv);
    q = q < 0.0f ? 0.0f : q;
    q = levels < q ? levels : q;
    c[j] = static_cast<uint8_t>(q);
  }
}

// Packs `count` codes of `bits` bits at bit offset `bit` of `out` (zeroed), least significant
// bit first: code i's bit b lands at stream bit (bit + i * bits + b), as pack_bits lays it out.
inline void put_bits(const uint8_t* c, int64_t count, int bits, int64_t bit, uint8_t* out) {
  if (bits == 8) {  // whole bytes (every code starts a byte)
    std::copy(c, c + count, out + bit / 8);
    return;
  }
  uint64_t acc = 0;
  int have = static_cast<int>(bit % 8);
  uint8_t* o = out + bit / 8;
  acc = *o;  // bits already written in the first byte
  int64_t i = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  // Eight codes at a time: their bytes, read as one little-endian word, merged pairwise into
  // 8 x bits contiguous bits (neighbours in 16-bit, then 32-bit, then 64-bit halves), the same
  // stream the one-code loop below writes. have < 8 before, so have + 8 x bits <= 63 fits.
  const uint64_t m1 = ((uint64_t{1} << bits) - 1) * 0x0001000100010001ull;
  const uint64_t m2 = ((uint64_t{1} << (2 * bits)) - 1) * 0x0000000100000001ull;
  const uint64_t m3 = (uint64_t{1} << (4 * bits)) - 1;
  for (; i + 8 <= count; i += 8) {
    uint64_t w;
    std::memcpy(&w, c + i, 8);
    w = (w & m1) | ((w >> (8 - bits)) & (m1 << bits));
    w = (w & m2) | ((w >> (16 - 2 * bits)) & (m2 << (2 * bits)));
    w = (w & m3) | ((w >> (32 - 4 * bits)) & (m3 << (4 * bits)));
    acc |= w << have;
    have += 8 * bits;
    while (have >= 8) {
      *o++ = static_cast<uint8_t>(acc & 0xffu);
      acc >>= 8;
      have -= 8;
    }
  }
#endif
  for (; i < count; ++i) {
    acc |= static_cast<uint64_t>(c[i]) << have;
    have += bits;
    while (have >= 8) {
      *o++ = static_cast<uint8_t>(acc & 0xffu);
      acc >>= 8;
      have -= 8;
    }
  }
  // OR, not store: rows may be packed out of order, and the next row's bits may be here already.
  if (have > 0) *o |= static_cast<uint8_t>(acc & 0xffu);
}


// Where search_group also quantizes: each row's fp16 scale and offset and its packed codes.
struct Pack {
  int bits;
  c10::Half* scale;
  c10::Half* bias;
  uint8_t* out;  // zeroed, (n * d * bits + 7) / 8 bytes
  uint8_t* codes;  // d bytes of scratch
};

// A row's codes on its fp16 scale and offset (the inverse 1 / scale of the rounded scale, 0 for
// a constant row, as quantize.py's `pack_on` takes it), packed at its place; the scale and
// offset stored. A row kept from its last encoding comes here directly, without a search.
inline void pack_on(const float* x, int64_t r, int64_t d, c10::Half s, c10::Half b, float levels, const Pack& pk) {
  const float sf = static_cast<float>(s);
  const float inv = sf > 0.0f ? 1.0f / sf : 0.0f;
  pk.scale[r] = s;
  pk.bias[r] = b;
  row_codes(x + r * d, d, static_cast<float>(b), inv, levels, pk.codes);
  put_bits(pk.codes, d, pk.bits, r * d * pk.bits, pk.out);
}

// quantize.py's `_scales` for one row, bit for bit: the offset is lo clamped to fp16's range and
// rounded to fp16 (c10::Half rounds to nearest even, as torch's .half() does), the scale is
// (hi - offset) / levels in float32 clamped to [0, fp16 max] and rounded. Then `pack_on`.
inline void pack_row(const float* x, int64_t r, int64_t d, float lo, float hi, float levels, const Pack& pk) {
  constexpr float kMax = 65504.0f;
  const float lc = lo < -kMax ? -kMax : (kMax < lo ? kMax : lo);
  const c10::Half b(lc);
  float sv = (hi - static_cast<float>(b)) / levels;
  sv = sv < 0.0f ? 0.0f : (kMax < sv ? kMax : sv);
  pack_on(x, r, d, c10::Half(sv), b, levels, pk);
}

// Searches the rows idx[0 .. count) (count <= kLanes), cold, or warm from `start` (uint8 pairs
// per row) when given; writes each row's range and its steps in from [min, max].
void search_group(const float* xp, const int64_t* idx, int count, int64_t d, const Search& p, const uint8_t* start,
                  float* t, float* blo, float* bhi, uint8_t* found, const Pack* pack = nullptr) {
  load_group(xp, idx, count, d, t);
  Lanes L;
  min_max(t, d, L, p.nb);
  if (start == nullptr) {
    cold_group(t, d, p, L);
  } else {
    float s_lo[kLanes], s_hi[kLanes];
    for (int k = 0; k < kLanes; ++k) {
      const int64_t r = idx[std::min(k, count - 1)];
      s_lo[k] = static_cast<float>(start[2 * r]);
      s_hi[k] = static_cast<float>(start[2 * r + 1]);
    }
    warm_group(t, d, p, s_lo, s_hi, L);
  }
  for (int k = 0; k < count; ++k) {
    blo[idx[k]] = L.b_lo[k];
    bhi[idx[k]] = L.b_hi[k];
    found[2 * idx[k]] = steps_byte(L.k_lo[k]);
    found[2 * idx[k] + 1] = steps_byte(L.k_hi[k]);
  }
  // Quantized while the group's rows are still in cache.
  if (pack != nullptr) {
    for (int k = 0; k < count; ++k) pack_row(xp, idx[k], d, L.b_lo[k], L.b_hi[k], p.lv, *pack);
  }
}

// A stored start is usable when it leaves the range at least one step wide.
inline bool warm_start(const uint8_t* start, int64_t r, int64_t bins) {
  return start != nullptr && start[2 * r] != kNever && static_cast<int64_t>(start[2 * r]) + start[2 * r + 1] < bins;
}

using Searched = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Rows kept from their last encoding (`search_pack`): a flag per row, and that encoding's fp16
// scale and offset.
struct Kept {
  const bool* flag = nullptr;
  const c10::Half* scale = nullptr;
  const c10::Half* bias = nullptr;
};

// The search of every row (and, with bits > 0, its fp16 scale and offset and all rows' packed
// codes: empty tensors otherwise). Rows flagged in `kept` (bits > 0 and a start only) are not
// searched: packed on their given scale and offset, their start returned as found.
Searched search_rows(const at::Tensor& x, int64_t levels, int64_t bins, int64_t steps, int64_t move,
                     int64_t patience, int64_t refine, const at::Tensor& start,
                     const std::vector<int64_t>& warm_strides, int64_t fits, int64_t cold_fits,
                     int64_t bits, const Kept& kept = Kept{}) {
  if (x.dim() != 2 || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.device().type() != at::kCPU) {
    throw std::invalid_argument("greedy_range: x must be a contiguous 2-d float32 CPU tensor");
  }
  if (levels < 1 || bins < 1 || steps < 0 || move < 1 || patience < 1 || refine < 0 || fits < 0 ||
      cold_fits < 0) {
    throw std::invalid_argument("greedy_range: levels, bins, move, patience >= 1; steps, refine, fits, cold_fits >= 0");
  }
  for (int64_t m : warm_strides) {
    if (m < 1) throw std::invalid_argument("greedy_range: warm strides must be >= 1");
  }
  const int64_t n = x.size(0), d = x.size(1);
  const bool warm = start.numel() > 0;
  if (warm && (start.scalar_type() != at::kByte || !start.is_contiguous() || start.dim() != 2 ||
               start.size(0) != n || start.size(1) != 2)) {
    throw std::invalid_argument("greedy_range: start must be empty or a contiguous uint8 [n, 2] tensor");
  }
  at::Tensor best_lo = at::empty({n}, x.options());
  at::Tensor best_hi = at::empty({n}, x.options());
  at::Tensor found = at::zeros({n, 2}, x.options().dtype(at::kByte));
  if (bits < 0 || bits > 8 || (bits > 0 && levels != (1 << bits) - 1)) {
    throw std::invalid_argument("search_pack: bits must be 1 to 8 with levels = 2**bits - 1");
  }
  const int64_t m = bits > 0 ? n : 0;
  at::Tensor scale = at::zeros({m}, x.options().dtype(at::kHalf));
  at::Tensor bias = at::zeros({m}, x.options().dtype(at::kHalf));
  at::Tensor packed = at::zeros({bits > 0 ? (n * d * bits + 7) / 8 : 0}, x.options().dtype(at::kByte));
  if (n == 0 || d == 0) return {best_lo, best_hi, found, scale, bias, packed};
  std::vector<float> scratch(static_cast<size_t>(d) * kLanes);
  std::vector<uint8_t> codes(static_cast<size_t>(d));
  const Pack pk{static_cast<int>(bits), bits > 0 ? scale.data_ptr<c10::Half>() : nullptr,
                bits > 0 ? bias.data_ptr<c10::Half>() : nullptr, bits > 0 ? packed.data_ptr<uint8_t>() : nullptr,
                codes.data()};
  const Pack* pp = bits > 0 ? &pk : nullptr;
  const float* xp = x.data_ptr<float>();
  const uint8_t* sp = warm ? start.data_ptr<uint8_t>() : nullptr;
  float* blo = best_lo.data_ptr<float>();
  float* bhi = best_hi.data_ptr<float>();
  uint8_t* fp = found.data_ptr<uint8_t>();
  const Search p{static_cast<float>(levels), static_cast<float>(bins), steps / move, static_cast<float>(move),
                 patience, refine, warm_strides, fits, cold_fits};
  // Cold and warm rows go in separate groups, each in row order: a group runs one schedule.
  int64_t cold[kLanes], hot[kLanes];
  int nc = 0, nh = 0;
  for (int64_t r = 0; r < n; ++r) {
    if (kept.flag != nullptr && kept.flag[r]) {
      pack_on(xp, r, d, kept.scale[r], kept.bias[r], p.lv, pk);
      fp[2 * r] = sp[2 * r];
      fp[2 * r + 1] = sp[2 * r + 1];
      continue;
    }
    if (warm_start(sp, r, bins)) {
      hot[nh++] = r;
      if (nh == kLanes) search_group(xp, hot, nh, d, p, sp, scratch.data(), blo, bhi, fp, pp), nh = 0;
    } else {
      cold[nc++] = r;
      if (nc == kLanes) search_group(xp, cold, nc, d, p, nullptr, scratch.data(), blo, bhi, fp, pp), nc = 0;
    }
  }
  if (nh) search_group(xp, hot, nh, d, p, sp, scratch.data(), blo, bhi, fp, pp);
  if (nc) search_group(xp, cold, nc, d, p, nullptr, scratch.data(), blo, bhi, fp, pp);
  return {best_lo, best_hi, found, scale, bias, packed};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> greedy_range(const at::Tensor& x, int64_t levels, int64_t bins,
                                                            int64_t steps, int64_t move, int64_t patience,
                                                            int64_t refine, const at::Tensor& start,
                                                            const std::vector<int64_t>& warm_strides,
                                                            int64_t fits, int64_t cold_fits) {
  auto r = search_rows(x, levels, bins, steps, move, patience, refine, start, warm_strides, fits, cold_fits, 0);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r)};
}

// The search, then each row's fp16 scale and offset and its codes packed, group by group while
// the group's rows are in cache: one pass over the rows instead of the search's and pack_codes'.
// `kept` (bool [n], or empty: none), with `kept_scale` and `kept_bias` (fp16 [n]): rows
// unchanged since their last encoding, packed on it again without a search (needs `start`).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> search_pack(
    const at::Tensor& x, int64_t bits, int64_t bins, int64_t steps, int64_t move, int64_t patience, int64_t refine,
    const at::Tensor& start, const std::vector<int64_t>& warm_strides, int64_t fits, int64_t cold_fits,
    const at::Tensor& kept, const at::Tensor& kept_scale, const at::Tensor& kept_bias) {
  if (bits < 1 || bits > 8) throw std::invalid_argument("search_pack: bits must be 1 to 8");
  Kept k;
  if (kept.numel() > 0) {
    const int64_t n = x.dim() == 2 ? x.size(0) : -1;
    auto per_row = [n](const at::Tensor& t, at::ScalarType type) {
      return t.scalar_type() == type && t.is_contiguous() && t.dim() == 1 && t.size(0) == n;
    };
    if (!per_row(kept, at::kBool) || !per_row(kept_scale, at::kHalf) || !per_row(kept_bias, at::kHalf) ||
        start.numel() != 2 * n) {
      throw std::invalid_argument(
          "search_pack: kept must be contiguous bool [n] with fp16 kept_scale and kept_bias [n] and a start");
    }
    k = Kept{kept.data_ptr<bool>(), kept_scale.data_ptr<c10::Half>(), kept_bias.data_ptr<c10::Half>()};
  }
  auto r = search_rows(x, (1 << bits) - 1, bins, steps, move, patience, refine, start, warm_strides, fits,
                       cold_fits, bits, k);
  return {std::get<2>(r), std::get<3>(r), std::get<4>(r), std::get<5>(r)};
}

// Every row's codes on its own scale (`bias`, `inv`: float32 per row), packed densely in row
// order: the bytes pack_bits(codes) gives, without the n x d intermediate tensors.
at::Tensor pack_codes(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& inv, int64_t bits) {
  if (x.dim() != 2 || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.device().type() != at::kCPU) {
    throw std::invalid_argument("pack_codes: x must be a contiguous 2-d float32 CPU tensor");
  }
  const int64_t n = x.size(0), d = x.size(1);
  if (bias.numel() != n || inv.numel() != n || bias.scalar_type() != at::kFloat || inv.scalar_type() != at::kFloat ||
      !bias.is_contiguous() || !inv.is_contiguous()) {
    throw std::invalid_argument("pack_codes: bias and inv must be contiguous float32 with one value per row");
  }
  if (bits < 1 || bits > 8) throw std::invalid_argument("pack_codes: bits must be 1 to 8");
  const int64_t total = (n * d * bits + 7) / 8;
  at::Tensor out = at::zeros({total}, x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const float* ip = inv.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const float levels = static_cast<float>((1 << bits) - 1);
  std::vector<uint8_t> codes(static_cast<size_t>(d));
  for (int64_t r = 0; r < n; ++r) {
    row_codes(xp + r * d, d, bp[r], ip[r], levels, codes.data());
    put_bits(codes.data(), d, static_cast<int>(bits), r * d * bits, op);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("greedy_range", &greedy_range,
        "per-row [lo, hi] and steps in of the adaptive quantizer's range search, cold or warm",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("search_pack", &search_pack,
        "the range search with each row's fp16 scale, offset and packed codes (kept rows: on given ones, no "
        "search): (found, scale, bias, codes)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("pack_codes", &pack_codes, "per-row codes of rows on their scales, densely packed",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
