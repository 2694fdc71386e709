/* Miles: fp32 CPU kernels for the built-in engine (cpu_decode.py, cpu_layers.py), built at first use by cpu_native.py.
 *
 * A small model's CPU decode step is dozens of tiny torch ops, each costing microseconds of dispatch, and an
 * attention that reads each row's K/V through batched GEMMs of 1-8 rows. The kernels:
 *
 *   miles_rmsnorm       out = w * x * rsqrt(mean(x^2) + eps), per row
 *   miles_silu_mul      out = silu(gate) * up, with [gate | up] the rows of one GEMM's output
 *   miles_attn_step     per row: optional per-head RMSNorm of q and k (Qwen3), rotate-half rotary of q and k,
 *                       the new K/V column written into the window buffer, then attention of the row's query
 *                       heads over its columns [0, col] (the additive mask marks the row's context), softmax
 *                       in fp32, K/V read once per KV head for all R = H / Hk query heads of its group
 *   miles_gemm          x @ W^T for decode rows (register tiles of 6 rows x 64 columns), with the residual added
 *                       or SwiGLU applied in the epilogue; the weights as W^T or in panels of 64 columns (miles_pack)
 *   miles_decode_step   one decode step's embedding, layers and final norm in one OpenMP region (the kernels
 *                       above, phase by phase)
 *   miles_logits        the lm_head's logits, in register tiles of 4 rows x 6 vocabulary rows
 *   miles_decode_window a whole window of K steps in one call, the rows in groups of G: one thread takes a group
 *                       through every step (embedding, layers, final norm, logits, draw), so that its K/V stays in
 *                       the cache and no thread waits for another
 *   miles_write_back    a decode window's new K/V columns into the paged cache; miles_gather the other way
 *   miles_prefill_rope  a prefill layer's q/k norm and rotary, in place, and its K/V into the paged cache
 *   miles_prefill_attn  a prefill layer's causal attention over the pages, per (sequence, KV head)
 *   miles_sample        greedy or Gumbel-max draw (sampler.py's counter-based uniforms) and the token's log-softmax
 *
 * Layouts are the window buffer's (cpu_decode.py): K in blocks of 16 columns [B, Hk, cap / 16, D, 16], V
 * [B, Hk, cap, D], mask [B * Hk, cap], cap a multiple of 16. Both are read front to back, one contiguous run per
 * (row, KV head): a K transposed to [D, cap] would be read as D short runs at a stride of cap, which the CPU's
 * prefetchers follow badly (measured: 6-8 GB/s against 34 GB/s for the same bytes contiguous, one core). The paged
 * cache is runner.py's [S, Hk, D] per layer and K/V; weights are W^T [in, out] contiguous (runner.fuse's CPU layout), or
 * for the GEMMs their panels (miles_pack: each 64-column group's rows one contiguous run).
 *
 * Elementwise arithmetic keeps torch's order (the build passes -ffp-contract=off): the rotary is bit-identical
 * to rope_torch; the reductions (norms, GEMM and dot-product sums, softmax sums) sum in another order, so
 * results differ from torch by rounding (~1e-7 relative). Rows (or GEMM column groups) run in parallel with OpenMP
 * when the work is large enough; torch's own libgomp is the one loaded, so these share its threads.
 *
 * Vectors are GCC/Clang vector extensions of 16 floats: one AVX-512 register, two AVX2 or four NEON ones.
 * D must be a multiple of 16 and at most 256 (the Python side checks).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

static inline v16 ld(const float *p) { v16 x; memcpy(&x, p, sizeof x); return x; }
static inline void st(float *p, v16 x) { memcpy(p, &x, sizeof x); }
static inline v16 splat(float a) { return (v16){0} + a; }
static inline float hsum(v16 x) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += x[i];
  return s;
}
static inline float hmax(v16 x) {
  float m = x[0];
  for (int i = 1; i < 16; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

static inline v16 vselect(i16 take_a, v16 a, v16 b) { return (v16)(((i16)a & take_a) | ((i16)b & ~take_a)); }

/* exp(x) for x in [-87, 88]: Cody-Waite reduction x = k ln2 + r, a degree-6 polynomial for exp(r) (the Cephes
   expf coefficients, ~1 ulp), 2^k through the exponent bits */
static inline v16 exp_core(v16 x) {
  const v16 shifter = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
  const v16 k = (x * 1.44269504088896341f + shifter) - shifter;
  v16 r = x - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  i16 ki;
  for (int i = 0; i < 16; ++i) ki[i] = (int32_t)k[i];
  return p * (v16)((ki + 127) << 23);
}

/* exp(x) for x <= 0 (softmax after subtracting the max): below -87 (or -inf) exactly 0 */
static inline v16 exp_neg(v16 x) {
  const i16 live = x >= -87.0f;
  return (v16)((i16)exp_core(vselect(live, x, splat(-87.0f))) & live);
}

/* exp(x) for any x (silu): clamped to [-87, 88] */
static inline v16 exp_any(v16 x) {
  x = vselect(x > 88.0f, splat(88.0f), x);
  return exp_core(vselect(x >= -87.0f, x, splat(-87.0f)));
}

/* ---------------------------------------------------------------- RMSNorm */
static inline void rmsnorm_row(const float *x, const float *w, float *out, int64_t n, float eps) {
  v16 acc = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) { v16 a = ld(x + i); acc += a * a; }
  float ss = hsum(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / sqrtf(ss / (float)n + eps);
  for (i = 0; i + 16 <= n; i += 16) st(out + i, ld(w + i) * (ld(x + i) * inv));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

/* The kernels' loops are work-sharing (orphaned "omp for") bodies: the exported function opens a parallel region
   around one, miles_decode_step one around all of a step's. Outside any region they run on the calling thread. */
static void rmsnorm_for(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows, int64_t n, float eps) {
#pragma omp for schedule(static)
  for (int64_t r = 0; r < rows; ++r) rmsnorm_row(x + r * x_stride, w, out + r * n, n, eps);
}

void miles_rmsnorm(const float *x, int64_t x_stride, const float *w, float *out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel if (rows * n >= 65536)
  rmsnorm_for(x, x_stride, w, out, rows, n, eps);
}

/* ---------------------------------------------------------------- SwiGLU */
void miles_silu_mul(const float *gu, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= 65536)
  for (int64_t r = 0; r < rows; ++r) {
    const float *g = gu + r * 2 * inter, *u = g + inter;
    float *o = out + r * inter;
    int64_t i = 0;
    for (; i + 16 <= inter; i += 16) {
      v16 a = ld(g + i);
      st(o + i, a / (exp_any(-a) + 1.0f) * ld(u + i));
    }
    for (; i < inter; ++i) o[i] = g[i] / (expf(-g[i]) + 1.0f) * u[i];
  }
}

/* ---------------------------------------------------------------- attention */
/* rotate-half rotary of one head, in place: (x1, x2) -> (x1 cos1 - x2 sin1, x2 cos2 + x1 sin2); the products
   rounded, then added, as rope_torch does (x * cos + cat(-x2, x1) * sin) */
static inline void rope_head(float *x, const float *cos, const float *sin, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cos[i] + (-b) * sin[i];
    x[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

/* scores s[r, t] = scale * q_r . k_t + mask[t] over the 16-column blocks that cover t < n, r < R (R <= 8); s has
   row stride ns = n rounded up to 16 (the last block's extra lanes are computed and never read) */
static inline __attribute__((always_inline)) void qk_block(const float *q, const float *kb, const float *mask, float *s,
                                                         int64_t R, int64_t D, int64_t ns, float scale) {
  for (int64_t t = 0; t < ns; t += 16) {
    const float *blk = kb + t * D; /* block t / 16: [D, 16] */
    v16 acc[8];
    for (int64_t r = 0; r < R; ++r) acc[r] = (v16){0};
    for (int64_t d = 0; d < D; ++d) {
      const v16 k = ld(blk + d * 16);
      for (int64_t r = 0; r < R; ++r) acc[r] += q[r * D + d] * k;
    }
    const v16 m = ld(mask + t);
    for (int64_t r = 0; r < R; ++r) st(s + r * ns + t, acc[r] * scale + m);
  }
}

/* out[r, j0:j0+16*NJ] = sum_{t<n} p[r, t] v[t, j0:...] for r < R (R <= 4), NJ <= 4 vectors */
static inline __attribute__((always_inline)) void pv_block(const float *s, const float *v, float *out, int64_t R, int64_t D,
                                                         int64_t n, int64_t ns, int64_t j0, int64_t NJ) {
  v16 acc[4][4];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NJ; ++j) acc[r][j] = (v16){0};
  for (int64_t t = 0; t < n; ++t) {
    const float *vt = v + t * D + j0;
    for (int64_t j = 0; j < NJ; ++j) {
      const v16 x = ld(vt + 16 * j);
      for (int64_t r = 0; r < R; ++r) acc[r][j] += s[r * ns + t] * x;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < NJ; ++j) st(out + r * D + j0 + 16 * j, acc[r][j]);
}

/* softmax over s[r, :n] for r < R, in place; the rows have stride ns (n rounded up to 16): the lanes past n are set
   to -inf first, so every pass runs on whole vectors and those lanes come out 0 */
static void softmax_rows(float *s, int64_t R, int64_t n, int64_t ns) {
  for (int64_t r = 0; r < R; ++r) {
    float *x = s + r * ns;
    for (int64_t t = n; t < ns; ++t) x[t] = -INFINITY;
    v16 vm = splat(-INFINITY);
    for (int64_t t = 0; t < ns; t += 16) vm = vselect(ld(x + t) > vm, ld(x + t), vm);
    const float mx = hmax(vm);
    v16 vs = {0};
    for (int64_t t = 0; t < ns; t += 16) {
      const v16 e = exp_neg(ld(x + t) - mx);
      st(x + t, e);
      vs += e;
    }
    const float inv = 1.0f / hsum(vs);
    for (int64_t t = 0; t < ns; t += 16) st(x + t, ld(x + t) * inv);
  }
}

/* one KV head of one row: queries q [R, D] (rotated) against kb [cap / 16, D, 16] and v [cap, D] over columns
   t < n; s: R * round16(n) floats of scratch; out [R, D]. The switches hand qk_block / pv_block constant row and
   vector counts, so that their accumulators live in registers. */
static void attend(const float *q, const float *kb, const float *v, const float *mask, float *out, float *s, int64_t R,
                   int64_t D, int64_t n, float scale) {
  const int64_t ns = (n + 15) & ~(int64_t)15;
  for (int64_t r0 = 0; r0 < R; r0 += 8) {
    const float *qr = q + r0 * D;
    float *sr = s + r0 * ns;
    switch (R - r0 < 8 ? R - r0 : 8) {
#define QK(RC) case RC: qk_block(qr, kb, mask, sr, RC, D, ns, scale); break;
      QK(1) QK(2) QK(3) QK(4) QK(5) QK(6) QK(7) QK(8)
#undef QK
    }
  }
  softmax_rows(s, R, n, ns);
  for (int64_t r0 = 0; r0 < R; r0 += 4) {
    const int64_t rc = R - r0 < 4 ? R - r0 : 4;
    for (int64_t j0 = 0; j0 < D; j0 += 64) {
      const int64_t nj = (D - j0) / 16 < 4 ? (D - j0) / 16 : 4;
      const float *sr = s + r0 * ns;
      float *o = out + r0 * D;
      switch (rc * 8 + nj) {
#define PV(RC, NJ) case RC * 8 + NJ: pv_block(sr, v, o, RC, D, n, ns, j0, NJ); break;
        PV(1, 1) PV(1, 2) PV(1, 3) PV(1, 4) PV(2, 1) PV(2, 2) PV(2, 3) PV(2, 4)
        PV(3, 1) PV(3, 2) PV(3, 3) PV(3, 4) PV(4, 1) PV(4, 2) PV(4, 3) PV(4, 4)
#undef PV
      }
    }
  }
}

/* One row of one layer's decode step: the row's q/k/v in row (q and k before norm and rotary), its rotary tables c,
   sn, its buffer row sb; the new K/V into column col, attention over columns [0, col] into out [H * D]. s: scratch of
   R * round16(col + 1) + H * D + D floats. */
static void attn_row(const float *row, const float *c, const float *sn, int64_t sb, const float *q_w, const float *k_w,
                     float qk_eps, float *kb, float *v, const float *mask, float *out, float *s, int64_t H, int64_t Hk,
                     int64_t D, int64_t cap, int64_t col, float scale) {
  const int64_t R = H / Hk, n = col + 1, ns = (n + 15) & ~(int64_t)15;
  float *q = s + R * ns, *kk = q + H * D;
  for (int64_t h = 0; h < H; ++h) {
    if (q_w) rmsnorm_row(row + h * D, q_w, q + h * D, D, qk_eps);
    else memcpy(q + h * D, row + h * D, sizeof(float) * (size_t)D);
    rope_head(q + h * D, c, sn, D);
  }
  for (int64_t g = 0; g < Hk; ++g) {
    const float *kin = row + (H + g) * D, *vin = row + (H + Hk + g) * D;
    if (k_w) rmsnorm_row(kin, k_w, kk, D, qk_eps);
    else memcpy(kk, kin, sizeof(float) * (size_t)D);
    rope_head(kk, c, sn, D);
    float *kbg = kb + (sb * Hk + g) * cap * D, *vg = v + (sb * Hk + g) * cap * D;
    float *kcol = kbg + (col / 16) * 16 * D + col % 16;
    for (int64_t d = 0; d < D; ++d) kcol[d * 16] = kk[d];
    memcpy(vg + col * D, vin, sizeof(float) * (size_t)D);
    attend(q + g * R * D, kbg, vg, mask + (sb * Hk + g) * cap, out + g * R * D, s, R, D, n, scale);
  }
}

static float *scratch(int64_t n) {
  float *s = malloc(sizeof(float) * (size_t)n);
  if (!s) abort(); /* a few KB: never silently skip rows */
  return s;
}

/* One layer's attention for one decode step of B rows.
   qkv [B, qkv_stride]: q heads (H * D), k heads (Hk * D), v heads (Hk * D) of each row (q and k before norm and
   rotary); cos, sin: row b's at cos + b * cs_stride, or with pos (int64 [B]) the table row pos[b] + pos_off;
   q_w, k_w: per-head RMSNorm weights [D] or NULL; slot (int64 [B]) or NULL: row b's buffer row (and mask row), else b;
   kb [B, Hk, cap / 16, D, 16], v [B, Hk, cap, D]: the window buffer, column col gets the new K/V;
   mask [B * Hk, cap]; out [B, H * D]. Attends over columns [0, col]. */
static void attn_step_for(const float *qkv, int64_t qkv_stride, const float *cos, const float *sin, int64_t cs_stride,
                          const int64_t *pos, int64_t pos_off, const int64_t *slot, const float *q_w, const float *k_w,
                          float qk_eps, float *kb, float *v, const float *mask, float *out, int64_t B, int64_t H, int64_t Hk,
                          int64_t D, int64_t cap, int64_t col, float scale) {
  float *s = scratch(H / Hk * ((col + 16) & ~(int64_t)15) + H * D + D); /* this thread's */
#pragma omp for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    const int64_t cr = pos ? pos[b] + pos_off : b;
    attn_row(qkv + b * qkv_stride, cos + cr * cs_stride, sin + cr * cs_stride, slot ? slot[b] : b, q_w, k_w, qk_eps, kb, v,
             mask, out + b * H * D, s, H, Hk, D, cap, col, scale);
  }
  free(s);
}

void miles_attn_step(const float *qkv, int64_t qkv_stride, const float *cos, const float *sin, int64_t cs_stride,
                     const int64_t *pos, int64_t pos_off, const int64_t *slot, const float *q_w, const float *k_w,
                     float qk_eps, float *kb, float *v, const float *mask, float *out, int64_t B, int64_t H, int64_t Hk,
                     int64_t D, int64_t cap, int64_t col, float scale) {
#pragma omp parallel if (B * Hk * (col + 1) * D >= 32768)
  attn_step_for(qkv, qkv_stride, cos, sin, cs_stride, pos, pos_off, slot, q_w, k_w, qk_eps, kb, v, mask, out, B, H, Hk, D,
                cap, col, scale);
}

/* ---------------------------------------------------------------- prefill */
/* The prologue of one layer's prefill of N token rows: per row, optional per-head RMSNorm of q and k, rotate-half
   rotary at the row's position (tables cos_t, sin_t [P, D]), in place in qkv [N, qkv_stride]; then the row's K
   (rotated) and V written into the paged cache kc, vc [S, Hk, D] at slots[i]. */
void miles_prefill_rope(float *qkv, int64_t qkv_stride, const int64_t *pos, const float *cos_t, const float *sin_t,
                        const float *q_w, const float *k_w, float qk_eps, float *kc, float *vc, const int64_t *slots,
                        int64_t N, int64_t H, int64_t Hk, int64_t D) {
#pragma omp parallel for schedule(static) if (N * (H + Hk) * D >= 65536)
  for (int64_t i = 0; i < N; ++i) {
    float *row = qkv + i * qkv_stride;
    const float *c = cos_t + pos[i] * D, *sn = sin_t + pos[i] * D;
    for (int64_t h = 0; h < H + Hk; ++h) {
      const float *w = h < H ? q_w : k_w;
      if (w) rmsnorm_row(row + h * D, w, row + h * D, D, qk_eps);
      rope_head(row + h * D, c, sn, D);
    }
    memcpy(kc + slots[i] * Hk * D, row + H * D, sizeof(float) * (size_t)(Hk * D));
    memcpy(vc + slots[i] * Hk * D, row + (H + Hk) * D, sizeof(float) * (size_t)(Hk * D));
  }
}

/* One layer's prefill attention of B sequences (causal). Sequence b brings q_len[b] query rows at flat rows
   q_start[b] ..; row i sits at position ctx[b] - q_len[b] + i and attends to positions <= that. Its keys and values,
   positions < ctx[b], are in the paged cache kc, vc [S, Hk, D] (page p of the sequence: tables[b * table_stride + p],
   pages of P slots), the new rows' included (miles_prefill_rope wrote them). qkv [N, qkv_stride] holds the rotated
   queries; out [N, H * D]. Each (sequence, KV head) packs its keys into 16-column blocks and its values into rows
   once, in thread-local scratch, then runs the decode attention for each of its query rows with R = H / Hk heads. */
void miles_prefill_attn(const float *qkv, int64_t qkv_stride, const float *kc, const float *vc, const int64_t *tables,
                        int64_t table_stride, int64_t P, const int64_t *q_start, const int64_t *q_len, const int64_t *ctx,
                        float *out, int64_t B, int64_t H, int64_t Hk, int64_t D, int64_t max_ctx, float scale) {
  const int64_t R = H / Hk, cap = (max_ctx + 15) & ~(int64_t)15;
#pragma omp parallel if (B * Hk > 1)
  {
    float *kb = calloc((size_t)(cap * D + cap * D + cap + R * cap), sizeof(float));
    if (!kb) abort();
    float *v = kb + cap * D, *zero = v + cap * D, *s = zero + cap;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * Hk; ++task) {
      const int64_t b = task / Hk, g = task % Hk, n = ctx[b];
      for (int64_t t = 0; t < n; ++t) {
        const int64_t slot = tables[b * table_stride + t / P] * P + t % P;
        const float *kt = kc + (slot * Hk + g) * D;
        float *blk = kb + (t / 16) * 16 * D + t % 16;
        for (int64_t d = 0; d < D; ++d) blk[d * 16] = kt[d];
        memcpy(v + t * D, vc + (slot * Hk + g) * D, sizeof(float) * (size_t)D);
      }
      for (int64_t t = n; t < ((n + 15) & ~(int64_t)15); ++t) /* the last block's lanes past n: finite */
        for (int64_t d = 0; d < D; ++d) kb[(t / 16) * 16 * D + d * 16 + t % 16] = 0.f;
      for (int64_t i = 0; i < q_len[b]; ++i) {
        const int64_t row = q_start[b] + i;
        attend(qkv + row * qkv_stride + g * R * D, kb, v, zero, out + row * H * D + g * R * D, s, R, D,
               n - q_len[b] + i + 1, scale);
      }
    }
    free(kb);
  }
}


/* ---------------------------------------------------------------- sampling */
/* sampler.py's hash of 32-bit values (_mix32, row_hash, uniform_noise): the same integers, in uint32 arithmetic */
static inline uint32_t mix32(uint32_t x) {
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  x = ((x >> 16) ^ x) * 0x45D9F3Bu;
  return (x >> 16) ^ x;
}

/* sampler.sample_torch for rows without filters (top-k, top-p, min-p) or top logprobs: row b of logits [B, V]
   (row stride row_stride) with temperature[b] <= 0 takes argmax z, else argmax (z / T - log(-log u)) with u the row's
   counter-based uniforms (seed seeds[b], output position counters[b] + offset); logp[b] = log_softmax(z / T)[token]
   (T = 1 for greedy rows). Ties go to the lowest id, as torch's argmax. */
static void sample_row(const float *z, float temperature, int64_t seed_in, int64_t counter, int64_t *tok, float *logp,
                       int64_t V) {
  const float t = temperature <= 0.f ? 1.f : temperature;
  float mx = -INFINITY;
  int64_t best = 0;
  for (int64_t v = 0; v < V; ++v)
    if (z[v] / t > mx) { mx = z[v] / t; best = v; }
  if (temperature > 0.f) {
    const uint64_t seed = (uint64_t)seed_in;
    const uint32_t row = mix32(mix32((uint32_t)seed) ^ (uint32_t)counter ^ (uint32_t)(seed >> 32) * 0x1B873593u);
    float top = -INFINITY;
    for (int64_t v = 0; v < V; ++v) {
      const uint32_t x = mix32(row + (uint32_t)v * 0x2545F49u);
      const float u = ((float)(x >> 8) + 0.5f) * (1.0f / 16777216.0f);
      const float g = z[v] / t - logf(-logf(u));
      if (g > top) { top = g; best = v; }
    }
  }
  v16 acc = {0};
  int64_t v = 0;
  for (; v + 16 <= V; v += 16) acc += exp_neg(ld(z + v) / t - mx);
  float sum = hsum(acc);
  for (; v < V; ++v) sum += expf(z[v] / t - mx);
  *tok = best;
  *logp = (z[best] / t - mx) - logf(sum);
}

void miles_sample(const float *logits, int64_t row_stride, const float *temperature, const int64_t *seeds,
                  const int64_t *counters, int64_t offset, int64_t *tok, float *logp, int64_t B, int64_t V) {
#pragma omp parallel for schedule(static) if (B * V >= 262144)
  for (int64_t b = 0; b < B; ++b)
    sample_row(logits + b * row_stride, temperature[b], seeds[b], counters[b] + offset, tok + b, logp + b, V);
}

/* ---------------------------------------------------------------- logits */
/* out[r, v] = x[r] . head[v] for rows r < M of x [M, hidden] (contiguous), vocabulary rows v0 <= v < v1 of head
   [V, hidden] (the lm_head weight as stored, contiguous), out [M, V]. Tiles of up to 4 x rows by 6 vocabulary rows:
   per 16 columns of hidden, 4 + 6 vector loads and 24 multiply-adds into registers; the 6 vocabulary rows stay in L1
   while every row tile passes. Each dot is summed in 16 lanes (lane i over columns i, i + 16, ...), then across the
   lanes, then the tail columns: the same order whatever the tile, so the same bits for any M and range. */
static inline __attribute__((always_inline)) void logits_tile(const float *x, const float *w, float *out, int64_t V,
                                                            int64_t hidden, int64_t RC, int64_t NV) {
  const int64_t hv = hidden & ~(int64_t)15;
  v16 acc[4][6];
  for (int64_t r = 0; r < RC; ++r)
    for (int64_t u = 0; u < NV; ++u) acc[r][u] = (v16){0};
  for (int64_t i = 0; i < hv; i += 16) {
    v16 wv[6];
    for (int64_t u = 0; u < NV; ++u) wv[u] = ld(w + u * hidden + i);
    for (int64_t r = 0; r < RC; ++r) {
      const v16 xv = ld(x + r * hidden + i);
      for (int64_t u = 0; u < NV; ++u) acc[r][u] += xv * wv[u];
    }
  }
  for (int64_t r = 0; r < RC; ++r)
    for (int64_t u = 0; u < NV; ++u) {
      float sum = hsum(acc[r][u]);
      for (int64_t i = hv; i < hidden; ++i) sum += x[r * hidden + i] * w[u * hidden + i];
      out[r * V + u] = sum;
    }
}

static void logits_rows(const float *x, int64_t M, const float *head, float *out, int64_t V, int64_t hidden, int64_t v0,
                        int64_t v1) {
  for (int64_t v = v0; v < v1; v += 6) {
    const int64_t nv = v1 - v < 6 ? v1 - v : 6;
    for (int64_t r = 0; r < M; r += 4) {
      const int64_t rc = M - r < 4 ? M - r : 4;
      const float *xr = x + r * hidden, *w = head + v * hidden;
      float *o = out + r * V + v;
      switch (rc * 8 + nv) {
#define LT(RC, NV) case RC * 8 + NV: logits_tile(xr, w, o, V, hidden, RC, NV); break;
        LT(1, 1) LT(1, 2) LT(1, 3) LT(1, 4) LT(1, 5) LT(1, 6) LT(2, 1) LT(2, 2) LT(2, 3) LT(2, 4) LT(2, 5) LT(2, 6)
        LT(3, 1) LT(3, 2) LT(3, 3) LT(3, 4) LT(3, 5) LT(3, 6) LT(4, 1) LT(4, 2) LT(4, 3) LT(4, 4) LT(4, 5) LT(4, 6)
#undef LT
      }
    }
  }
}

/* the logits of M rows: miles_decode_window's, with the vocabulary split over the threads in blocks of 256 */
void miles_logits(const float *x, int64_t M, const float *head, float *out, int64_t V, int64_t hidden) {
#pragma omp parallel for schedule(static) if (M * V * hidden >= 262144)
  for (int64_t v = 0; v < V; v += 256) logits_rows(x, M, head, out, V, hidden, v, V - v < 256 ? V : v + 256);
}


/* ---------------------------------------------------------------- GEMM for decode rows */
/* acc[r][v] = sum_k x[r, k] * w[k * S + c_v .. + 16] for RC <= 6 rows and NV <= 4 vectors of 16 columns at offsets
   c[v] (S: the weight's row stride): per k, NV vector loads of the weight's row k and RC broadcasts of x, RC * NV fused
   multiply-adds into registers */
static inline __attribute__((always_inline)) void gemm_tile(const float *x, int64_t ldx, const float *wt, int64_t S,
                                                          int64_t K, int64_t RC, const int64_t *c, int64_t NV, v16 acc[6][4]) {
  for (int64_t r = 0; r < RC; ++r)
    for (int64_t v = 0; v < NV; ++v) acc[r][v] = (v16){0};
  for (int64_t k = 0; k < K; ++k) {
    const float *w = wt + k * S;
    v16 wv[4];
    for (int64_t v = 0; v < NV; ++v) wv[v] = ld(w + c[v]);
    for (int64_t r = 0; r < RC; ++r) {
      const float a = x[r * ldx + k];
      for (int64_t v = 0; v < NV; ++v) acc[r][v] += a * wv[v];
    }
  }
}

/* The weights' panel layout (miles_pack): W^T [K, N] as panels [G, K, 64] of 64 columns each, G = N / 64 rounded up;
   with swiglu (N = 2 I) G = I / 32 rounded up, panel g holding the gate columns 32 g .. 32 g + 31, then the matching
   up columns I + 32 g ..; past N (or I) zeros. A column group's 64 weights per k are then 256 contiguous bytes, its
   K rows one contiguous run: in W^T they are 256 bytes at a stride of N floats, which the CPU's prefetchers follow
   badly (SmolLM2-135M's layer GEMMs at 1-6 rows, 2 cores: 1.45-1.8x the bandwidth, measured 2026-12-07). */
void miles_pack(const float *wt, float *out, int64_t K, int64_t N, int swiglu) {
  const int64_t width = swiglu ? N / 2 : N, per = swiglu ? 32 : 64, groups = (width + per - 1) / per;
#pragma omp parallel for schedule(static) if (K * N >= 262144)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t k = 0; k < K; ++k) {
      float *o = out + (g * K + k) * 64;
      for (int64_t c = 0; c < 64; ++c) {
        const int64_t col = g * per + c % per; /* the gate (or only) column; c >= per: its up column */
        o[c] = col < width ? wt[k * N + col + (c >= per ? width : 0)] : 0.0f;
      }
    }
}

/* out = x @ wt (+ add), or with swiglu silu(x @ wt[:, :I]) * (x @ wt[:, I:]) for N = 2 I.
   x [M, K] (row stride ldx), wt = W^T [K, N] contiguous (the CPU layout runner.fuse keeps) or, with packed, its
   panels (miles_pack), add [M, N] (row stride ld_add; it may be out itself: each element is read, then written, by the
   same thread) or NULL, out [M, N] or [M, I] contiguous. N (I with swiglu) must be a multiple of 16. Column groups of
   64 (with swiglu 32 gate + the 32 matching up columns) are split over the threads, each running all row tiles of 6
   against its group, whose weights then stay in its cache. The sums run over k in order, in either layout (the same
   bits): rounding differs from MKL's blocked sums. */
static inline __attribute__((always_inline)) void gemm_block(const float *x, int64_t ldx, const float *wt, const float *add,
                                                           int64_t ld_add, float *out, int64_t M, int64_t K, int64_t N,
                                                           int swiglu, int packed, int64_t gi, int64_t ti) {
  const int64_t width = swiglu ? N / 2 : N, per = swiglu ? 32 : 64;
  const int64_t j = gi * per, r0 = ti * 6, rc = M - r0 < 6 ? M - r0 : 6;
  const int64_t nv = swiglu ? 2 * ((width - j) / 16 < 2 ? (width - j) / 16 : 2) : ((width - j) / 16 < 4 ? (width - j) / 16 : 4);
  /* the group's weights: row stride S, its vectors at offsets c (gate, up, gate, up with swiglu) */
  const float *w = packed ? wt + gi * K * 64 : wt;
  const int64_t S = packed ? 64 : N, col0 = packed ? 0 : j, up = packed ? 32 : N / 2;
  int64_t c[4];
  for (int64_t v = 0; v < nv; ++v) c[v] = swiglu ? (v % 2) * up + col0 + 16 * (v / 2) : col0 + 16 * v;
  v16 acc[6][4];
  const float *xr = x + r0 * ldx;
  switch (rc * 8 + nv) {
#define TILE(RC, NV) case RC * 8 + NV: gemm_tile(xr, ldx, w, S, K, RC, c, NV, acc); break;
    TILE(1, 1) TILE(1, 2) TILE(1, 3) TILE(1, 4) TILE(2, 1) TILE(2, 2) TILE(2, 3) TILE(2, 4)
    TILE(3, 1) TILE(3, 2) TILE(3, 3) TILE(3, 4) TILE(4, 1) TILE(4, 2) TILE(4, 3) TILE(4, 4)
    TILE(5, 1) TILE(5, 2) TILE(5, 3) TILE(5, 4) TILE(6, 1) TILE(6, 2) TILE(6, 3) TILE(6, 4)
#undef TILE
  }
  for (int64_t r = 0; r < rc; ++r) {
    float *o = out + (r0 + r) * width + j;
    if (swiglu) { /* acc[r][2u] gate, acc[r][2u + 1] up; silu(g) * u as miles_silu_mul computes it */
      for (int64_t u = 0; u < nv / 2; ++u) {
        const v16 g = acc[r][2 * u];
        st(o + 16 * u, g / (exp_any(-g) + 1.0f) * acc[r][2 * u + 1]);
      }
    } else if (add) {
      const float *ad = add + (r0 + r) * ld_add + j;
      for (int64_t v = 0; v < nv; ++v) st(o + 16 * v, ld(ad + 16 * v) + acc[r][v]);
    } else {
      for (int64_t v = 0; v < nv; ++v) st(o + 16 * v, acc[r][v]);
    }
  }
}

static void gemm_for(const float *x, int64_t ldx, const float *wt, const float *add, int64_t ld_add, float *out, int64_t M,
                     int64_t K, int64_t N, int swiglu, int packed) {
  const int64_t width = swiglu ? N / 2 : N, per = swiglu ? 32 : 64, groups = (width + per - 1) / per, tiles = (M + 5) / 6;
#pragma omp for collapse(2) schedule(static)
  for (int64_t gi = 0; gi < groups; ++gi)
    for (int64_t ti = 0; ti < tiles; ++ti) gemm_block(x, ldx, wt, add, ld_add, out, M, K, N, swiglu, packed, gi, ti);
}

/* gemm_for's blocks, all on the calling thread (a row group of miles_decode_window) */
static void gemm_rows(const float *x, int64_t ldx, const float *wt, const float *add, int64_t ld_add, float *out, int64_t M,
                      int64_t K, int64_t N, int swiglu, int packed) {
  const int64_t width = swiglu ? N / 2 : N, per = swiglu ? 32 : 64, groups = (width + per - 1) / per, tiles = (M + 5) / 6;
  for (int64_t gi = 0; gi < groups; ++gi)
    for (int64_t ti = 0; ti < tiles; ++ti) gemm_block(x, ldx, wt, add, ld_add, out, M, K, N, swiglu, packed, gi, ti);
}

void miles_gemm(const float *x, int64_t ldx, const float *wt, const float *add, int64_t ld_add, float *out, int64_t M,
                int64_t K, int64_t N, int swiglu, int packed) {
#pragma omp parallel if (M * K * N >= 131072)
  gemm_for(x, ldx, wt, add, ld_add, out, M, K, N, swiglu, packed);
}

/* ---------------------------------------------------------------- the window's K/V into the pages */
/* After a decode window of K steps: columns t0 .. t0 + K - 1 of the window buffer, kb [L, NS, Hk, cap / 16, D, 16]
   and v [L, NS, Hk, cap, D] (NS buffer rows), into the paged cache kv [L, 2, S, Hk, D]: row b (buffer row slot[b]) step
   j (position t = pos0[b] + j) at slot tables[b, min(t / P, W - 1)] * P + t % P (tables int32 [B, W], pages of P); a
   column whose page is the padding page 0 (a request's tokens past its end) is not written. */
void miles_write_back(const float *kb, const float *v, float *kv, const int32_t *tables, int64_t W, int64_t P,
                      const int64_t *pos0, const int64_t *slot, int64_t L, int64_t B, int64_t NS, int64_t Hk, int64_t D,
                      int64_t cap, int64_t S, int64_t t0, int64_t K) {
#pragma omp parallel for collapse(2) schedule(static) if (L * B * K * Hk * D >= 65536)
  for (int64_t l = 0; l < L; ++l)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < Hk; ++g) {
        const int64_t head = (l * NS + slot[b]) * Hk + g;
        const float *kh = kb + head * cap * D, *vh = v + head * cap * D;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t t = t0 + j, p = pos0[b] + j, page = p / P < W - 1 ? p / P : W - 1;
          if (tables[b * W + page] == 0) continue; /* the padding page (blocks.py): never read, and rows share it */
          const int64_t at = (int64_t)tables[b * W + page] * P + p % P;
          float *kd = kv + ((l * 2 * S + at) * Hk + g) * D, *vd = kd + S * Hk * D;
          const float *src = kh + (t / 16) * 16 * D + t % 16;
          for (int64_t d = 0; d < D; ++d) kd[d] = src[d * 16];
          memcpy(vd, vh + t * D, sizeof(float) * (size_t)D);
        }
      }
}

/* The other way, when rows enter a window buffer: row b's positions t < t0 from the paged cache kv [L, 2, S, Hk, D], at
   slot tables[b, t / P] * P + t % P (tables int32 [B, W], W >= t0 / P), into buffer row slot[b] of kb [L, NS, Hk, cap / 16,
   D, 16] and v [L, NS, Hk, cap, D]; the row's columns from t0 on are set to 0 (a buffer row's every column stays
   finite: a masked column must add exact zeros, which NaN * 0 would not). */
void miles_gather(const float *kv, const int32_t *tables, int64_t W, int64_t P, const int64_t *slot, float *kb, float *v,
                  int64_t L, int64_t B, int64_t NS, int64_t Hk, int64_t D, int64_t cap, int64_t S, int64_t t0) {
  const int64_t t16 = (t0 + 15) & ~(int64_t)15;
#pragma omp parallel for collapse(2) schedule(static) if (L * B * cap * Hk * D >= 65536)
  for (int64_t l = 0; l < L; ++l)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < Hk; ++g) {
        const int64_t head = (l * NS + slot[b]) * Hk + g;
        float *kh = kb + head * cap * D, *vh = v + head * cap * D;
        for (int64_t t = 0; t < t0; ++t) {
          const int64_t at = (int64_t)tables[b * W + t / P] * P + t % P;
          const float *ks = kv + ((l * 2 * S + at) * Hk + g) * D, *vs = ks + S * Hk * D;
          float *blk = kh + (t / 16) * 16 * D + t % 16;
          for (int64_t d = 0; d < D; ++d) blk[d * 16] = ks[d];
          memcpy(vh + t * D, vs, sizeof(float) * (size_t)D);
        }
        for (int64_t t = t0; t < t16; ++t)
          for (int64_t d = 0; d < D; ++d) kh[(t / 16) * 16 * D + d * 16 + t % 16] = 0.f;
        memset(kh + t16 * D, 0, sizeof(float) * (size_t)((cap - t16) * D));
        memset(vh + t0 * D, 0, sizeof(float) * (size_t)((cap - t0) * D));
      }
}

/* ---------------------------------------------------------------- a whole decode step */
/* The layers of one decode step of B rows in one parallel region: per layer RMSNorm, the q/k/v GEMM, the attention
   step (miles_attn_step), the o_proj GEMM with the residual added into x, RMSNorm, the gate/up GEMM with SwiGLU, the
   down GEMM with its residual; each phase a work-sharing loop whose closing barrier orders it before the next. The
   same kernels as the per-call path, in the same order: the same bits.
   x [B, hidden] contiguous: in, the step's embeddings; out, the hidden states before the final norm. Per layer l,
   ptrs[l * 10 ..]: input norm weight, q/k/v W^T [hidden, (H + 2 Hk) D], q-norm and k-norm weights (0: none), o_proj
   W^T [H D, hidden], post-attention norm weight, gate/up W^T [hidden, 2 I], down W^T [I, hidden], the window's keys
   [NS, Hk, cap / 16, D, 16] and values [NS, Hk, cap, D] (row b's in buffer row slot[b]); eps[l * 3 ..]: the two norms' eps and the q/k norms'.
   Buffers: h [B, hidden], qkv [B, (H + 2 Hk) D], o [B, H D], a [B, I]. The step's embeddings come from rows tok [B]
   of the table embed [V, hidden]; after the layers the final norm (weight final_w) of x goes to xn [B, hidden]. */
void miles_decode_step(const int64_t *tok, const float *embed, float *x, const int64_t *ptrs, const float *eps, int64_t L,
                       const float *final_w, float final_eps, float *xn, const float *cos, const float *sin,
                       int64_t cs_stride, const int64_t *pos, int64_t pos_off, const int64_t *slot, const float *mask,
                       int64_t col, float scale,
                       float *h, float *qkv, float *o, float *a, int64_t B, int64_t hidden, int64_t H, int64_t Hk, int64_t D,
                       int64_t inter, int64_t cap, int packed) {
  const int64_t nqkv = (H + 2 * Hk) * D;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < B; ++r) memcpy(x + r * hidden, embed + tok[r] * hidden, sizeof(float) * (size_t)hidden);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t *p = ptrs + l * 10;
      const float *e = eps + l * 3;
#define W(i) ((float *)(intptr_t)p[i])
      rmsnorm_for(x, hidden, W(0), h, B, hidden, e[0]);
      gemm_for(h, hidden, W(1), NULL, 0, qkv, B, hidden, nqkv, 0, packed);
      attn_step_for(qkv, nqkv, cos, sin, cs_stride, pos, pos_off, slot, W(2), W(3), e[2], W(8), W(9), mask, o, B, H, Hk, D,
                    cap, col, scale);
      gemm_for(o, H * D, W(4), x, hidden, x, B, H * D, hidden, 0, packed); /* the residual added in place */
      rmsnorm_for(x, hidden, W(5), h, B, hidden, e[1]);
      gemm_for(h, hidden, W(6), NULL, 0, a, B, hidden, 2 * inter, 1, packed);
      gemm_for(a, inter, W(7), x, hidden, x, B, inter, hidden, 0, packed);
#undef W
    }
    rmsnorm_for(x, hidden, final_w, xn, B, hidden, final_eps);
  }
}

/* ---------------------------------------------------------------- a whole decode window */
/* K decode steps of B rows in one call, the rows in groups of G: one thread takes a group through all K steps
   (the embedding, the layers as miles_decode_step runs them, the final norm, the logits against head [V, hidden] as
   miles_logits computes them, and the draw as miles_sample makes it), so that a group's K/V stays in the cache from
   one step to the next, and the threads never wait for each other. The arithmetic of every row is that of those
   kernels: the same bits. Step j of row b feeds token tok0[b] (j = 0) or its own draw of step j - 1, reads the rotary
   tables at row pos[b] + j, writes column col0 + j of buffer row slot[b] and attends over [0, col0 + j], and draws for
   output position counters[b] + j (temperature[b], seeds[b]); its token and logprob go to tok_out, logp_out [B, K].
   Weights, buffers and eps as miles_decode_step's. The weights are read once per group and step: this pays where
   they are small against the groups' K/V (the caller decides). */
void miles_decode_window(const int64_t *tok0, const float *embed, const int64_t *ptrs, const float *eps, int64_t L,
                         const float *final_w, float final_eps, const float *head, int64_t V, const float *cos,
                         const float *sin, int64_t cs_stride, const int64_t *pos, const int64_t *slot, const float *mask,
                         int64_t col0, float scale, const float *temperature, const int64_t *seeds, const int64_t *counters,
                         int64_t *tok_out, float *logp_out, int64_t B, int64_t K, int64_t G, int64_t hidden, int64_t H,
                         int64_t Hk, int64_t D, int64_t inter, int64_t cap, int packed) {
  const int64_t nqkv = (H + 2 * Hk) * D, hd = H * D, groups = (B + G - 1) / G;
  const int64_t ns = (col0 + K + 15) & ~(int64_t)15;
#pragma omp parallel if (groups > 1)
  {
    float *x = scratch(G * (2 * hidden + nqkv + hd + inter + V) + H / Hk * ns + hd + D); /* this thread's */
    float *h = x + G * hidden, *qkv = h + G * hidden, *o = qkv + G * nqkv, *a = o + G * hd, *z = a + G * inter;
    float *s = z + G * V;
#pragma omp for schedule(dynamic, 1)
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t r0 = gi * G, M = B - r0 < G ? B - r0 : G;
      for (int64_t j = 0; j < K; ++j) {
        for (int64_t r = 0; r < M; ++r) {
          const int64_t b = r0 + r, t = j ? tok_out[b * K + j - 1] : tok0[b];
          memcpy(x + r * hidden, embed + t * hidden, sizeof(float) * (size_t)hidden);
        }
        for (int64_t l = 0; l < L; ++l) {
          const int64_t *p = ptrs + l * 10;
          const float *e = eps + l * 3;
#define W(i) ((float *)(intptr_t)p[i])
          for (int64_t r = 0; r < M; ++r) rmsnorm_row(x + r * hidden, W(0), h + r * hidden, hidden, e[0]);
          gemm_rows(h, hidden, W(1), NULL, 0, qkv, M, hidden, nqkv, 0, packed);
          for (int64_t r = 0; r < M; ++r) {
            const int64_t b = r0 + r, cr = pos[b] + j;
            attn_row(qkv + r * nqkv, cos + cr * cs_stride, sin + cr * cs_stride, slot[b], W(2), W(3), e[2], W(8), W(9), mask,
                     o + r * hd, s, H, Hk, D, cap, col0 + j, scale);
          }
          gemm_rows(o, hd, W(4), x, hidden, x, M, hd, hidden, 0, packed);
          for (int64_t r = 0; r < M; ++r) rmsnorm_row(x + r * hidden, W(5), h + r * hidden, hidden, e[1]);
          gemm_rows(h, hidden, W(6), NULL, 0, a, M, hidden, 2 * inter, 1, packed);
          gemm_rows(a, inter, W(7), x, hidden, x, M, inter, hidden, 0, packed);
#undef W
        }
        for (int64_t r = 0; r < M; ++r) rmsnorm_row(x + r * hidden, final_w, h + r * hidden, hidden, final_eps);
        logits_rows(h, M, head, z, V, hidden, 0, V);
        for (int64_t r = 0; r < M; ++r) {
          const int64_t b = r0 + r;
          sample_row(z + r * V, temperature[b], seeds[b], counters[b] + j, tok_out + b * K + j, logp_out + b * K + j, V);
        }
      }
    }
    free(x);
  }
}
