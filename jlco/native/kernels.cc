// jlco's XLA:CPU kernels for decode steps, as XLA FFI handlers.
//
//   jlco_matmul_nn: x [B, M, K] · w [B, K, N] → out [B, M, N]   (weights [in, out])
//   jlco_matmul_nt: x [B, M, K] · w [B, N, K]ᵀ → out [B, M, N]  (weights [out, in])
//   jlco_top_k:     scores [..., L] → the k largest (values, positions) per row
//   jlco_indexer_scores: q [b, s, H, D], w [b, s, H], keys [b, n, D] (bf16 or f32)
//                   → Σ_h w_h · ReLU(q_h · key) [b, s, n], the lightning indexer's scores
//
// Why: a decode step's matmuls have M = batch × query tokens rows (1..8) against
// weights read once per step, so they are bound by the weight bytes. XLA:CPU runs M = 1
// as a streaming matvec but M = 2..8 as a GEMM that repacks the weights every call, at a
// third of the matvec's bandwidth (BUILD_NOTES, sessions 19-20). These kernels stream
// each weight row once for all M rows.
//
// Numerics: every output element is one sequential fused multiply-add chain over k
// (nn) or a fixed 16/8-lane split of k reduced in a fixed order (nt), whatever M, the
// thread split or the batch: a row's result does not depend on the rows beside it.
//
// Top-k: lax.top_k's order exactly (descending in the total order of floats, -0.0 below
// 0.0, as XLA:CPU's TopK compares them; equal values by lower position), one pass over
// the row against a heap of the k best as packed integers, where XLA:CPU partially sorts
// an index array through value lookups.
//
// Indexer scores: the H heads of a query side by side in vector lanes (queries held
// transposed, [D][H]), each key's D values broadcast against them, so one key's H dot
// products take D vector FMAs and one lane reduction (ReLU and head weights applied in
// the lanes); the keys are streamed once for every query of the step. Each score is a
// fixed-order sum over d, then over heads: it depends on nothing but its query and key.
//
// Threads: the work (column chunks of each batch entry, rows of the top-k, key chunks of
// the indexer) is cut into
// pieces that the caller and the tasks it schedules on XLA's intra-op pool claim from a
// shared counter; the caller waits only for pieces other threads have claimed, so a
// busy pool never stalls it.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;      // M handled here (jlco.native.MAX_ROWS)
constexpr int64_t kColumnBlock = 2048;  // nn: output columns accumulated at once (L1/L2)
constexpr int64_t kMinChunk = 256;   // columns per thread chunk, at least

// out[m, n0:n1] = Σ_k x[m, k] · w[k, n]  (w row-major [K, N]).
template <int M>
void NnRows(const float* __restrict x, const float* __restrict w, float* __restrict out,
            int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t nb = n0; nb < n1; nb += kColumnBlock) {
    const int64_t len = std::min(kColumnBlock, n1 - nb);
    alignas(64) float acc[M][kColumnBlock];
    for (int m = 0; m < M; ++m) std::fill(acc[m], acc[m] + len, 0.0f);
    int64_t k = 0;
    for (; k + 4 <= K; k += 4) {   // four weight rows per pass over the accumulators
      const float* __restrict w0 = w + k * N + nb;
      const float* __restrict w1 = w0 + N;
      const float* __restrict w2 = w1 + N;
      const float* __restrict w3 = w2 + N;
      float a0[M], a1[M], a2[M], a3[M];
      for (int m = 0; m < M; ++m) {
        a0[m] = x[m * K + k];
        a1[m] = x[m * K + k + 1];
        a2[m] = x[m * K + k + 2];
        a3[m] = x[m * K + k + 3];
      }
#pragma GCC ivdep
      for (int64_t n = 0; n < len; ++n) {
        const float v0 = w0[n], v1 = w1[n], v2 = w2[n], v3 = w3[n];
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m) {
          float s = acc[m][n];
          s = std::fma(a0[m], v0, s);
          s = std::fma(a1[m], v1, s);
          s = std::fma(a2[m], v2, s);
          s = std::fma(a3[m], v3, s);
          acc[m][n] = s;
        }
      }
    }
    for (; k < K; ++k) {
      const float* __restrict w0 = w + k * N + nb;
      for (int m = 0; m < M; ++m) {
        const float xm = x[m * K + k];
        for (int64_t n = 0; n < len; ++n) acc[m][n] = std::fma(xm, w0[n], acc[m][n]);
      }
    }
    for (int m = 0; m < M; ++m) std::memcpy(out + m * N + nb, acc[m], len * sizeof(float));
  }
}

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

inline float Sum(Vec v) {   // a fixed pairwise order
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(Vec));
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  return lanes[0];
}

// out[m, n0:n1] = Σ_k x[m, k] · w[n, k]  (w row-major [N, K]): J weight rows at a time,
// each (m, n) a vector of kLanes partial sums over k, reduced at the end.
template <int M>
void NtRows(const float* __restrict x, const float* __restrict w, float* __restrict out,
            int64_t K, int64_t N, int64_t n0, int64_t n1) {
  constexpr int J = M <= 4 ? 4 : 2;
  const int64_t kv = K / kLanes * kLanes;
  int64_t n = n0;
  for (; n < n1; n += J) {
    const int jn = static_cast<int>(std::min<int64_t>(J, n1 - n));
    Vec acc[M][J];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < J; ++j) acc[m][j] = Vec{};
    for (int64_t k = 0; k < kv; k += kLanes) {
      Vec xv[M];
      for (int m = 0; m < M; ++m) xv[m] = Load(x + m * K + k);
      for (int j = 0; j < J; ++j) {
        if (j >= jn) break;
        const Vec wv = Load(w + (n + j) * K + k);
        for (int m = 0; m < M; ++m) acc[m][j] += xv[m] * wv;
      }
    }
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < jn; ++j) {
        float s = Sum(acc[m][j]);
        for (int64_t k = kv; k < K; ++k) s = std::fma(x[m * K + k], w[(n + j) * K + k], s);
        out[m * N + n + j] = s;
      }
    }
  }
}

using RowsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t,
                        int64_t);

template <int M>
struct NnK { static constexpr RowsFn fn = &NnRows<M>; };
template <int M>
struct NtK { static constexpr RowsFn fn = &NtRows<M>; };

template <template <int> class K>
RowsFn ForRows(int64_t m) {
  switch (m) {
    case 1: return K<1>::fn;
    case 2: return K<2>::fn;
    case 3: return K<3>::fn;
    case 4: return K<4>::fn;
    case 5: return K<5>::fn;
    case 6: return K<6>::fn;
    case 7: return K<7>::fn;
    case 8: return K<8>::fn;
    default: return nullptr;
  }
}

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// piece(i) for i in 0..total-1, on the caller and up to threads - 1 pool tasks.
template <typename Piece>
void ParallelFor(ffi::ThreadPool& pool, int64_t total, Piece piece) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  auto progress = std::make_shared<Progress>();
  auto work = [=]() {
    for (;;) {
      const int64_t c = progress->next.fetch_add(1, std::memory_order_relaxed);
      if (c >= total) return;
      piece(c);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(threads, total) - 1;
  for (int64_t t = 0; t < helpers; ++t) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  // Every piece is claimed by now; wait for the ones helpers still run: spin briefly,
  // then yield, then sleep with backoff (a descheduled helper needs this core).
  for (int64_t spins = 0; progress->done.load(std::memory_order_acquire) < total; ++spins) {
    if (spins < 1024) {
      Pause();
    } else if (spins < 4096) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(
          std::min<int64_t>(1000, (spins - 4096) / 8 + 1)));
    }
  }
}

ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
               ffi::ResultBuffer<ffi::F32> out, bool transposed) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 3 || wd.size() != 3 || xd[0] != wd[0])
    return ffi::Error::InvalidArgument("jlco matmul: want x [B, M, K] and w [B, K, N] / [B, N, K]");
  const int64_t B = xd[0], M = xd[1], K = xd[2];
  const int64_t N = transposed ? wd[1] : wd[2];
  if ((transposed ? wd[2] : wd[1]) != K)
    return ffi::Error::InvalidArgument("jlco matmul: x and w disagree on K");
  const RowsFn rows = transposed ? ForRows<NtK>(M) : ForRows<NnK>(M);
  if (M < 1 || M > kMaxRows || rows == nullptr)
    return ffi::Error::InvalidArgument("jlco matmul: M must be in 1..8");
  if (B == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(out->typed_data(), out->typed_data() + B * M * N, 0.0f);
    return ffi::Error::Success();
  }
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_entry =
      std::max<int64_t>(1, std::min<int64_t>(threads, N / kMinChunk));
  const int64_t chunk = (N + per_entry - 1) / per_entry;
  const int64_t per = (N + chunk - 1) / chunk;   // chunks per batch entry
  ParallelFor(pool, B * per, [=](int64_t c) {
    const int64_t b = c / per, n0 = (c % per) * chunk;
    rows(xp + b * M * K, wp + b * K * N, op + b * M * N, K, N, n0, std::min(N, n0 + chunk));
  });
  return ffi::Error::Success();
}

// XLA:CPU's TopK order: the float's bits as a signed integer, negatives flipped
// (INT32_MAX - bits), computed on uint32_t so the wrap is defined (XLA does the same).
inline uint32_t OrderKey(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x80000000u) ? 0x7FFFFFFFu - bits : bits;
}

// One word per element whose unsigned order is the top-k order: the float's order key
// above, the position complemented below (equal values: the lower position ranks higher).
inline uint64_t Rank(float v, int64_t i) {
  const uint32_t key = OrderKey(v) ^ 0x80000000u;
  return (static_cast<uint64_t>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(i));
}

// A min-heap of the k best ranks seen so far: an element that does not beat the heap's
// worst costs one comparison (most of a long row), one that does log k.
void TopKRow(const float* __restrict v, int64_t L, int64_t k, float* __restrict vals,
             int32_t* __restrict idx, std::vector<uint64_t>& heap) {
  heap.resize(k);
  for (int64_t i = 0; i < k; ++i) heap[i] = Rank(v[i], i);
  const auto worse = std::greater<uint64_t>();
  std::make_heap(heap.begin(), heap.end(), worse);
  for (int64_t i = k; i < L; ++i) {
    const uint64_t r = Rank(v[i], i);
    if (r <= heap.front()) continue;
    std::pop_heap(heap.begin(), heap.end(), worse);
    heap.back() = r;
    std::push_heap(heap.begin(), heap.end(), worse);
  }
  std::sort(heap.begin(), heap.end(), std::greater<uint64_t>());
  for (int64_t j = 0; j < k; ++j) {
    const int64_t i = 0xFFFFFFFFu - static_cast<uint32_t>(heap[j]);
    idx[j] = static_cast<int32_t>(i);
    vals[j] = v[i];
  }
}

ffi::Error TopK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores,
                ffi::ResultBuffer<ffi::F32> vals, ffi::ResultBuffer<ffi::S32> idx) {
  const auto sd = scores.dimensions();
  const auto od = vals->dimensions();
  if (sd.size() < 1 || od.size() != sd.size())
    return ffi::Error::InvalidArgument("jlco top_k: values must have the scores' rank");
  const int64_t L = sd[sd.size() - 1], k = od[od.size() - 1];
  if (k > L) return ffi::Error::InvalidArgument("jlco top_k: k is larger than the row");
  const int64_t rows = L == 0 ? 0 : scores.element_count() / L;
  if (rows == 0 || k == 0) return ffi::Error::Success();
  const float* sp = scores.typed_data();
  float* vp = vals->typed_data();
  int32_t* ip = idx->typed_data();
  ParallelFor(pool, rows, [=](int64_t r) {
    thread_local std::vector<uint64_t> heap;
    TopKRow(sp + r * L, L, k, vp + r * k, ip + r * k, heap);
  });
  return ffi::Error::Success();
}

inline float Bf16ToF32(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Scores of keys [n0, n1) of one request for its S queries: U keys per pass, HV vectors
// of heads. qt: [S][D][HV] vectors (heads past H zero), wv: [S][HV] (zero past H).
template <int HV, int U>
void ScoreKeys(const Vec* __restrict qt, const Vec* __restrict wv, const void* keys,
               bool bf16, int64_t S, int64_t D, int64_t n, int64_t n0, int64_t n1,
               float* __restrict out, std::vector<float>& kf) {
  kf.resize(U * D);
  for (int64_t t = n0; t < n1; t += U) {
    const int u_n = static_cast<int>(std::min<int64_t>(U, n1 - t));
    for (int u = 0; u < u_n; ++u) {
      if (bf16) {
        const uint16_t* row = static_cast<const uint16_t*>(keys) + (t + u) * D;
        for (int64_t d = 0; d < D; ++d) kf[u * D + d] = Bf16ToF32(row[d]);
      } else {
        std::memcpy(&kf[u * D], static_cast<const float*>(keys) + (t + u) * D,
                    D * sizeof(float));
      }
    }
    for (int u = u_n; u < U; ++u) std::fill(&kf[u * D], &kf[u * D] + D, 0.0f);
    for (int64_t q = 0; q < S; ++q) {
      const Vec* __restrict qd = qt + q * D * HV;
      Vec acc[U][HV];
      for (int u = 0; u < U; ++u)
        for (int j = 0; j < HV; ++j) acc[u][j] = Vec{};
      for (int64_t d = 0; d < D; ++d) {
        for (int j = 0; j < HV; ++j) {
          const Vec qv = qd[d * HV + j];
          for (int u = 0; u < U; ++u) acc[u][j] += kf[u * D + d] * qv;
        }
      }
      for (int u = 0; u < u_n; ++u) {
        Vec tot = Vec{};
        for (int j = 0; j < HV; ++j) {
          const Vec a = acc[u][j];
          // ReLU as jnp.maximum(a, 0): NaN stays NaN, -0.0 becomes 0.
          tot += ((a > 0.0f) | (a != a) ? a : Vec{}) * wv[q * HV + j];
        }
        out[q * n + t + u] = Sum(tot);
      }
    }
  }
}

using ScoreFn = void (*)(const Vec*, const Vec*, const void*, bool, int64_t, int64_t,
                         int64_t, int64_t, int64_t, float*, std::vector<float>&);

ScoreFn ScoreFor(int64_t hv) {
  switch (hv) {
    case 1: return &ScoreKeys<1, 8>;
    case 2: return &ScoreKeys<2, 6>;
    case 3: case 4: return &ScoreKeys<4, 3>;
    case 5: case 6: case 7: case 8: return &ScoreKeys<8, 2>;
    default: return nullptr;
  }
}

constexpr int64_t kKeyChunk = 512;   // keys per piece of work

ffi::Error IndexerScores(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<ffi::F32> w, ffi::AnyBuffer keys,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions();
  const auto wd = w.dimensions();
  const auto kd = keys.dimensions();
  if (qd.size() != 4 || wd.size() != 3 || kd.size() != 3)
    return ffi::Error::InvalidArgument("jlco indexer_scores: want q [b,s,H,D], w [b,s,H], keys [b,n,D]");
  const int64_t B = qd[0], S = qd[1], H = qd[2], D = qd[3], N = kd[1];
  if (wd[0] != B || wd[1] != S || wd[2] != H || kd[0] != B || kd[2] != D)
    return ffi::Error::InvalidArgument("jlco indexer_scores: shapes disagree");
  const bool bf16 = keys.element_type() == ffi::DataType::BF16;
  if (!bf16 && keys.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("jlco indexer_scores: keys must be bf16 or f32");
  const int64_t hv_need = (H + kLanes - 1) / kLanes;
  const ScoreFn fn = ScoreFor(hv_need);
  if (fn == nullptr) return ffi::Error::InvalidArgument("jlco indexer_scores: too many heads");
  const int64_t HV = hv_need <= 2 ? hv_need : (hv_need <= 4 ? 4 : 8);
  if (B == 0 || S == 0 || N == 0) return ffi::Error::Success();
  // Queries transposed to [b][s][D][HV lanes] and weights to [b][s][HV], zero-padded.
  auto qt = std::make_shared<std::vector<Vec>>(B * S * D * HV, Vec{});
  auto wv = std::make_shared<std::vector<Vec>>(B * S * HV, Vec{});
  const float* qp = q.typed_data();
  const float* wp = w.typed_data();
  for (int64_t bs = 0; bs < B * S; ++bs) {
    float* qlanes = reinterpret_cast<float*>(qt->data() + bs * D * HV);
    float* wlanes = reinterpret_cast<float*>(wv->data() + bs * HV);
    for (int64_t h = 0; h < H; ++h) {
      wlanes[h] = wp[bs * H + h];
      for (int64_t d = 0; d < D; ++d) qlanes[d * HV * kLanes + h] = qp[(bs * H + h) * D + d];
    }
  }
  const int64_t width = bf16 ? 2 : 4;
  const char* kp = static_cast<const char*>(keys.untyped_data());
  float* op = out->typed_data();
  const int64_t per = (N + kKeyChunk - 1) / kKeyChunk;
  ParallelFor(pool, B * per, [=](int64_t c) {
    thread_local std::vector<float> kf;
    const int64_t b = c / per, n0 = (c % per) * kKeyChunk;
    fn(qt->data() + b * S * D * HV, wv->data() + b * S * HV, kp + b * N * D * width, bf16, S,
       D, N, n0, std::min(N, n0 + kKeyChunk), op + b * S * N, kf);
  });
  return ffi::Error::Success();
}

ffi::Error Nn(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
              ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, x, w, out, false);
}

ffi::Error Nt(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
              ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, x, w, out, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlcoMatmulNn, Nn,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlcoMatmulNt, Nt,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlcoTopK, TopK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JlcoIndexerScores, IndexerScores,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
