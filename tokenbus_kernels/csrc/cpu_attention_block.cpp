// Paged decode attention's math over one block of cached rows (cpu_decode_attention.cpp walks the blocks):
// scores, online softmax and P·V for the query heads that share a KV head (GQA). Built after
// cpu_attention.cpp in the same translation unit (tokenbus_kernels/cpu.py), whose cache kinds it reads.
//
// Vectors are GCC vector extensions of the widest registers the build targets (Lanes: one zmm, or one ymm
// with -mno-avx512f; the plain build lowers them to what it has), so the same code serves every build.
// Where head_dim (D) is a compile-time multiple of kLanes (64, 128) and a block has whole vectors of rows:
//   - scores: kLanes rows at once (score_lanes). A row's q·k is D / kLanes FMAs into a vector of partial
//     sums; instead of one horizontal sum per row and query head (log2(kLanes) shuffle-adds and a scalar
//     store), the kLanes rows' vectors are folded pairwise by a tree of two-source shuffles (kLanes - 1 folds
//     of two shuffles and an add), which leaves row j's score in lane j, stored at once. A transposed copy of
//     K ([D, kLanes], q broadcast into the FMAs) needs no tree, but transposing a 16 × 64 block costs ~256
//     shuffles per (block, KV head), the tree 30 per query head (90 for SmolLM2's group of 3); and the tree
//     reads an fp32 cache in place, the widened scratch, or bf16/int8 rows converted in registers alike.
//   - softmax: each head's weights by an inline vector exp (exp_lanes), all heads' block maxima before any
//     exp (independent chains, overlapped), the heads' corrections in one exp_lanes.
//   - P·V: up to 4 heads per pass over the block's V rows (pv_heads): each V vector is loaded once for
//     them, and their accumulators make enough independent FMA chains to fill both FMA units.
// Other shapes (head_dim 80 or 96, blocks of 8 with AVX-512, a sequence's partial last block) take the
// per-row loops (head_dot, std::exp, rescale_accumulate). docs/quantization.md has the measurements.

#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;  // one zmm
#else
constexpr int kLanes = 8;  // one ymm (AVX2)
#endif
using Lanes = float __attribute__((vector_size(kLanes * sizeof(float))));
using LaneIdx = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));
#define TB_INLINE inline __attribute__((always_inline))  // GCC left some of these as calls

// The rows of a block kPrefetchBlocks ahead (cpu_decode_attention.cpp), asked for a row at a time while this
// block's rows are read. As one burst per block (128 prefetches at block 16, head_dim 64: more than the
// line-fill buffers hold, so the CPU stalls) the unshared rows of bench_kv_kernel_ab were ~5% slower. A
// prefetch still costs its issue: over L2-resident blocks (its shared prefix) none at all was ~10% faster,
// but a real decode step's blocks come from DRAM. base null: nothing to prefetch.
struct Ahead {
  const char* base;  // the future block's first row of the KV head
  int64_t row_bytes, head_bytes;
  TB_INLINE void row(int64_t r) const {
    if (base == nullptr) return;
    for (int64_t d = 0; d < head_bytes; d += 64) __builtin_prefetch(base + r * row_bytes + d);
  }
};

// kLanes codes from p as floats (bf16: a 16-bit shift; int8: sign-extend and convert; scales not applied)
TB_INLINE Lanes load_lanes(const float* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof x);
  return x;
}
// (GCC 12 turns __builtin_convertvector from 8- or 16-bit codes into scalar code, so those two are intrinsics)
TB_INLINE Lanes load_lanes(const uint16_t* p) {
#if defined(__AVX512F__)
  return Lanes(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16)));
#elif defined(__AVX2__)
  return Lanes(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(p))), 16)));
#else
  Lanes x;
  for (int i = 0; i < kLanes; ++i) x[i] = KvBf16::load(p, i);
  return x;
#endif
}
TB_INLINE Lanes load_lanes(const int8_t* p) {
#if defined(__AVX512F__)
  return Lanes(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  return Lanes(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
#else
  Lanes x;
  for (int i = 0; i < kLanes; ++i) x[i] = static_cast<float>(p[i]);
  return x;
#endif
}

// one fold: lanes lo[i] and hi[i] of (x, y) hold partial sums of the same row; their sums, one vector
TB_INLINE Lanes fold(Lanes x, Lanes y, LaneIdx lo, LaneIdx hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// p[s]: slot s's kLanes partial sums (slot s holds row kRowOfSlot[s]); returns row j's sum in lane j. Each
// level halves the vectors and the partials per row; the masks pick whole 128-bit blocks or in-block pairs
// (vshuff32x4 / vperm2f128, vshufps), and kRowOfSlot is where the tree leaves each slot's row.
#if defined(__AVX512F__)
constexpr int kRowOfSlot[kLanes] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
TB_INLINE Lanes sum_across(Lanes* p) {
  const LaneIdx lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const LaneIdx lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const LaneIdx lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const LaneIdx lo1 = {0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30};
  for (int i = 0; i < 8; ++i) p[i] = fold(p[2 * i], p[2 * i + 1], lo8, lo8 + 8);
  for (int i = 0; i < 4; ++i) p[i] = fold(p[2 * i], p[2 * i + 1], lo4, lo4 + 4);
  for (int i = 0; i < 2; ++i) p[i] = fold(p[2 * i], p[2 * i + 1], lo2, lo2 + 2);
  return fold(p[0], p[1], lo1, lo1 + 1);
}
#else
constexpr int kRowOfSlot[kLanes] = {0, 4, 1, 5, 2, 6, 3, 7};
TB_INLINE Lanes sum_across(Lanes* p) {
  const LaneIdx lo4 = {0, 1, 2, 3, 8, 9, 10, 11};
  const LaneIdx lo2 = {0, 1, 8, 9, 4, 5, 12, 13};
  const LaneIdx lo1 = {0, 2, 8, 10, 4, 6, 12, 14};
  for (int i = 0; i < 4; ++i) p[i] = fold(p[2 * i], p[2 * i + 1], lo4, lo4 + 4);
  for (int i = 0; i < 2; ++i) p[i] = fold(p[2 * i], p[2 * i + 1], lo2, lo2 + 2);
  return fold(p[0], p[1], lo1, lo1 + 1);
}
#endif

// out[j] = q·k_j * scale_j for the kLanes rows k_j = kb + j * row (q: one query head's D floats), read in
// slot order so that the tree leaves row j in lane j
template <typename Kind, int D>
TB_INLINE void score_lanes(const float* q, const typename Kind::T* kb, int64_t row, float* out, Ahead pf) {
  constexpr int kChunks = D / kLanes;
  static_assert(D % kLanes == 0);
  Lanes qv[kChunks];
#pragma GCC unroll 16
  for (int c = 0; c < kChunks; ++c) qv[c] = load_lanes(q + c * kLanes);
  Lanes p[kLanes];
#pragma GCC unroll 16
  for (int s = 0; s < kLanes; ++s) {
    const typename Kind::T* kr = kb + kRowOfSlot[s] * row;
    pf.row(kRowOfSlot[s]);
    Lanes acc = qv[0] * load_lanes(kr);
#pragma GCC unroll 16
    for (int c = 1; c < kChunks; ++c) acc += qv[c] * load_lanes(kr + c * kLanes);
    if constexpr (Kind::kExtra > 0) acc *= Kind::scale(kr, D);
    p[s] = acc;
  }
  const Lanes sums = sum_across(p);
  std::memcpy(out, &sums, sizeof sums);
}

// q·k over one head, k's codes widened to fp32 (its scale is applied by the caller): the per-row fallback.
// D > 0 is head_dim fixed at compile time (the loops unroll); D = 0 reads it at run time.
template <typename Kind, int D>
inline float head_dot(const float* a, const typename Kind::T* b, int64_t head_dim) {
  const int64_t n = D > 0 ? D : head_dim;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < n; ++d) s += a[d] * Kind::load(b, d);
  return s;
}

// e^x lane-wise for x <= 0 (Cephes' expf: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-7 polynomial, 2^n
// into the exponent bits; relative error ~2e-7); x below -87 (masked rows' -1e30) gives 0. Inline: the
// vectorised std::exp of -ffast-math is a libmvec call per 8 lanes, plus scalar expf calls for the rest.
TB_INLINE Lanes exp_lanes(Lanes x) {
  const Lanes zero = {};
  const auto tiny = x < -87.f;
  x = tiny ? zero - 87.f : x;
  const LaneIdx n = __builtin_convertvector(x * 1.44269504f - 0.5f, LaneIdx);  // round(x log2 e), x <= 0
  const Lanes nf = __builtin_convertvector(n, Lanes);
  const Lanes r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  Lanes y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const LaneIdx bits = (n + 127) << 23;
  Lanes pow2;
  std::memcpy(&pow2, &bits, sizeof pow2);
  return tiny ? zero : y * pow2;
}

// op over a vector's lanes (a sum or a max), by log2(kLanes) butterfly steps: GCC's loop over the lanes
// was a chain of scalar ops on extracted lanes, ~40 instructions for 16 lanes
template <typename Op>
TB_INLINE float across(Lanes x, Op op) {
#if defined(__AVX512F__)
  const LaneIdx x8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const LaneIdx x4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const LaneIdx x2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const LaneIdx x1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  x = op(x, __builtin_shuffle(x, x8));
#else
  const LaneIdx x4 = {4, 5, 6, 7, 0, 1, 2, 3};
  const LaneIdx x2 = {2, 3, 0, 1, 6, 7, 4, 5};
  const LaneIdx x1 = {1, 0, 3, 2, 5, 4, 7, 6};
#endif
  x = op(x, __builtin_shuffle(x, x4));
  x = op(x, __builtin_shuffle(x, x2));
  x = op(x, __builtin_shuffle(x, x1));
  return x[0];
}
TB_INLINE Lanes lanes_max(Lanes a, Lanes b) { return a > b ? a : b; }
TB_INLINE Lanes lanes_add(Lanes a, Lanes b) { return a + b; }

// The online-softmax step of the `group` heads over a block's n scores (scores [group, block_size], each
// head's overwritten by its weights e^(s - new max)): updates each head's running max m and sum l, and
// leaves in corr[h] the factor for its accumulator. Blocks of whole vectors take exp_lanes, others std::exp.
inline void softmax_heads(float* scores, int64_t group, int64_t block_size, int64_t n, float* m, float* l,
                          float* corr) {
  const bool lanes = n % kLanes == 0;
  for (int64_t h = 0; h < group; ++h) {  // maxima first: the heads' exps below are independent chains
    const float* sh = scores + h * block_size;
    float block_max = m[h];
    if (lanes) {
      Lanes mx = load_lanes(sh);
      for (int64_t j = kLanes; j < n; j += kLanes) mx = lanes_max(mx, load_lanes(sh + j));
      block_max = std::max(block_max, across(mx, lanes_max));
    } else {
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, sh[j]);
    }
    corr[h] = m[h] - block_max;
    m[h] = block_max;
  }
  for (int64_t h = 0; h < group; h += kLanes) {  // the corrections, kLanes heads per exp_lanes
    Lanes x = {};
    const int64_t count = std::min<int64_t>(kLanes, group - h);
    std::memcpy(&x, corr + h, count * sizeof(float));
    x = exp_lanes(x);
    std::memcpy(corr + h, &x, count * sizeof(float));
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sh = scores + h * block_size;
    float block_sum = 0.f;
    if (lanes) {
      Lanes sum = {};
      for (int64_t j = 0; j < n; j += kLanes) {
        const Lanes e = exp_lanes(load_lanes(sh + j) - m[h]);
        std::memcpy(sh + j, &e, sizeof e);
        sum += e;
      }
      block_sum = across(sum, lanes_add);
    } else {
      const float block_max = m[h];
#pragma omp simd reduction(+ : block_sum)
      for (int64_t j = 0; j < n; ++j) {
        sh[j] = std::exp(sh[j] - block_max);
        block_sum += sh[j];
      }
    }
    l[h] = l[h] * corr[h] + block_sum;
  }
}

// P·V of H heads over fp32 rows (a cache's or the widened scratch): acc_h = acc_h * corr[h] + sum_j
// p[h * p_stride + j] * v[j * row] for h < H, acc [H, D]. The accumulators are GCC vectors, which stay in
// registers (GCC 12 kept a float a[D] on the stack, a store and a reload per row). Each is a chain of
// dependent FMAs (4 cycles each); both FMA units need 8 or more in flight, so a lone head with fewer than 8
// vectors alternates rows between two sets of them.
template <int D, int H>
TB_INLINE void pv_heads(float* __restrict acc, const float* corr, const float* __restrict p, int64_t p_stride,
                        const float* __restrict v, int64_t row, int64_t n, Ahead pf) {
  constexpr int kVecs = D / kLanes, kSets = H == 1 && kVecs < 8 ? 2 : 1;
  static_assert(D % kLanes == 0);
  Lanes a[kSets][H][kVecs];
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) {
      a[0][h][i] = load_lanes(acc + h * D + i * kLanes) * corr[h];
      if constexpr (kSets > 1) a[1][h][i] = Lanes{};
    }
  int64_t j = 0;
  for (; j + kSets <= n; j += kSets)
#pragma GCC unroll 2
    for (int t = 0; t < kSets; ++t) {
      const float* vr = v + (j + t) * row;
      pf.row(j + t);
#pragma GCC unroll 16
      for (int i = 0; i < kVecs; ++i) {
        const Lanes x = load_lanes(vr + i * kLanes);
#pragma GCC unroll 4
        for (int h = 0; h < H; ++h) a[t][h][i] += p[h * p_stride + j + t] * x;
      }
    }
  for (; j < n; ++j) {
    pf.row(j);
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) {
      const Lanes x = load_lanes(v + j * row + i * kLanes);
#pragma GCC unroll 4
      for (int h = 0; h < H; ++h) a[0][h][i] += p[h * p_stride + j] * x;
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 16
    for (int i = 0; i < kVecs; ++i) {
      Lanes sum = a[0][h][i];
      if constexpr (kSets > 1) sum += a[1][h][i];
      std::memcpy(acc + h * D + i * kLanes, &sum, sizeof sum);
    }
}

// acc = acc * correction + sum_j p[j] * scale_j * v[j * row] for one query head over one block's n rows of
// any kind, converted in the loop: the per-row fallback (run-time head_dim; bf16/int8 rows of a lone head)
template <typename Kind, int D>
inline void rescale_accumulate(float* __restrict acc, float correction, const float* __restrict p,
                               const typename Kind::T* __restrict v, int64_t row, int64_t n, int64_t head_dim,
                               Ahead pf) {
  const int64_t dim = D > 0 ? D : head_dim;
  float a[D > 0 ? D : 1];  // D > 0: a local copy (unrolled loops); else acc in place
  float* x = D > 0 ? a : acc;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) x[d] = acc[d] * correction;
  for (int64_t j = 0; j < n; ++j) {
    const typename Kind::T* vr = v + j * row;
    pf.row(j);
    const float pj = p[j] * Kind::scale(vr, dim);
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) x[d] += pj * Kind::load(vr, d);
  }
  if constexpr (D > 0) std::memcpy(acc, a, sizeof a);
}

// A score no row may weigh (a key older than that row's own window, cascade attention's shared part):
// far below the running maxima's -1e30 start, so even a row with nothing else yet gets e^(-1e38 + 1e30) = 0
constexpr float kMaskedAway = -1e38f;

// One block of n rows (kb, vb: its first K and V row of the KV head, row elements apart) against the `group`
// query heads qs [group, head_dim]: scores, soft-capped if softcap > 0; the first `masked` rows (older than a
// sliding window) set to -1e30, whose exp is 0 (finite: -ffast-math); with head_first (one first position per
// query row, the block's first row at position block_pos), each query row's keys before its own first set to
// kMaskedAway; then the online-softmax update of the running max m, sum l and accumulator acc [group,
// head_dim], and the P·V accumulation. scores: scratch for [group, block_size] scores, then `group` corrections.
template <typename Kind, int D>
void attend_block(const float* qs, int64_t group, int64_t head_dim, const typename Kind::T* kb,
                  const typename Kind::T* vb, int64_t row, int64_t n, int64_t masked, int64_t block_size,
                  float softcap, float* scores, float* acc, float* m, float* l, Ahead pf_k, Ahead pf_v,
                  const int64_t* head_first = nullptr, int64_t block_pos = 0) {
  constexpr bool kLaneRows = D > 0 && D % kLanes == 0;
  const Ahead none = {nullptr, 0, 0};
  for (int64_t h = 0; h < group; ++h) {
    const Ahead pf = h == 0 ? pf_k : none;
    int64_t j = 0;
    if constexpr (kLaneRows)
      for (; j + kLanes <= n; j += kLanes) {
        const Ahead pfj = {pf.base ? pf.base + j * pf.row_bytes : nullptr, pf.row_bytes, pf.head_bytes};
        score_lanes<Kind, D>(qs + h * head_dim, kb + j * row, row, scores + h * block_size + j, pfj);
      }
    for (; j < n; ++j) {  // rows past the block's last whole vector (a sequence's last block; small blocks)
      pf.row(j);
      const typename Kind::T* kr = kb + j * row;
      scores[h * block_size + j] = head_dot<Kind, D>(qs + h * head_dim, kr, head_dim) * Kind::scale(kr, head_dim);
    }
  }
  if (softcap > 0.f)
    for (int64_t h = 0; h < group; ++h)
      for (int64_t j = 0; j < n; ++j) {
        float& s = scores[h * block_size + j];
        s = softcap * std::tanh(s / softcap);
      }
  for (int64_t j = 0; j < masked; ++j)
    for (int64_t h = 0; h < group; ++h) scores[h * block_size + j] = -1e30f;
  if (head_first != nullptr)
    for (int64_t h = 0; h < group; ++h) {
      const int64_t hidden = std::min(n, head_first[h] - block_pos);
      for (int64_t j = 0; j < hidden; ++j) scores[h * block_size + j] = kMaskedAway;
    }
  float* corr = scores + group * block_size;
  softmax_heads(scores, group, block_size, n, m, l, corr);
  if constexpr (kLaneRows && std::is_same_v<Kind, KvF32>) {
    // heads per pass: their accumulators within ~3/4 of the registers (32 zmm, or 16 ymm), at most 4
    constexpr int kMaxHeads = std::clamp((kLanes == 16 ? 24 : 12) / (D / kLanes), 1, 4);
    for (int64_t h = 0; h < group;) {
      const int64_t take = std::min<int64_t>(kMaxHeads, group - h);
      float* ah = acc + h * D;
      const Ahead pf = h == 0 ? pf_v : none;
      const float* ph = scores + h * block_size;
      switch (take) {
        case 1: pv_heads<D, 1>(ah, corr + h, ph, block_size, vb, row, n, pf); break;
        case 2: pv_heads<D, 2>(ah, corr + h, ph, block_size, vb, row, n, pf); break;
        case 3: pv_heads<D, 3>(ah, corr + h, ph, block_size, vb, row, n, pf); break;
        default: pv_heads<D, 4>(ah, corr + h, ph, block_size, vb, row, n, pf); break;
      }
      h += take;
    }
  } else {
    for (int64_t h = 0; h < group; ++h)
      rescale_accumulate<Kind, D>(acc + h * head_dim, corr[h], scores + h * block_size, vb, row, n, head_dim,
                                  h == 0 ? pf_v : none);
  }
}

}  // namespace
