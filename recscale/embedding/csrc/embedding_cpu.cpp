// Native CPU kernels of recscale's table-batched embedding operator.
//
// Two entry points serve one group of same-dim fp32 tables (one weight buffer, per-feature
// row offsets):
//   * pool:            key-major jagged ids -> the sample-major pooled output [B, K * dim],
//                      written directly (no id permutation pass), parallel over samples;
//   * backward_update: exact, deterministic backward fused with the sparse optimizer: ids are
//                      grouped by row with a stable parallel radix sort, each unique row's
//                      gradient is summed in one fixed order (sample-major id order, the same
//                      order as the pure-PyTorch path, whatever the thread count), and the
//                      optimizer updates the row in the same pass; or, with no optimizer, the
//                      unique rows and their summed gradients are returned for Python to apply.
//
// The optimizer math mirrors recscale/embedding/optimizers.py, which stays the one reference
// definition (the tests compare the two); each update below names the class it mirrors.
//
// Threads come from ATen's parallel_for (torch's own OpenMP runtime and torch.set_num_threads),
// so no second thread pool competes for the cores. Inner loops run over the embedding dim; the
// common dims are compile-time constants so the compiler keeps a row in vector registers.

#include <torch/python.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int kPrefetch = 8;  // ids ahead whose rows are prefetched (measured: 4-16 similar, 0 much slower)
constexpr int64_t kSampleBlock = 16;  // samples whose row pointers are gathered at once
constexpr int kMaxRadixBits = 11;     // bits per radix pass (2048 buckets)

inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 1);
}

inline void prefetch_row_rw(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 1, 1);
}

// The jagged input of one group, in the batch's key-major layout.
struct Input {
  const at::Tensor& values;    // [n] int64 or int32 ids, key-major over the batch's features
  const int64_t* offsets;      // [Kb * B + 1] start of each (batch feature, sample) bag
  int64_t B;                   // samples
  int64_t K;                   // features of this group
  const int64_t* feat_idx;     // [K] index of each group feature among the batch's features
  const int64_t* row_off;      // [K] first row of each feature's table in the group buffer
  const uint8_t* is_mean;      // [K] 1 where the feature's table pools by mean
  const float* weights;        // [n] per-id weights or nullptr
};

// Scale of every id of a bag: its weight times 1/len for mean pooling (as the Python path
// folds them: ``weights * (1 / len)``, both in float32).
inline float id_scale(const Input& in, int64_t k, int64_t p, float inv_len) {
  float s = in.is_mean[k] ? inv_len : 1.0f;
  return in.weights ? in.weights[p] * s : s;
}

// a * b + c, fused (one rounding) where the CPU has FMA, as ATen's vectorised kernels are.
inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

inline float inv_length(int64_t len) { return 1.0f / static_cast<float>(len > 0 ? len : 1); }

// ------------------------------------------------------------------------------------ forward

template <typename IdT, int DC>
void pool_impl(const Input& in, const float* W, int64_t dim_rt, const int64_t* num_rows, float* out,
               int64_t* bad) {
  const int64_t D = DC > 0 ? DC : dim_rt;
  const IdT* values = in.values.data_ptr<IdT>();
  const int64_t B = in.B, K = in.K;
  at::parallel_for(0, B, 8, [&](int64_t b0, int64_t b1) {
    std::vector<const float*> ptr;
    std::vector<float> scale;
    std::vector<int64_t> bag_end;
    std::vector<float> acc_dyn(DC > 0 ? 0 : D);
    alignas(64) float acc_fixed[DC > 0 ? DC : 1];
    float* acc = DC > 0 ? acc_fixed : acc_dyn.data();
    for (int64_t bs = b0; bs < b1; bs += kSampleBlock) {
      const int64_t be = std::min(b1, bs + kSampleBlock);
      ptr.clear();
      scale.clear();
      bag_end.clear();
      for (int64_t b = bs; b < be; ++b) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t bag = in.feat_idx[k] * B + b;
          const int64_t p0 = in.offsets[bag], p1 = in.offsets[bag + 1];
          const float inv = inv_length(p1 - p0);
          const int64_t rows = num_rows[k];
          for (int64_t p = p0; p < p1; ++p) {
            const int64_t id = static_cast<int64_t>(values[p]);
            if (static_cast<uint64_t>(id) >= static_cast<uint64_t>(rows)) {
              // Report the first bad id (by position) and pool it as row 0 of the table.
              int64_t seen = __atomic_load_n(&bad[0], __ATOMIC_RELAXED);
              while ((seen < 0 || p < seen) &&
                     !__atomic_compare_exchange_n(&bad[0], &seen, p, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
              }
              ptr.push_back(W + in.row_off[k] * D);
            } else {
              ptr.push_back(W + (in.row_off[k] + id) * D);
            }
            scale.push_back(id_scale(in, k, p, inv));
          }
          bag_end.push_back(static_cast<int64_t>(ptr.size()));
        }
      }
      const int64_t total = static_cast<int64_t>(ptr.size());
      for (int64_t i = 0; i < std::min<int64_t>(kPrefetch, total); ++i) prefetch_row(ptr[i], D * 4);
      int64_t i = 0, bagi = 0;
      for (int64_t b = bs; b < be; ++b) {
        float* orow = out + b * K * D;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t end = bag_end[bagi++];
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) acc[j] = 0.0f;
          for (; i < end; ++i) {
            if (i + kPrefetch < total) prefetch_row(ptr[i + kPrefetch], D * 4);
            const float* r = ptr[i];
            const float s = scale[i];
#pragma omp simd
            for (int64_t j = 0; j < D; ++j) acc[j] = madd(s, r[j], acc[j]);
          }
          float* o = orow + k * D;
#pragma omp simd
          for (int64_t j = 0; j < D; ++j) o[j] = acc[j];
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------ grouping

// Ids of one batch grouped by row: ``sorted[i] = row << 32 | e`` in ascending row order,
// ties in ascending sample-major position ``e``; ``src[e]`` is the sample-major bag (the
// row of grad_out viewed as [B * K, dim]) and ``scale[e]`` the id's scale (when any).
struct Grouped {
  at::Tensor sorted_t, src_t, scale_t, seg_t;
  const uint64_t* sorted = nullptr;
  const int32_t* src = nullptr;
  const float* scale = nullptr;
  const int64_t* seg = nullptr;  // [U + 1] start of each unique row's run in ``sorted``
  int64_t n = 0, U = 0;
};

int bits_for(int64_t num_rows) {
  int bits = 0;
  while (bits < 63 && (int64_t{1} << bits) < num_rows) ++bits;
  return std::max(bits, 1);
}

// Stable LSD radix sort of ``a`` by bits [32, 32 + key_bits); ``tmp`` is scratch of equal size.
// Each thread counts its own contiguous chunk, so a bucket's elements keep their input order.
uint64_t* radix_sort(uint64_t* a, uint64_t* tmp, int64_t n, int key_bits) {
  const int passes = (key_bits + kMaxRadixBits - 1) / kMaxRadixBits;
  const int width = (key_bits + passes - 1) / passes;
  const int64_t buckets = int64_t{1} << width;
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 4096 + 1));
  std::vector<int64_t> hist(static_cast<size_t>(T * buckets));
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = 32 + pass * width;
    const uint64_t mask = static_cast<uint64_t>(buckets - 1);
    std::fill(hist.begin(), hist.end(), 0);
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t* h = hist.data() + t * buckets;
        const int64_t lo = n * t / T, hi = n * (t + 1) / T;
        for (int64_t i = lo; i < hi; ++i) ++h[(a[i] >> shift) & mask];
      }
    });
    int64_t run = 0;  // exclusive prefix over (bucket, thread)
    for (int64_t v = 0; v < buckets; ++v)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t c = hist[t * buckets + v];
        hist[t * buckets + v] = run;
        run += c;
      }
    at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        int64_t* h = hist.data() + t * buckets;
        const int64_t lo = n * t / T, hi = n * (t + 1) / T;
        for (int64_t i = lo; i < hi; ++i) tmp[h[(a[i] >> shift) & mask]++] = a[i];
      }
    });
    std::swap(a, tmp);
  }
  return a;
}

template <typename IdT>
Grouped group_rows(const Input& in, int64_t group_rows_total) {
  Grouped g;
  const IdT* values = in.values.data_ptr<IdT>();
  const int64_t B = in.B, K = in.K;
  // Sample-major start of each bag (b, k).
  std::vector<int64_t> sm_off(static_cast<size_t>(B * K + 1));
  sm_off[0] = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t bag = in.feat_idx[k] * B + b;
      sm_off[b * K + k + 1] = sm_off[b * K + k] + (in.offsets[bag + 1] - in.offsets[bag]);
    }
  const int64_t n = sm_off[B * K];
  g.n = n;
  const bool scaled = in.weights != nullptr || [&] {
    for (int64_t k = 0; k < K; ++k)
      if (in.is_mean[k]) return true;
    return false;
  }();
  auto u64 = at::TensorOptions().dtype(at::kLong);
  at::Tensor buf_a = at::empty({std::max<int64_t>(n, 1)}, u64);
  at::Tensor buf_b = at::empty({std::max<int64_t>(n, 1)}, u64);
  g.src_t = at::empty({std::max<int64_t>(n, 1)}, at::TensorOptions().dtype(at::kInt));
  if (scaled) g.scale_t = at::empty({std::max<int64_t>(n, 1)}, at::TensorOptions().dtype(at::kFloat));
  auto* a = reinterpret_cast<uint64_t*>(buf_a.data_ptr<int64_t>());
  auto* src = g.src_t.data_ptr<int32_t>();
  float* scale = scaled ? g.scale_t.data_ptr<float>() : nullptr;
  at::parallel_for(0, B, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t bag = in.feat_idx[k] * B + b;
        const int64_t p0 = in.offsets[bag], p1 = in.offsets[bag + 1];
        const float inv = inv_length(p1 - p0);
        int64_t e = sm_off[b * K + k];
        for (int64_t p = p0; p < p1; ++p, ++e) {
          const uint64_t row = static_cast<uint64_t>(in.row_off[k] + static_cast<int64_t>(values[p]));
          a[e] = (row << 32) | static_cast<uint64_t>(e);
          src[e] = static_cast<int32_t>(b * K + k);
          if (scale) scale[e] = id_scale(in, k, p, inv);
        }
      }
  });
  uint64_t* sorted = n ? radix_sort(a, reinterpret_cast<uint64_t*>(buf_b.data_ptr<int64_t>()), n,
                                    bits_for(group_rows_total))
                       : a;
  g.sorted_t = sorted == a ? buf_a : buf_b;
  g.sorted = sorted;
  g.src = src;
  g.scale = scale;
  // Runs of equal rows: count starts per chunk, then write them.
  const int64_t T = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n / 4096 + 1));
  std::vector<int64_t> starts_in(static_cast<size_t>(T + 1), 0);
  auto is_start = [&](int64_t i) { return i == 0 || (sorted[i] >> 32) != (sorted[i - 1] >> 32); };
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t c = 0;
      for (int64_t i = n * t / T; i < n * (t + 1) / T; ++i) c += is_start(i);
      starts_in[t + 1] = c;
    }
  });
  for (int64_t t = 0; t < T; ++t) starts_in[t + 1] += starts_in[t];
  g.U = starts_in[T];
  g.seg_t = at::empty({g.U + 1}, u64);
  int64_t* seg = g.seg_t.data_ptr<int64_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int64_t u = starts_in[t];
      for (int64_t i = n * t / T; i < n * (t + 1) / T; ++i)
        if (is_start(i)) seg[u++] = i;
    }
  });
  seg[g.U] = n;
  g.seg = seg;
  return g;
}

// Runs unique rows [u0, u1) in chunks of about equal id counts, one chunk per task; the result
// of each row never depends on the split.
template <typename F>
void for_each_row_chunk(const Grouped& g, F&& body) {
  const int64_t T = at::get_num_threads();
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(g.U, T * 8));
  std::vector<int64_t> bound(static_cast<size_t>(chunks + 1));
  for (int64_t c = 0; c <= chunks; ++c) {
    const int64_t pos = g.n * c / chunks;
    bound[c] = std::lower_bound(g.seg, g.seg + g.U, pos) - g.seg;
  }
  bound[chunks] = g.U;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      if (bound[c] < bound[c + 1]) body(bound[c], bound[c + 1]);
  });
}

// Sums the gradient of unique row u into acc (dim D), in sorted (sample-major) order.
template <int DC>
inline void sum_row(const Grouped& g, const float* grad, int64_t D, int64_t u, float* acc) {
#pragma omp simd
  for (int64_t j = 0; j < D; ++j) acc[j] = 0.0f;
  const int64_t i0 = g.seg[u], i1 = g.seg[u + 1];
  for (int64_t i = i0; i < i1; ++i) {
    if (i + kPrefetch < g.n) {
      const uint32_t ea = static_cast<uint32_t>(g.sorted[i + kPrefetch]);
      prefetch_row(grad + static_cast<int64_t>(g.src[ea]) * D, D * 4);
    }
    const uint32_t e = static_cast<uint32_t>(g.sorted[i]);
    const float* r = grad + static_cast<int64_t>(g.src[e]) * D;
    const float s = g.scale ? g.scale[e] : 1.0f;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) acc[j] = madd(s, r[j], acc[j]);
  }
}

// ------------------------------------------------------------------------------------ optimizers

enum OptKind : int64_t { kSGD = 0, kRowWiseAdagrad = 1, kAdagrad = 2, kAdam = 3 };

struct OptArgs {
  int64_t kind;
  std::vector<double> hp;  // per kind, see update_row
  float* w;                // [rows, D]
  float* s0;               // first state tensor or nullptr
  float* s1;               // second state tensor or nullptr
  uint8_t* touched;        // [rows] or nullptr
};

// One unique row's update from its summed gradient ``g``; ``msq`` (row-wise Adagrad only), when
// given, is the row's mean square gradient over its whole row (a column shard holds part of it).
template <int DC>
inline void update_row(const OptArgs& o, int64_t D, int64_t row, const float* g, const float* msq = nullptr) {
  float* w = o.w + row * D;
  switch (o.kind) {
    case kSGD: {  // mirrors SGD: w += (-lr) * g  (index_add_ with alpha = -lr)
      const float alpha = static_cast<float>(o.hp[0]);
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) w[j] = madd(alpha, g[j], w[j]);
      break;
    }
    case kRowWiseAdagrad: {  // mirrors RowWiseAdagrad: G += mean(g^2); w += (-lr) * g / (sqrt(G) + eps)
      const float value = static_cast<float>(o.hp[0]), eps = static_cast<float>(o.hp[1]);
      float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < D; ++j) sq += g[j] * g[j];
      float* G = o.s0 + row;
      *G += msq ? *msq : sq / static_cast<float>(D);
      const float denom = std::sqrt(*G) + eps;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) w[j] = w[j] + (value * g[j]) / denom;  // addcdiv_
      break;
    }
    case kAdagrad: {  // mirrors Adagrad: G += g*g; w += (-lr) * g / (sqrt(G) + eps), per element
      const float value = static_cast<float>(o.hp[0]), eps = static_cast<float>(o.hp[1]);
      float* G = o.s0 + row * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        G[j] = madd(g[j], g[j], G[j]);                              // addcmul_
        w[j] = w[j] + (value * g[j]) / (std::sqrt(G[j]) + eps);  // addcdiv_
      }
      break;
    }
    case kAdam: {  // mirrors Adam (lazy, bias-corrected by the step)
      // hp: beta1, 1 - beta1, beta2, 1 - beta2, bias correction 2, -lr / bias correction 1, eps
      const float b1 = static_cast<float>(o.hp[0]), c1 = static_cast<float>(o.hp[1]);
      const float b2 = static_cast<float>(o.hp[2]), c2 = static_cast<float>(o.hp[3]);
      const float bc2 = static_cast<float>(o.hp[4]), value = static_cast<float>(o.hp[5]);
      const float eps = static_cast<float>(o.hp[6]);
      float* m = o.s0 + row * D;
      float* v = o.s1 + row * D;
#pragma omp simd
      for (int64_t j = 0; j < D; ++j) {
        m[j] = madd(c1, g[j], m[j] * b1);                                    // mul_, add_(alpha)
        v[j] = madd(c2 * g[j], g[j], v[j] * b2);                             // mul_, addcmul_
        w[j] = w[j] + (value * m[j]) / (std::sqrt(v[j] / bc2) + eps);        // addcdiv_
      }
      break;
    }
    default:
      break;
  }
  if (o.touched) o.touched[row] = 1;
}

template <int DC>
void fused_update_impl(const Grouped& g, const float* grad, int64_t dim_rt, const OptArgs& o) {
  const int64_t D = DC > 0 ? DC : dim_rt;
  for_each_row_chunk(g, [&](int64_t u0, int64_t u1) {
    std::vector<float> acc_dyn(DC > 0 ? 0 : D);
    alignas(64) float acc_fixed[DC > 0 ? DC : 1];
    float* acc = DC > 0 ? acc_fixed : acc_dyn.data();
    for (int64_t u = u0; u < u1; ++u) {
      if (u + 2 < u1) {
        const int64_t ahead = static_cast<int64_t>(g.sorted[g.seg[u + 2]] >> 32);
        prefetch_row_rw(o.w + ahead * D, D * 4);
      }
      sum_row<DC>(g, grad, D, u, acc);
      update_row<DC>(o, D, static_cast<int64_t>(g.sorted[g.seg[u]] >> 32), acc);
    }
  });
}

template <int DC>
void summed_impl(const Grouped& g, const float* grad, int64_t dim_rt, int64_t* unique, float* summed) {
  const int64_t D = DC > 0 ? DC : dim_rt;
  for_each_row_chunk(g, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      unique[u] = static_cast<int64_t>(g.sorted[g.seg[u]] >> 32);
      sum_row<DC>(g, grad, D, u, summed + u * D);
    }
  });
}

// Calls f.template operator()<DC>() with DC the compile-time dim when it is a common one.
template <typename F>
void dispatch_dim(int64_t D, F&& f) {
  switch (D) {
    case 16: f(std::integral_constant<int, 16>()); break;
    case 32: f(std::integral_constant<int, 32>()); break;
    case 64: f(std::integral_constant<int, 64>()); break;
    case 128: f(std::integral_constant<int, 128>()); break;
    case 256: f(std::integral_constant<int, 256>()); break;
    default: f(std::integral_constant<int, 0>()); break;
  }
}

void check(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument("recscale native embedding kernel: " + msg);
}

struct InputTensors {
  at::Tensor values, offsets, feat_idx, row_off, is_mean, weights;
  int64_t B;
  Input view() const {
    return Input{values,
                 offsets.data_ptr<int64_t>(),
                 B,
                 feat_idx.numel(),
                 feat_idx.data_ptr<int64_t>(),
                 row_off.data_ptr<int64_t>(),
                 is_mean.data_ptr<uint8_t>(),
                 weights.defined() ? weights.data_ptr<float>() : nullptr};
  }
};

InputTensors make_input(const at::Tensor& values, const at::Tensor& offsets, int64_t B, const at::Tensor& feat_idx,
                        const at::Tensor& row_off, const at::Tensor& is_mean, const c10::optional<at::Tensor>& weights) {
  check(values.dim() == 1 && values.is_contiguous() &&
            (values.scalar_type() == at::kLong || values.scalar_type() == at::kInt),
        "values must be a contiguous 1-D int64 or int32 tensor");
  check(offsets.scalar_type() == at::kLong && offsets.is_contiguous(), "offsets must be contiguous int64");
  check(feat_idx.scalar_type() == at::kLong && row_off.scalar_type() == at::kLong &&
            is_mean.scalar_type() == at::kByte && feat_idx.numel() == row_off.numel() &&
            feat_idx.numel() == is_mean.numel(),
        "feat_idx/row_off must be int64 and is_mean uint8, one entry per feature");
  check(B >= 0 && (offsets.numel() - 1) % std::max<int64_t>(B, 1) == 0, "offsets must have features * B + 1 entries");
  at::Tensor w;
  if (weights.has_value() && weights->defined()) {
    w = *weights;
    check(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == values.numel(),
          "weights must be contiguous float32, one per id");
  }
  return InputTensors{values, offsets, feat_idx.contiguous(), row_off.contiguous(), is_mean.contiguous(), w, B};
}

}  // namespace

// Pooled lookup: returns (out [B, K * D] float32, bad [1] int64: position of the first id out
// of its table's range, or -1).
std::vector<at::Tensor> pool(const at::Tensor& weight, const at::Tensor& values, const at::Tensor& offsets,
                             int64_t B, const at::Tensor& feat_idx, const at::Tensor& row_off,
                             const at::Tensor& num_rows, const at::Tensor& is_mean,
                             const c10::optional<at::Tensor>& weights) {
  check(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
        "weight must be a contiguous float32 [rows, dim] tensor");
  InputTensors it = make_input(values, offsets, B, feat_idx, row_off, is_mean, weights);
  check(num_rows.scalar_type() == at::kLong && num_rows.numel() == feat_idx.numel(), "num_rows: one int64 per feature");
  at::Tensor nr = num_rows.contiguous();
  const int64_t D = weight.size(1), K = feat_idx.numel();
  at::Tensor out = at::empty({B, K * D}, weight.options());
  at::Tensor bad = at::empty({1}, at::TensorOptions().dtype(at::kLong));
  bad.data_ptr<int64_t>()[0] = -1;
  Input in = it.view();
  const float* W = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  int64_t* badp = bad.data_ptr<int64_t>();
  const int64_t* nrp = nr.data_ptr<int64_t>();
  dispatch_dim(D, [&](auto dc) {
    constexpr int DC = decltype(dc)::value;
    if (values.scalar_type() == at::kLong)
      pool_impl<int64_t, DC>(in, W, D, nrp, o, badp);
    else
      pool_impl<int32_t, DC>(in, W, D, nrp, o, badp);
  });
  return {out, bad};
}

namespace {
Grouped group_any(const InputTensors& it, int64_t group_rows_total) {
  Input in = it.view();
  return it.values.scalar_type() == at::kLong ? group_rows<int64_t>(in, group_rows_total)
                                               : group_rows<int32_t>(in, group_rows_total);
}

void check_grad(const at::Tensor& grad, int64_t B, int64_t K, int64_t D) {
  check(grad.scalar_type() == at::kFloat && grad.is_contiguous() && grad.numel() == B * K * D,
        "grad must be a contiguous float32 [B, K * dim] tensor");
}
// The optimizer's tensors, checked against ``weight`` ([rows, dim] float32) and ``kind``.
OptArgs make_opt_args(const at::Tensor& weight, const std::vector<at::Tensor>& states, int64_t kind,
                      const std::vector<double>& hp, const c10::optional<at::Tensor>& touched) {
  check(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
        "weight must be a contiguous float32 [rows, dim] tensor");
  const int64_t rows = weight.size(0), D = weight.size(1);
  static const int needed[] = {0, 1, 1, 2};
  check(kind >= 0 && kind <= 3 && static_cast<int>(states.size()) == needed[kind], "optimizer kind/state mismatch");
  static const size_t hps[] = {1, 2, 2, 7};
  check(hp.size() == hps[kind], "wrong number of optimizer hyperparameters");
  for (const auto& s : states)
    check(s.scalar_type() == at::kFloat && s.is_contiguous() && s.size(0) == rows, "state tensors: float32 [rows, ...]");
  if (kind == kRowWiseAdagrad) check(states[0].numel() == rows, "row-wise Adagrad state must be [rows, 1]");
  if (kind == kAdagrad || kind == kAdam)
    for (const auto& s : states) check(s.numel() == rows * D, "element-wise state must be [rows, dim]");
  uint8_t* tp = nullptr;
  if (touched.has_value() && touched->defined()) {
    check(touched->scalar_type() == at::kByte && touched->is_contiguous() && touched->numel() == rows,
          "touched must be a contiguous uint8 [rows] tensor");
    tp = touched->data_ptr<uint8_t>();
  }
  return OptArgs{kind, hp, weight.data_ptr<float>(), states.size() > 0 ? states[0].data_ptr<float>() : nullptr,
                 states.size() > 1 ? states[1].data_ptr<float>() : nullptr, tp};
}
}  // namespace

// Fused exact backward + optimizer: updates ``weight`` and ``states`` in place; sets
// ``touched[row] = 1`` for every updated row when ``touched`` is given. Returns the number of
// unique rows updated.
int64_t backward_update(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& offsets, int64_t B,
                        const at::Tensor& feat_idx, const at::Tensor& row_off, const at::Tensor& is_mean,
                        const c10::optional<at::Tensor>& weights, const at::Tensor& weight,
                        const std::vector<at::Tensor>& states, int64_t kind, const std::vector<double>& hp,
                        const c10::optional<at::Tensor>& touched) {
  const OptArgs o = make_opt_args(weight, states, kind, hp, touched);
  const int64_t rows = weight.size(0), D = weight.size(1);
  check(rows < (int64_t{1} << 32), "the group has 2^32 rows or more; use the torch kernel");
  check(values.numel() < (int64_t{1} << 31), "more than 2^31 ids in one batch; use the torch kernel");
  InputTensors it = make_input(values, offsets, B, feat_idx, row_off, is_mean, weights);
  check_grad(grad, B, feat_idx.numel(), D);
  Grouped g = group_any(it, rows);
  const float* gp = grad.data_ptr<float>();
  dispatch_dim(D, [&](auto dc) { fused_update_impl<decltype(dc)::value>(g, gp, D, o); });
  return g.U;
}

// The optimizer alone, on rows whose gradients are already summed (``rows`` [U] distinct,
// ``summed`` [U, dim]), e.g. after replicas or column shards have combined theirs. ``row_msq``
// [U] (row-wise Adagrad) overrides each row's mean square gradient.
void apply_rows(const at::Tensor& rows, const at::Tensor& summed, const c10::optional<at::Tensor>& row_msq,
                const at::Tensor& weight, const std::vector<at::Tensor>& states, int64_t kind,
                const std::vector<double>& hp, const c10::optional<at::Tensor>& touched) {
  const OptArgs o = make_opt_args(weight, states, kind, hp, touched);
  const int64_t R = weight.size(0), D = weight.size(1), U = rows.numel();
  check(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be contiguous int64");
  check(summed.scalar_type() == at::kFloat && summed.is_contiguous() && summed.numel() == U * D,
        "summed must be a contiguous float32 [rows, dim] tensor");
  const float* msq = nullptr;
  if (row_msq.has_value() && row_msq->defined()) {
    check(kind == kRowWiseAdagrad && row_msq->scalar_type() == at::kFloat && row_msq->is_contiguous() &&
              row_msq->numel() == U,
          "row_msq: contiguous float32, one per row, row-wise Adagrad only");
    msq = row_msq->data_ptr<float>();
  }
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t u = 0; u < U; ++u) check(rp[u] >= 0 && rp[u] < R, "a row is out of the table's range");
  const float* sp = summed.data_ptr<float>();
  dispatch_dim(D, [&](auto dc) {
    constexpr int DC = decltype(dc)::value;
    at::parallel_for(0, U, 256, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) update_row<DC>(o, D, rp[u], sp + u * D, msq ? msq + u : nullptr);
    });
  });
}

// Exact backward without the optimizer: (unique rows ascending [U] int64, summed gradients [U, D]).
std::vector<at::Tensor> row_gradients(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& offsets,
                                      int64_t B, const at::Tensor& feat_idx, const at::Tensor& row_off,
                                      const at::Tensor& is_mean, const c10::optional<at::Tensor>& weights,
                                      int64_t rows, int64_t D) {
  check(rows < (int64_t{1} << 32), "the group has 2^32 rows or more; use the torch kernel");
  check(values.numel() < (int64_t{1} << 31), "more than 2^31 ids in one batch; use the torch kernel");
  InputTensors it = make_input(values, offsets, B, feat_idx, row_off, is_mean, weights);
  check_grad(grad, B, feat_idx.numel(), D);
  Grouped g = group_any(it, rows);
  at::Tensor unique = at::empty({g.U}, at::TensorOptions().dtype(at::kLong));
  at::Tensor summed = at::empty({g.U, D}, at::TensorOptions().dtype(at::kFloat));
  const float* gp = grad.data_ptr<float>();
  int64_t* up = unique.data_ptr<int64_t>();
  float* sp = summed.data_ptr<float>();
  dispatch_dim(D, [&](auto dc) { summed_impl<decltype(dc)::value>(g, gp, D, up, sp); });
  return {unique, summed};
}

// Positions of ``keys`` (1-D contiguous non-negative int64) in ascending order, equal keys in
// their original order. Keys and positions under 2^32: each (key << 32 | position) is sorted by
// its key bits with the parallel LSD radix sort of the backward (stable, so positions break
// ties in input order). Otherwise a serial LSD radix sort of positions with 11-bit digits.
// torch's CPU stable sort runs a comparison sort below about 32k elements and a slower radix sort
// above, so this one is used at every size (timings: benchmarks/results/).
at::Tensor stable_argsort(const at::Tensor& keys) {
  check(keys.scalar_type() == at::kLong && keys.dim() == 1 && keys.is_contiguous(),
        "keys must be a contiguous 1-D int64 tensor");
  const int64_t n = keys.numel();
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t top = 0, low = 0;
  for (int64_t i = 0; i < n; ++i) {
    top = std::max(top, k[i]);
    low = std::min(low, k[i]);
  }
  check(low >= 0, "keys must be non-negative");
  const auto opts = at::TensorOptions().dtype(at::kLong);
  if (n > 0 && n < (int64_t{1} << 32) && top < (int64_t{1} << 32)) {
    at::Tensor a = at::empty({n}, opts), b = at::empty({n}, opts);
    auto* pa = reinterpret_cast<uint64_t*>(a.data_ptr<int64_t>());
    at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) pa[i] = (static_cast<uint64_t>(k[i]) << 32) | static_cast<uint64_t>(i);
    });
    uint64_t* sorted = radix_sort(pa, reinterpret_cast<uint64_t*>(b.data_ptr<int64_t>()), n, bits_for(top + 1));
    at::Tensor out = sorted == pa ? b : a;  // the buffer the sort left as scratch holds the result
    int64_t* po = out.data_ptr<int64_t>();
    at::parallel_for(0, n, 16384, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) po[i] = static_cast<int64_t>(sorted[i] & 0xffffffffULL);
    });
    return out;
  }
  at::Tensor a = at::empty({n}, opts), b = at::empty({n}, opts);
  int64_t* src = a.data_ptr<int64_t>();
  int64_t* dst = b.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) src[i] = i;
  constexpr int kBits = 11;
  constexpr int64_t kBuckets = int64_t{1} << kBits;
  std::vector<int64_t> count(kBuckets + 1);
  std::vector<uint16_t> digit(n);
  for (int shift = 0; shift < 63 && (shift == 0 || (top >> shift) > 0); shift += kBits) {
    std::fill(count.begin(), count.end(), 0);
    for (int64_t i = 0; i < n; ++i) {
      digit[i] = static_cast<uint16_t>((k[src[i]] >> shift) & (kBuckets - 1));
      ++count[digit[i] + 1];
    }
    for (int64_t d = 0; d < kBuckets; ++d) count[d + 1] += count[d];
    for (int64_t i = 0; i < n; ++i) dst[count[digit[i]]++] = src[i];
    std::swap(src, dst);
  }
  return src == a.data_ptr<int64_t>() ? a : b;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "recscale native CPU embedding kernels (pooled lookup, fused exact backward + optimizer)";
  m.def("pool", &pool, py::call_guard<py::gil_scoped_release>());
  m.def("backward_update", &backward_update, py::call_guard<py::gil_scoped_release>());
  m.def("row_gradients", &row_gradients, py::call_guard<py::gil_scoped_release>());
  m.def("apply_rows", &apply_rows, py::call_guard<py::gil_scoped_release>());
  m.def("stable_argsort", &stable_argsort, py::call_guard<py::gil_scoped_release>());
}
