// The typed half of cpu_paged_decode.c, included once per pair of element types (a C template): ELEM
// is the element type of the K/V pool, LOAD8 widens 8 of them to a v8 of floats and STORE8 narrows
// one back; QELEM, QLOAD8 and QSTORE8 the same for the queries, the new K/V rows and the output (the
// activations: ELEM's where undefined; float32 over a 16-bit pool with --kv-cache-dtype); FN(name)
// gives each instantiation its own names. Every row is read by all the query heads of its KV head and
// by every sequence sharing the block; so that a 16-bit row is not widened that many times, the
// query heads of a KV head go in tiles sharing each load (TILE of them), and with AVX2 a bfloat16
// pool's instantiations (WIDEN_BLOCKS) widen each K/V block to float32 once, into a per-thread
// buffer, before its heads read it. Logits, softmax and the output
// accumulators are float32 in every instantiation. DOT_BF16 (bfloat16 queries and pool): the logits
// are pair dot products of the stored values (dot_pairs), the probabilities are rounded to bfloat16
// and pass 2 takes V's rows in pairs the same way (tile_values_bf16): products exact, every sum one
// float32 rounding, vdpbf16ps where the CPU has it.
//
// Two passes over a sequence's context, not an online softmax block by block: pass 1 reads the K
// blocks and writes every query head's logits over the whole context, the softmax then runs once
// per head over that row (exact maximum, no rescaling), and pass 2 reads the V blocks and
// accumulates. The per-block softmax bookkeeping (a scalar maximum, a rescale, two short exp
// vectors per head and block of 16 rows) had cost more than the block's multiply-adds. Every term
// depends only on the sequence's own context, so a sequence served together with others over shared
// blocks gets the bits it gets alone.

// Query heads a tile (HEAD_TILE), but one in the bfloat16 instantiation without AVX-512 (its 16-lane
// chunks in AVX2 registers leave no room for more)
#if defined(DOT_BF16) && !defined(__AVX512F__)
#define TILE 1
#else
#define TILE HEAD_TILE
#endif

#ifndef QELEM
#define QELEM ELEM
#define QLOAD8 LOAD8
#define QSTORE8 STORE8
#endif

// Write this step's K/V rows of n tokens into their pool slots (slot < 0: padding, skipped),
// converted to the pool's type (rounded to nearest even, as torch's .to() rounds; a copy when the
// types are one). The sources are strided views ([token, head, dim] with any token/head stride in
// elements, unit dim stride). The slots are the caller's to check (store_kv, decode_layers).
static void FN(store_rows)(ELEM *k_cache, ELEM *v_cache, const QELEM *k, const QELEM *v, const int64_t *slots,
                           int n, int num_kv_heads, int head_dim, int head_dim_v, int64_t k_token_stride,
                           int64_t k_head_stride, int64_t v_token_stride, int64_t v_head_stride) {
  assert(head_dim % 8 == 0 && head_dim_v % 8 == 0);  // rows are written 8 values at a time
  for (int i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;
    for (int h = 0; h < num_kv_heads; ++h) {
      ELEM *kd = k_cache + (slots[i] * num_kv_heads + h) * head_dim;
      ELEM *vd = v_cache + (slots[i] * num_kv_heads + h) * head_dim_v;
      const QELEM *ks = k + i * k_token_stride + h * k_head_stride;
      const QELEM *vs = v + i * v_token_stride + h * v_head_stride;
      for (int c = 0; c < head_dim; c += 8) STORE8(kd + c, QLOAD8(ks + c));
      for (int c = 0; c < head_dim_v; c += 8) STORE8(vd + c, QLOAD8(vs + c));
    }
  }
}

// store_rows into a pool of num_slots slots, after checking every slot: 0, or (nothing written) what
// was out of range (cpu_bounds.h).
int FN(store_kv)(ELEM *k_cache, ELEM *v_cache, const QELEM *k, const QELEM *v, const int64_t *slots, int n,
                 int num_kv_heads, int head_dim, int head_dim_v, int64_t k_token_stride, int64_t k_head_stride,
                 int64_t v_token_stride, int64_t v_head_stride, int64_t num_slots, refusal *why) {
  const int refused = check_slots(slots, n, num_slots, why);
  if (!refused)
    FN(store_rows)(k_cache, v_cache, k, v, slots, n, num_kv_heads, head_dim, head_dim_v, k_token_stride,
                   k_head_stride, v_token_stride, v_head_stride);
  return refused;
}

// Loads one element of every 64-byte line of p[0, n), in address order. The passes read a block's
// rows head by head (strided); streamed in first, the block is read from memory at close to the
// machine's sequential rate and those reads hit the cache. For a block nobody prefetched.
static inline void FN(touch_lines)(const ELEM *p, size_t n) {
  v8 sum = {0};
  for (size_t o = 0; o + 8 <= n; o += 64 / sizeof(ELEM)) sum += LOAD8(p + o);
  volatile float sink = sum[0] + sum[7];  // keeps the loads
  (void)sink;
}

// The rows the passes read (ROW): the pool's own, widened in registers as they are loaded, or
// (WIDEN_BLOCKS) the block widened to float32 once into `wide`.
#ifdef WIDEN_BLOCKS
#define ROW float
#define ROW_LOAD8 load8
#define ROW_LOAD16 load16
#else
#define ROW ELEM
#define ROW_LOAD8 LOAD8
#define ROW_LOAD16 LOAD16
#endif

static inline const ROW *FN(rows_of)(const ELEM *p, size_t n, int prefetched, float *wide) {
#ifdef WIDEN_BLOCKS  // one sequential pass, which also brings it into the cache
  (void)prefetched;
  for (size_t i = 0; i < n; i += 8) store8(wide + i, LOAD8(p + i));
  return wide;
#else
  (void)wide;
  if (!prefetched) FN(touch_lines)(p, n);
  return p;
#endif
}

// Pass 1 over n K rows (row stride k_row, this KV head's first element at k) for G query heads of
// that KV head (G <= TILE, a constant once inlined): li[h * lstride + t] = (q_h . k_t) * scale,
// q_h the head_dim values at q + h * qstride. A row is read a chunk at a time (16 floats; DOT_BF16:
// 32 bfloat16 values as 16 pairs, dot_pairs), a last partial chunk zero-padded, into one 16-lane sum
// per head; lane l sums its values of each chunk in order, the two halves are added, then the 8
// lanes (sum_lanes8 for 8 rows at once, hsum8_rows for a row alone: the same tree, so a row's bits
// do not depend on the rows it is finished with). Each K chunk is loaded once for the
// G heads; 8 rows at a time (4 and 4 with one head a tile: the bfloat16 instantiation in AVX2's 16
// registers) are independent chains per head; the other AVX2 instantiations take the form below.
// (Float queries come scaled: scale 1.)
#define LOGIT_ROWS (TILE > 1 ? 8 : 4)
#ifdef DOT_BF16
#define BF16_PROBS 1 /* softmax_row's probabilities in bfloat16, for tile_values_bf16 */
#define LOGIT_CHUNK 32
#define KROW ELEM
#define QROW uint16_t
typedef v16u FN(chunk);
static inline __attribute__((always_inline)) v16u FN(k_chunk)(const ELEM *p) { return pair_chunk(p); }
static inline __attribute__((always_inline)) v16u FN(k_tail)(const ELEM *p, int left) { return pair_tail(p, left); }
#define Q_CHUNK pair_chunk
#define Q_TAIL pair_tail
#define DOT dot_pairs
#else
#define BF16_PROBS 0
#define LOGIT_CHUNK 16
#define KROW ROW
#define QROW float
typedef v16 FN(chunk);
static inline __attribute__((always_inline)) v16 FN(k_chunk)(const ROW *p) { return ROW_LOAD16(p); }
static inline __attribute__((always_inline)) v16 FN(k_tail)(const ROW *p, int left) {
  (void)left;  // 8: head_dim is a multiple of 8
  return cat16(ROW_LOAD8(p), (v8){0});
}
#define Q_CHUNK load16
#define Q_TAIL(p, left) cat16(load8(p), (v8){0})
#define DOT(acc, q, k) ((acc) + (q) * (k))
#endif

#if !defined(DOT_BF16) && !defined(__AVX512F__)
// AVX2: the same sums with each 16-lane chunk held as its two 8-lane halves (lo: lanes 0-7, hi:
// 8-15), lane for lane the same multiply-adds in the same order (a 16-float vector lives in memory
// between operations in GCC 12's AVX2 code, which had made this pass 10x slower). The tile's heads
// one after the other over each 4 rows (8 accumulators and the query chunk's halves in registers,
// K read as the multiply-adds' memory operands, from the cache for the heads after the first). A
// last 8 values (head_dim % 16) add 0 x 0 to the hi lanes, as the zero-padded chunk does.
static inline __attribute__((always_inline)) void FN(logits_row4)(const float *q, int full, int left, const KROW *kr,
                                                                  size_t k_row, v8 *s) {
  const v8 zero = {0};
  v8 lo[4] = {zero, zero, zero, zero}, hi[4] = {zero, zero, zero, zero};
  for (int c = 0; c < full; ++c) {
    const v8 ql = load8(q + 16 * c), qh = load8(q + 16 * c + 8);
    for (int r = 0; r < 4; ++r) {
      lo[r] += ql * ROW_LOAD8(kr + r * k_row + 16 * c);
      hi[r] += qh * ROW_LOAD8(kr + r * k_row + 16 * c + 8);
    }
  }
  if (left) {
    const v8 ql = load8(q + 16 * full);
    for (int r = 0; r < 4; ++r) {
      lo[r] += ql * ROW_LOAD8(kr + r * k_row + 16 * full);
      hi[r] += zero * zero;
    }
  }
  for (int r = 0; r < 4; ++r) s[r] = lo[r] + hi[r];
}

static inline __attribute__((always_inline)) void FN(tile_logits)(const int G, const QROW *q, size_t qstride,
                                                                  int head_dim, float scale, float *li,
                                                                  int lstride, const KROW *k, int n,
                                                                  size_t k_row, ahead *pf) {
  const int full = head_dim / 16, left = head_dim % 16, at = 16 * full;
  const v8 zero = {0};
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    ahead_step(pf);
    for (int h = 0; h < G; ++h) {
      v8 s[8];
      FN(logits_row4)(q + h * qstride, full, left, k + (size_t)t * k_row, k_row, s);
      FN(logits_row4)(q + h * qstride, full, left, k + (size_t)(t + 4) * k_row, k_row, s + 4);
      const v8 sums = sum_lanes8(s) * scale;
      memcpy(li + (size_t)h * lstride + t, &sums, sizeof sums);
    }
  }
  if (t < n) ahead_step(pf);
  for (; t < n; ++t)
    for (int h = 0; h < G; ++h) {
      const float *qh = q + h * qstride;
      const KROW *kr = k + (size_t)t * k_row;
      v8 lo = zero, hi = zero;
      for (int c = 0; c < full; ++c) {
        lo += load8(qh + 16 * c) * ROW_LOAD8(kr + 16 * c);
        hi += load8(qh + 16 * c + 8) * ROW_LOAD8(kr + 16 * c + 8);
      }
      if (left) {
        lo += load8(qh + at) * ROW_LOAD8(kr + at);
        hi += zero * zero;
      }
      li[(size_t)h * lstride + t] = hsum8_rows(lo + hi) * scale;
    }
}
#else
static inline __attribute__((always_inline)) void FN(tile_logits)(const int G, const QROW *q, size_t qstride,
                                                                  int head_dim, float scale, float *li,
                                                                  int lstride, const KROW *k, int n,
                                                                  size_t k_row, ahead *pf) {
  const int full = head_dim / LOGIT_CHUNK, left = head_dim % LOGIT_CHUNK, at = LOGIT_CHUNK * full;
  int t = 0;
  for (; t + 8 <= n; t += 8) {
    ahead_step(pf);
    v8 s[TILE][8];
    for (int r0 = 0; r0 < 8; r0 += LOGIT_ROWS) {
      v16 d[TILE][LOGIT_ROWS];
      for (int h = 0; h < G; ++h)
        for (int r = 0; r < LOGIT_ROWS; ++r) d[h][r] = (v16){0};
      for (int c = 0; c < full; ++c)
        for (int r = 0; r < LOGIT_ROWS; ++r) {
          const FN(chunk) kr = FN(k_chunk)(k + (t + r0 + r) * k_row + LOGIT_CHUNK * c);
          for (int h = 0; h < G; ++h) d[h][r] = DOT(d[h][r], Q_CHUNK(q + h * qstride + LOGIT_CHUNK * c), kr);
        }
      if (left)
        for (int r = 0; r < LOGIT_ROWS; ++r) {
          const FN(chunk) kr = FN(k_tail)(k + (t + r0 + r) * k_row + at, left);
          for (int h = 0; h < G; ++h) d[h][r] = DOT(d[h][r], Q_TAIL(q + h * qstride + at, left), kr);
        }
      for (int h = 0; h < G; ++h)
        for (int r = 0; r < LOGIT_ROWS; ++r) s[h][r0 + r] = lo8(d[h][r]) + hi8(d[h][r]);
    }
    for (int h = 0; h < G; ++h) {
      const v8 sums = sum_lanes8(s[h]) * scale;
      memcpy(li + (size_t)h * lstride + t, &sums, sizeof sums);
    }
  }
  if (t < n) ahead_step(pf);
  for (; t < n; ++t) {
    v16 d[TILE];
    for (int h = 0; h < G; ++h) d[h] = (v16){0};
    for (int c = 0; c < full; ++c) {
      const FN(chunk) kr = FN(k_chunk)(k + t * k_row + LOGIT_CHUNK * c);
      for (int h = 0; h < G; ++h) d[h] = DOT(d[h], Q_CHUNK(q + h * qstride + LOGIT_CHUNK * c), kr);
    }
    if (left) {
      const FN(chunk) kr = FN(k_tail)(k + t * k_row + at, left);
      for (int h = 0; h < G; ++h) d[h] = DOT(d[h], Q_TAIL(q + h * qstride + at, left), kr);
    }
    for (int h = 0; h < G; ++h) li[(size_t)h * lstride + t] = hsum8_rows(lo8(d[h]) + hi8(d[h])) * scale;
  }
}
#endif
#undef LOGIT_CHUNK
#undef Q_CHUNK
#undef Q_TAIL
#undef DOT

// The prefetch steps of a pass over pieces[0, np): one per 8-row group of every tile.
static size_t FN(pass_steps)(const piece *pieces, int np, int num_heads, int g) {
  size_t steps = 0;
  for (int e = 0; e < np; ++e)
    steps += (size_t)(pieces[e].j1 - pieces[e].j0) * (num_heads / g) * ((g + TILE - 1) / TILE) *
             ((pieces[e].n + 7) / 8);
  return steps;
}

#if defined(DOT_BF16) && defined(__AVX512BF16__)
// Runs of shared blocks (blocks every member of a group reads whole: the prompt of n completions, a
// common prefix) in layouts that serve many query heads at once, the same products and sums in the
// same order as tile_logits and values_pairs, so the same bits (a sequence served with others still
// equals itself alone). Up to SHARED_ROWS rows of a KV head at a time:
// - K transposed into pairs across rows (kt: pair p of rows 16i .. 16i + 15 in one vector, a row a
//   lane): a query head multiplies a broadcast pair of its own into 16 rows at once, with no
//   horizontal sums (which took most of tile_logits' time: shuffles, and spills of its 24
//   accumulators); lane l of tile_logits' sums (pairs l, l + 16, ...) is vector l here, lane l + 8 is
//   added to it (lo8 + hi8), then sum_lanes8's tree over the 8 lanes.
// - V rows unpacked once into the pairs pairs_step forms, each pair of rows then serving the 4
//   accumulators of SHARED_STATES query heads (24 chains in flight, where a tile of 3 heads left the
//   multiply-adds waiting on their own latency).
// The transposes and the unpacking pay where many heads share them: SHARED_MEMBERS members or more
// (docs/kernels.md has the figures).
#define SHARED_ROWS 64
#define SHARED_STATES 6
#define SHARED_MEMBERS 8

// The shared pieces from e on taken as one run (0: none, piece e goes through the tiles) and their
// rows (*rows): a head size of 64 or 128, rows a multiple of 16, at most SHARED_ROWS, read by the
// same SHARED_MEMBERS or more members.
static int FN(shared_run)(const piece *pieces, int e, int np, int head_dim, int *rows) {
  *rows = 0;
  if (head_dim != 64 && head_dim != 128) return 0;
  const piece *first = pieces + e;
  int count = 0;
  for (const piece *p = first; e + count < np; ++p, ++count) {
    if (p->j1 - p->j0 < SHARED_MEMBERS || p->j0 != first->j0 || p->j1 != first->j1 || p->n % 16 ||
        p->pos != first->pos + *rows || *rows + p->n > SHARED_ROWS)
      break;
    *rows += p->n;
  }
  return count;
}

// n rows (a multiple of 16; k_row values apart, head_dim values each) into kt: pair p of rows
// [16i, 16i + 16) at kt[i * head_dim / 2 + p], 16 x 16 pairs at a time.
static void FN(transpose_k)(__m512i *kt, const uint16_t *k, int n, size_t k_row, int head_dim) {
  const int pairs = head_dim / 2;
  for (int i = 0; i < n / 16; ++i, kt += pairs)
    for (int c = 0; c < pairs; c += 16) {
      __m512i x[16], y[16];
      for (int r = 0; r < 16; ++r) x[r] = _mm512_loadu_si512(k + (16 * i + r) * k_row + 2 * c);
      for (int r = 0; r < 16; r += 2) {  // 128-bit lane L: pairs 4L, 4L + 1 (lo), 4L + 2, 4L + 3 (hi)
        y[r] = _mm512_unpacklo_epi32(x[r], x[r + 1]);
        y[r + 1] = _mm512_unpackhi_epi32(x[r], x[r + 1]);
      }
      for (int r = 0; r < 16; r += 4) {  // x[r + j]: pair 4L + j of rows r .. r + 3 in lane L
        x[r] = _mm512_unpacklo_epi64(y[r], y[r + 2]);
        x[r + 1] = _mm512_unpackhi_epi64(y[r], y[r + 2]);
        x[r + 2] = _mm512_unpacklo_epi64(y[r + 1], y[r + 3]);
        x[r + 3] = _mm512_unpackhi_epi64(y[r + 1], y[r + 3]);
      }
      for (int j = 0; j < 4; ++j) {  // lane L of rows 0-3, 4-7, 8-11, 12-15 side by side
        const __m512i a0 = _mm512_shuffle_i32x4(x[j], x[4 + j], 0x44), a1 = _mm512_shuffle_i32x4(x[j], x[4 + j], 0xee);
        const __m512i b0 = _mm512_shuffle_i32x4(x[8 + j], x[12 + j], 0x44);
        const __m512i b1 = _mm512_shuffle_i32x4(x[8 + j], x[12 + j], 0xee);
        kt[c + j] = _mm512_shuffle_i32x4(a0, b0, 0x88);
        kt[c + 4 + j] = _mm512_shuffle_i32x4(a0, b0, 0xdd);
        kt[c + 8 + j] = _mm512_shuffle_i32x4(a1, b1, 0x88);
        kt[c + 12 + j] = _mm512_shuffle_i32x4(a1, b1, 0xdd);
      }
    }
}

// acc += the pair products of q and the transposed rows at m, m read as vdpbf16ps' memory operand
// (GCC 12 loads it into a register first, a slower product: docs/kernels.md).
#define DOT_MEM(acc, q, m) __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(q), "m"(m))

// Lanes l and l + 8 of tile_logits' sums, added, for one query head (q: its pairs) over R groups of
// 16 transposed rows, CH chunks of 32 values a row: e[r] lane i for row 16r + i.
static inline __attribute__((always_inline)) void FN(lanes_shared)(const int R, const int CH, __m512 *e, int l,
                                                                   const uint32_t *q, const __m512i *kt) {
  __m512 a[SHARED_ROWS / 16], b[SHARED_ROWS / 16];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps(), b[r] = _mm512_setzero_ps();
  for (int c = 0; c < CH; ++c) {  // independent products side by side, each chain in chunk order
    const __m512bh qa = (__m512bh)_mm512_set1_epi32((int)q[16 * c + l]);
    const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[16 * c + l + 8]);
    for (int r = 0; r < R; ++r) DOT_MEM(a[r], qa, kt[16 * CH * r + 16 * c + l]);
    for (int r = 0; r < R; ++r) DOT_MEM(b[r], qb, kt[16 * CH * r + 16 * c + l + 8]);
  }
  for (int r = 0; r < R; ++r) e[r] = _mm512_add_ps(a[r], b[r]);
}

// One query head's logits over R x 16 transposed rows: li[t] as tile_logits writes them.
static inline __attribute__((always_inline)) void FN(logits_shared)(const int R, const int CH, const uint32_t *q,
                                                                    float scale, float *li, const __m512i *kt) {
  __m512 e[SHARED_ROWS / 16], x[SHARED_ROWS / 16], y[SHARED_ROWS / 16], z[SHARED_ROWS / 16];
  // sum_lanes8's tree, lane by lane: ((0 1)(2 3))((4 5)(6 7)); written out (as two loops GCC spilled
  // more of the accumulators, a slower call)
  FN(lanes_shared)(R, CH, e, 0, q, kt);
  for (int r = 0; r < R; ++r) x[r] = e[r];
  FN(lanes_shared)(R, CH, e, 1, q, kt);
  for (int r = 0; r < R; ++r) x[r] = _mm512_add_ps(x[r], e[r]);
  FN(lanes_shared)(R, CH, e, 2, q, kt);
  for (int r = 0; r < R; ++r) y[r] = e[r];
  FN(lanes_shared)(R, CH, e, 3, q, kt);
  for (int r = 0; r < R; ++r) x[r] = _mm512_add_ps(x[r], _mm512_add_ps(y[r], e[r]));
  FN(lanes_shared)(R, CH, e, 4, q, kt);
  for (int r = 0; r < R; ++r) y[r] = e[r];
  FN(lanes_shared)(R, CH, e, 5, q, kt);
  for (int r = 0; r < R; ++r) y[r] = _mm512_add_ps(y[r], e[r]);
  FN(lanes_shared)(R, CH, e, 6, q, kt);
  for (int r = 0; r < R; ++r) z[r] = e[r];
  FN(lanes_shared)(R, CH, e, 7, q, kt);
  for (int r = 0; r < R; ++r) {
    const __m512 sum = _mm512_add_ps(x[r], _mm512_add_ps(y[r], _mm512_add_ps(z[r], e[r])));
    _mm512_storeu_ps(li + 16 * r, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
  }
}

// Pass 2's pairs of V rows (vt: pair p, chunk c of 32 columns: lo then hi as pairs_step forms them)
// into the accumulators of S query heads (states; their bfloat16 probabilities from logit position
// pos), CH chunks a row, 64 columns at a time; the prefetch steps spread over the pairs (a tile's
// at once filled the miss buffers: over K/V from memory slower than the tiles).
static inline __attribute__((always_inline)) void FN(values_shared)(const int S, const int CH, v8 *acc,
                                                                    const int *states, const float *logits,
                                                                    int lstride, int pos, const __m512i *vt,
                                                                    int pairs, int vc, ahead *pf, int steps) {
  const int per = CH / 2 * pairs;  // iterations of the pair loop
  int owed = 0;
  for (int c = 0; c < CH; c += 2) {
    __m512 o[SHARED_STATES][4];
    const uint16_t *pb[SHARED_STATES];
    for (int m = 0; m < S; ++m) {
      float *a = (float *)(acc + (size_t)states[m] * vc) + 32 * c;
      for (int x = 0; x < 4; ++x) o[m][x] = _mm512_loadu_ps(a + 16 * x);
      pb[m] = (const uint16_t *)(logits + (size_t)states[m] * lstride) + pos;
    }
    for (int p = 0; p < pairs; ++p) {
      const __m512i *v = vt + ((size_t)p * CH + c) * 2;
      const __m512bh v0 = (__m512bh)v[0], v1 = (__m512bh)v[1], v2 = (__m512bh)v[2], v3 = (__m512bh)v[3];
      for (int m = 0; m < S; ++m) {
        uint32_t pair;  // the probabilities of rows 2p (low) and 2p + 1 (high)
        memcpy(&pair, pb[m] + 2 * p, sizeof pair);
        const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
        o[m][0] = _mm512_dpbf16_ps(o[m][0], v0, pp);
        o[m][1] = _mm512_dpbf16_ps(o[m][1], v1, pp);
        o[m][2] = _mm512_dpbf16_ps(o[m][2], v2, pp);
        o[m][3] = _mm512_dpbf16_ps(o[m][3], v3, pp);
      }
      for (owed += steps; owed >= per; owed -= per) ahead_step(pf);
    }
    for (int m = 0; m < S; ++m) {
      float *a = (float *)(acc + (size_t)states[m] * vc) + 32 * c;
      for (int x = 0; x < 4; ++x) _mm512_storeu_ps(a + 16 * x, o[m][x]);
    }
  }
}

// Each shape compiled apart: inlined into one caller, GCC 12 spilled their accumulators (the
// transposed logits then no faster than tile_logits').
typedef void (*FN(logits_fn))(const uint32_t *q, float scale, float *li, const __m512i *kt);
typedef void (*FN(values_fn))(v8 *acc, const int *states, const float *logits, int lstride, int pos,
                              const __m512i *vt, int pairs, int vc, ahead *pf, int steps);
#define SHAPE(R, CH)                                                                                        \
  static __attribute__((noinline)) void FN(logits_shared_##R##_##CH)(const uint32_t *q, float scale, float *li, \
                                                                      const __m512i *kt) {                 \
    FN(logits_shared)(R, CH, q, scale, li, kt);                                                              \
  }
SHAPE(1, 2)
SHAPE(2, 2)
SHAPE(3, 2)
SHAPE(4, 2)
SHAPE(1, 4)
SHAPE(2, 4)
SHAPE(3, 4)
SHAPE(4, 4)
#undef SHAPE
#define SHAPE(S, CH)                                                                                        \
  static __attribute__((noinline)) void FN(values_shared_##S##_##CH)(v8 *acc, const int *states,             \
                                                                      const float *logits, int lstride,      \
                                                                      int pos, const __m512i *vt, int pairs, \
                                                                      int vc, ahead *pf, int steps) {        \
    FN(values_shared)(S, CH, acc, states, logits, lstride, pos, vt, pairs, vc, pf, steps);                   \
  }
SHAPE(1, 2)
SHAPE(6, 2) /* SHARED_STATES */
SHAPE(1, 4)
SHAPE(6, 4)
#undef SHAPE

// Pass 1 over a run (shared_run's): per KV head, its rows transposed into kt, then every member's
// query heads of it; the prefetch stepped as the tiles step it (one step per 8 rows of each tile of
// TILE heads), a member's at a time.
static void FN(shared_logits)(const piece *run, int count, int rows, const uint16_t *cache, size_t row,
                              int num_heads, int g, int kc, int lstride, const v8 *qs, float *logits, int head_dim,
                              __m512i *kt, float scale, ahead *next) {
  const int pairs = head_dim / 2;
  const size_t steps = FN(pass_steps)(run, count, g, g) / (size_t)(run->j1 - run->j0);  // a member's, a KV head
  const FN(logits_fn) shapes[2][4] = {
      {FN(logits_shared_1_2), FN(logits_shared_2_2), FN(logits_shared_3_2), FN(logits_shared_4_2)},
      {FN(logits_shared_1_4), FN(logits_shared_2_4), FN(logits_shared_3_4), FN(logits_shared_4_4)}};
  const FN(logits_fn) shape = shapes[head_dim == 128][rows / 16 - 1];
  for (int kv = 0; kv < num_heads / g; ++kv) {
    for (int i = 0, at = 0; i < count; at += run[i].n / 16, ++i)
      FN(transpose_k)(kt + (size_t)at * pairs, cache + run[i].slot * row + (size_t)kv * head_dim, run[i].n, row,
                      head_dim);
    for (int j = run->j0; j < run->j1; ++j) {
      for (size_t st = 0; st < steps; ++st) ahead_step(next);
      for (int h = 0; h < g; ++h) {
        const int s = j * num_heads + kv * g + h;
        shape((const uint32_t *)(qs + (size_t)s * kc), scale, logits + (size_t)s * lstride + run->pos, kt);
      }
    }
  }
}

// Pass 2 over a run: per KV head, its V rows unpacked into vt, then the states of every member's
// query heads of it (member, then head), SHARED_STATES at a time, each with its share of the
// prefetch steps the tiles would take.
static void FN(shared_values)(const piece *run, int count, int rows, const uint16_t *cache, size_t row,
                              int num_heads, int g, int vc, int lstride, v8 *acc, const float *logits,
                              int head_dim_v, __m512i *vt, ahead *next) {
  const int chunks = head_dim_v / 32, total = (run->j1 - run->j0) * g;
  const size_t steps = FN(pass_steps)(run, count, g, g);  // the tiles' over one KV head
  for (int kv = 0; kv < num_heads / g; ++kv) {
    __m512i *w = vt;
    for (int i = 0; i < count; ++i)
      for (int t = 0; t < run[i].n; t += 2) {
        const uint16_t *r = cache + (run[i].slot + t) * row + (size_t)kv * head_dim_v;
        for (int c = 0; c < chunks; ++c, w += 2) {
          const __m512i x0 = _mm512_loadu_si512(r + 32 * c), x1 = _mm512_loadu_si512(r + row + 32 * c);
          w[0] = _mm512_unpacklo_epi16(x0, x1), w[1] = _mm512_unpackhi_epi16(x0, x1);
        }
      }
    size_t stepped = 0;
    for (int k = 0; k < total;) {
      const int S = total - k >= SHARED_STATES ? SHARED_STATES : 1;
      int states[SHARED_STATES];
      for (int m = 0; m < S; ++m) states[m] = (run->j0 + (k + m) / g) * num_heads + kv * g + (k + m) % g;
      const FN(values_fn) shape = S == SHARED_STATES ? (chunks == 2 ? FN(values_shared_6_2) : FN(values_shared_6_4))
                                                     : (chunks == 2 ? FN(values_shared_1_2) : FN(values_shared_1_4));
      const size_t due = steps * (size_t)(k + S) / (size_t)total;
      shape(acc, states, logits, lstride, run->pos, vt, rows / 2, vc, next, (int)(due - stepped));
      k += S, stepped = due;
    }
  }
}
#undef DOT_MEM
#endif

#if !defined(DOT_BF16) && !defined(__AVX512F__)
// AVX2: VG columns of 8 for the G heads of a tile in registers (4 with 3 heads: 12 accumulators, 8
// with one) while the rows stream past, each V chunk loaded once for the G heads; each column the
// same chain over t as the tiles' below.
static inline __attribute__((always_inline)) void FN(values_cols8)(const int G, const int VG, float *acc,
                                                                   int head_dim_v, const float *p, int lstride,
                                                                   const ROW *v, int n, size_t v_row) {
  v8 o[TILE][8];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < VG; ++c) o[h][c] = load8(acc + h * head_dim_v + 8 * c);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < VG; ++c) {
      const v8 vv = ROW_LOAD8(v + t * v_row + 8 * c);
      for (int h = 0; h < G; ++h) o[h][c] += p[(size_t)h * lstride + t] * vv;
    }
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < VG; ++c) store8(acc + h * head_dim_v + 8 * c, o[h][c]);
}

static inline __attribute__((always_inline)) void FN(tile_values)(const int G, float *acc, int head_dim_v,
                                                                  const float *p, int lstride,
                                                                  const ROW *v, int n, size_t v_row,
                                                                  ahead *pf) {
  for (int t = 0; t < n; t += 8) ahead_step(pf);
  const int vc = head_dim_v / 8, wide = G == 1 ? 8 : 4;
  int c0 = 0;
  for (; c0 + wide <= vc; c0 += wide)
    FN(values_cols8)(G, wide, acc + 8 * c0, head_dim_v, p, lstride, v + 8 * c0, n, v_row);
  for (; c0 + 2 <= vc; c0 += 2) FN(values_cols8)(G, 2, acc + 8 * c0, head_dim_v, p, lstride, v + 8 * c0, n, v_row);
  for (; c0 < vc; ++c0) FN(values_cols8)(G, 1, acc + 8 * c0, head_dim_v, p, lstride, v + 8 * c0, n, v_row);
}
#else
// Pass 2 over n V rows for G query heads: acc_h += sum over the rows of p[h * lstride + t] * v_t
// (acc_h: the head_dim_v floats at acc + h * head_dim_v), VG 16-float output chunks at a time in
// registers, then one at a time, then a last 8 alone; each V chunk loaded once for the G heads. Each
// output value is the same chain of multiply-adds over t however wide the chunks. The loops have
// constant bounds so that the accumulators stay in registers.
static inline __attribute__((always_inline)) void FN(values_chunks)(const int G, const int VG, float *acc,
                                                                    int head_dim_v, int c0,
                                                                    const float *p, int lstride,
                                                                    const ROW *v, int n, size_t v_row) {
  v16 o[TILE][VG];
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < VG; ++c) o[h][c] = load16(acc + h * head_dim_v + 16 * (c0 + c));
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < VG; ++c) {
      const v16 vv = ROW_LOAD16(v + t * v_row + 16 * (c0 + c));
      for (int h = 0; h < G; ++h) o[h][c] += p[(size_t)h * lstride + t] * vv;
    }
  for (int h = 0; h < G; ++h)
    for (int c = 0; c < VG; ++c) store16(acc + h * head_dim_v + 16 * (c0 + c), o[h][c]);
}

static inline __attribute__((always_inline)) void FN(tile_values)(const int G, float *acc, int head_dim_v,
                                                                  const float *p, int lstride,
                                                                  const ROW *v, int n, size_t v_row,
                                                                  ahead *pf) {
  for (int t = 0; t < n; t += 8) ahead_step(pf);
  const int vc2 = head_dim_v / 16;
  int c0 = 0;
  for (; TILE > 1 && c0 + 8 <= vc2; c0 += 8)
    FN(values_chunks)(G, 8, acc, head_dim_v, c0, p, lstride, v, n, v_row);
  for (; c0 + 4 <= vc2; c0 += 4) FN(values_chunks)(G, 4, acc, head_dim_v, c0, p, lstride, v, n, v_row);
  for (; c0 < vc2; ++c0) FN(values_chunks)(G, 1, acc, head_dim_v, c0, p, lstride, v, n, v_row);
  if (head_dim_v % 16) {  // a last 8 values
    const int e = 16 * vc2;
    v8 o[TILE];
    for (int h = 0; h < G; ++h) o[h] = load8(acc + h * head_dim_v + e);
    for (int t = 0; t < n; ++t) {
      const v8 vv = ROW_LOAD8(v + t * v_row + e);
      for (int h = 0; h < G; ++h) o[h] += p[(size_t)h * lstride + t] * vv;
    }
    for (int h = 0; h < G; ++h) store8(acc + h * head_dim_v + e, o[h]);
  }
}
#endif

#ifdef DOT_BF16
// Pass 2 with bfloat16 probabilities (p: value t of head h at p[h * pstride + t]): rows in pairs,
// acc_h += p[t + 1] v_{t+1}, then += p[t] v_t (a last row alone), each a rounded multiply-add of
// exact products: with AVX512_BF16 one vdpbf16ps per 16 columns and pair of rows (two rows
// interleaved: column order 0-3, 8-11, 16-19, 24-27 | 4-7, ... in each 32; `acc` keeps that order,
// pairs_order restores it), else the widened rows (v: ROW) two multiply-adds each, in that order.
#if defined(__AVX512BF16__)
#define PAIRED_V(head_dim_v) ((head_dim_v) % 32 == 0)
#else
#define PAIRED_V(head_dim_v) 0
#endif

static inline __attribute__((always_inline)) float FN(prob)(const uint16_t *p, size_t i) {
  const uint32_t b = (uint32_t)p[i] << 16;
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}

#if defined(__AVX512BF16__)
// o[h] += head h's probabilities at t and t + 1 (p[h * pstride], p[h * pstride + 1]) times rows t and
// t + 1 (at r, v_row apart) of CB chunks of 32 columns; two = 0: row t alone, paired with zeros.
static inline __attribute__((always_inline)) void FN(pairs_step)(const int G, const int CB, const int two,
                                                                 __m512 (*o)[4], const uint16_t *r, size_t v_row,
                                                                 const uint16_t *p, size_t pstride) {
  __m512bh lo[2], hi[2];
  for (int b = 0; b < CB; ++b) {
    const __m512i x0 = _mm512_loadu_si512(r + 32 * b);
    const __m512i x1 = two ? _mm512_loadu_si512(r + v_row + 32 * b) : _mm512_setzero_si512();
    lo[b] = (__m512bh)_mm512_unpacklo_epi16(x0, x1), hi[b] = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
  }
  for (int h = 0; h < G; ++h) {
    uint32_t pair = p[h * pstride];  // p[t] low, p[t + 1] high
    if (two) memcpy(&pair, p + h * pstride, sizeof pair);
    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
    for (int b = 0; b < CB; ++b) {
      o[h][2 * b] = _mm512_dpbf16_ps(o[h][2 * b], lo[b], pp);
      o[h][2 * b + 1] = _mm512_dpbf16_ps(o[h][2 * b + 1], hi[b], pp);
    }
  }
}

// CB chunks of 32 columns from c (two accumulators each a head), each broadcast probability pair
// serving all CB: one chunk at a time had broadcast every pair again for each chunk.
static inline __attribute__((always_inline)) void FN(values_pairs)(const int G, const int CB, float *acc,
                                                                   int head_dim_v, int c, const uint16_t *p,
                                                                   size_t pstride, const uint16_t *raw, int n,
                                                                   size_t v_row) {
  __m512 o[TILE][2 * 2];
  for (int h = 0; h < G; ++h)
    for (int x = 0; x < 2 * CB; ++x) o[h][x] = _mm512_loadu_ps(acc + h * head_dim_v + 32 * c + 16 * x);
  int t = 0;
  for (; t + 2 <= n; t += 2) FN(pairs_step)(G, CB, 1, o, raw + t * v_row + 32 * c, v_row, p + t, pstride);
  if (t < n) FN(pairs_step)(G, CB, 0, o, raw + t * v_row + 32 * c, v_row, p + t, pstride);
  for (int h = 0; h < G; ++h)
    for (int x = 0; x < 2 * CB; ++x) _mm512_storeu_ps(acc + h * head_dim_v + 32 * c + 16 * x, o[h][x]);
}
#endif

static inline __attribute__((always_inline)) void FN(tile_values_bf16)(const int G, float *acc, int head_dim_v,
                                                                       const uint16_t *p, size_t pstride,
                                                                       const uint16_t *raw, const ROW *v, int n,
                                                                       size_t v_row, ahead *pf) {
  for (int t = 0; t < n; t += 8) ahead_step(pf);
#if defined(__AVX512BF16__)
  if (PAIRED_V(head_dim_v)) {
    (void)v;
    const int chunks = head_dim_v / 32;
    int c = 0;
    for (; c + 2 <= chunks; c += 2) FN(values_pairs)(G, 2, acc, head_dim_v, c, p, pstride, raw, n, v_row);
    if (c < chunks) FN(values_pairs)(G, 1, acc, head_dim_v, c, p, pstride, raw, n, v_row);
    return;
  }
#endif
  (void)raw;
  for (int c = 0; c < head_dim_v / 8; ++c) {  // 8 columns at a time
    v8 o[TILE];
    for (int h = 0; h < G; ++h) o[h] = load8(acc + h * head_dim_v + 8 * c);
    for (int t = 0; t < n; t += 2) {
      if (t + 1 < n) {
        const v8 vv = ROW_LOAD8(v + (t + 1) * v_row + 8 * c);
        for (int h = 0; h < G; ++h) o[h] += FN(prob)(p, h * pstride + t + 1) * vv;
      }
      const v8 vv = ROW_LOAD8(v + t * v_row + 8 * c);
      for (int h = 0; h < G; ++h) o[h] += FN(prob)(p, h * pstride + t) * vv;
    }
    for (int h = 0; h < G; ++h) store8(acc + h * head_dim_v + 8 * c, o[h]);
  }
}

// The natural column order of a state's accumulators (head_dim_v floats) left by paired passes.
static inline void pairs_order(float *a, int head_dim_v) {
#if defined(__AVX512BF16__)
  if (!PAIRED_V(head_dim_v)) return;
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < head_dim_v; c += 32) {
    const __m512 lo = _mm512_loadu_ps(a + c), hi = _mm512_loadu_ps(a + c + 16);
    _mm512_storeu_ps(a + c, _mm512_permutex2var_ps(lo, first, hi));
    _mm512_storeu_ps(a + c + 16, _mm512_permutex2var_ps(lo, second, hi));
  }
#else
  (void)a, (void)head_dim_v;
#endif
}
#endif

// One pass over every piece of a group's context: its K rows into the logit rows (values = 0), or
// its V rows into the accumulators (values = 1), tile by tile (state j * num_heads + i: query head
// i of the group's j-th member; a tile: up to TILE heads of one KV head), stepping `next` (the
// next pass's rows) as it goes. cold: nobody prefetched the first piece (the first group's K pass).
static void FN(pass)(int values, const piece *pieces, int np, const ELEM *cache, ahead *next, int cold,
                     size_t row, int num_heads, int g, int kc, int vc, int lstride, const v8 *qs,
                     v8 *acc, float *logits, int head_dim, float *wide, void *kt, float scale) {
  (void)kt;  // the bfloat16 instantiation's, with AVX512-BF16 (shared_logits, shared_values)
  for (int e = 0; e < np; ++e) {
    const piece *pc = pieces + e;
    const ELEM *raw = cache + pc->slot * row;
    const ROW *rows = NULL;
#ifdef DOT_BF16  // the K pass reads the pool's own rows (pair dot products)
    if (!values && cold && e == 0) FN(touch_lines)(raw, (size_t)pc->n * row);
#ifdef __AVX512BF16__  // runs of shared blocks in their own layouts
    int run_rows;
    const int count = FN(shared_run)(pieces, e, np, head_dim, &run_rows);
    if (count && !values)
      FN(shared_logits)(pc, count, run_rows, cache, row, num_heads, g, kc, lstride, qs, logits, head_dim, kt, scale,
                        next);
    else if (count)
      FN(shared_values)(pc, count, run_rows, cache, row, num_heads, g, vc, lstride, acc, logits, head_dim, kt, next);
    if (count) {
      e += count - 1;
      continue;
    }
#endif
    if (values)
#endif
      rows = FN(rows_of)(raw, (size_t)pc->n * row, !cold || e > 0, wide);
    for (int s = pc->j0 * num_heads; s < pc->j1 * num_heads;) {
      const int in_kv = s % num_heads % g, left = g - in_kv;
      const int G = left < TILE ? left : TILE;
      const size_t at = (size_t)(s % num_heads / g) * head_dim;  // this KV head's first value in a row
      float *li = logits + (size_t)s * lstride + pc->pos;
      float *a = (float *)(acc + s * vc);
      const float *qh = (const float *)(qs + s * kc);
      if (values) {
        const ROW *kv = rows + at;
#ifdef DOT_BF16  // probabilities as bfloat16: 2 * lstride values apart
        const uint16_t *pb = (const uint16_t *)(logits + (size_t)s * lstride) + pc->pos, *vb = raw + at;
        const size_t pst = (size_t)lstride * 2;
        if (G == TILE) FN(tile_values_bf16)(TILE, a, head_dim, pb, pst, vb, kv, pc->n, row, next);
        else if (G == 2) FN(tile_values_bf16)(2, a, head_dim, pb, pst, vb, kv, pc->n, row, next);
        else FN(tile_values_bf16)(1, a, head_dim, pb, pst, vb, kv, pc->n, row, next);
#else
        if (G == TILE) FN(tile_values)(TILE, a, head_dim, li, lstride, kv, pc->n, row, next);
        else if (G == 2) FN(tile_values)(2, a, head_dim, li, lstride, kv, pc->n, row, next);
        else FN(tile_values)(1, a, head_dim, li, lstride, kv, pc->n, row, next);
#endif
      } else {
#ifdef DOT_BF16  // queries as stored (kc * 16 values apart), the pool's own rows; the logits scaled
        const QROW *qb = (const uint16_t *)qh;
        const KROW *kb = raw + at;
        const size_t qst = (size_t)kc * 16;
        const float sc = scale;
#else  // queries scaled already
        const QROW *qb = qh;
        const KROW *kb = rows + at;
        const size_t qst = (size_t)head_dim;
        const float sc = 1.f;
        (void)scale;
#endif
        if (G == TILE) FN(tile_logits)(TILE, qb, qst, head_dim, sc, li, lstride, kb, pc->n, row, next);
        else if (G == 2) FN(tile_logits)(2, qb, qst, head_dim, sc, li, lstride, kb, pc->n, row, next);
        else FN(tile_logits)(1, qb, qst, head_dim, sc, li, lstride, kb, pc->n, row, next);
      }
      s += G;
    }
  }
}

static void FN(paged_decode)(QELEM *out, const QELEM *q, const ELEM *k_cache, const ELEM *v_cache,
                             const int32_t *block_tables, const int32_t *ctx_lens,
                             const int64_t *rows, int s_begin, int s_end, int max_blocks,
                             int block_size, int num_heads, int num_kv_heads, int head_dim,
                             int head_dim_v, int64_t q_token_stride, int64_t q_head_stride,
                             float scale, int window, float softcap, const float *sinks) {
  // All heads of a sequence advance together, block by block, so each K/V row (all KV heads,
  // contiguous in the pool) is read from memory once per step and layer. Neighbouring sequences
  // whose tables start with the same physical blocks (completions of one prompt) are served together
  // over those blocks: their shared rows are read once.
#if defined(DOT_BF16) && (defined(__x86_64__) || defined(__i386__))
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr | 0x8040);  // FTZ and DAZ: subnormals flushed in every build, as vdpbf16ps does
#endif
  const int kc = head_dim / 8, vc = head_dim_v / 8, g = num_heads / num_kv_heads;
  const size_t k_row = (size_t)num_kv_heads * head_dim, v_row = (size_t)num_kv_heads * head_dim_v;
  int max_len = 0;
  for (int s = s_begin; s < s_end; ++s) max_len = ctx_lens[s] > max_len ? ctx_lens[s] : max_len;
  const int lstride = ((max_len + 7) & ~7) + 8;  // a logits row: the longest context, padded
  const size_t member_bytes = (size_t)num_heads * (lstride * 4 + (kc + vc) * sizeof(v8));
  int gmax = (int)((1u << 20) / member_bytes);  // about 1 MB of rows per group, at least one member
  gmax = gmax < 1 ? 1 : gmax > 16 ? 16 : gmax;
  gmax = gmax < s_end - s_begin ? gmax : s_end - s_begin;
  const int states_max = gmax * num_heads;
  // one heap block per call: scaled queries, accumulators, logit rows, the group's pieces (each
  // member's blocks, at most), and room for one block widened to float32 (WIDEN_BLOCKS) or, first,
  // for SHARED_ROWS rows of a KV head's K transposed or V unpacked (the shared runs; whole lines)
#ifdef WIDEN_BLOCKS
  const size_t wide_floats = (size_t)block_size * (k_row > v_row ? k_row : v_row);
#else
  const size_t wide_floats = 0;
#endif
#if defined(DOT_BF16) && defined(__AVX512BF16__)
  const size_t kt_bytes = (size_t)SHARED_ROWS * (head_dim > head_dim_v ? head_dim : head_dim_v) * 2;
#else
  const size_t kt_bytes = 0;
#endif
  const size_t piece_max = (size_t)gmax * max_blocks;  // a group's pieces: each member's blocks, at most
  const size_t bytes = kt_bytes + (size_t)states_max * ((kc + vc) * sizeof(v8) + lstride * sizeof(float)) +
                       2 * piece_max * sizeof(piece) + wide_floats * sizeof(float);
  char *mem = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
  if (!mem) abort();  // no way to report from here; about a megabyte at the shapes served
  void *kt = mem;
  v8 *qs = (v8 *)(mem + kt_bytes), *acc = qs + (size_t)states_max * kc;
  float *logits = (float *)(acc + (size_t)states_max * vc);
  piece *pieces = (piece *)(logits + (size_t)states_max * lstride), *next_pieces = pieces + piece_max;
  float *wide = (float *)(next_pieces + piece_max);
  const size_t k_bytes = k_row * sizeof(ELEM), v_bytes = v_row * sizeof(ELEM);
  int s1, np = group_pieces(pieces, s_begin, s_end, &s1, gmax, block_tables, ctx_lens, max_blocks, block_size,
                            window);
  for (int s0 = s_begin, cold = 1; s0 < s_end; cold = 0) {
    const int nm = s1 - s0;
    for (int j = 0; j < nm; ++j)
      for (int i = 0; i < num_heads; ++i) {
        const int st = j * num_heads + i;
        const QELEM *src = q + rows[s0 + j] * q_token_stride + (int64_t)i * q_head_stride;
#ifdef DOT_BF16  // as stored; the scale multiplies the logits
        memcpy(qs + st * kc, src, (size_t)head_dim * sizeof *src);
#else
        for (int c = 0; c < kc; ++c) qs[st * kc + c] = QLOAD8(src + 8 * c) * scale;
#endif
        for (int c = 0; c < vc; ++c) acc[st * vc + c] = (v8){0};
      }
    const rows_list own_k = {pieces + 1, cold ? np - 1 : 0, (const char *)k_cache, k_bytes};
    const rows_list own_v = {pieces, np, (const char *)v_cache, v_bytes};
    const size_t steps = FN(pass_steps)(pieces, np, num_heads, g);  // of each of the group's two passes
    ahead next = ahead_of(own_k, own_v, steps);
    FN(pass)(0, pieces, np, k_cache, &next, cold, k_row, num_heads, g, kc, vc, lstride, qs, acc, logits,
             head_dim, wide, kt, scale);
    float denom[nm * num_heads];
    for (int j = 0; j < nm; ++j) {
      const int len = ctx_lens[s0 + j], n = window > 0 && len > window ? window : len;
      for (int i = 0; i < num_heads; ++i) {
        const int st = j * num_heads + i;
        const float m = softmax_row(logits + (size_t)st * lstride, n, softcap, denom + st, BF16_PROBS);
        if (sinks) denom[st] += expf(sinks[i] - m);
      }
    }
    int s2 = s1, next_np = 0;  // the next group, its K rows prefetched during this V pass
    if (s1 < s_end)
      next_np = group_pieces(next_pieces, s1, s_end, &s2, gmax, block_tables, ctx_lens, max_blocks, block_size,
                             window);
    const rows_list next_k = {next_pieces, next_np, (const char *)k_cache, k_bytes}, none = {NULL, 0, NULL, 0};
    next = ahead_of(next_k, none, steps);
    FN(pass)(1, pieces, np, v_cache, &next, 0, v_row, num_heads, g, kc, vc, lstride, qs, acc, logits,
             head_dim_v, wide, kt, scale);
    for (int j = 0; j < nm; ++j)
      for (int i = 0; i < num_heads; ++i) {
        const int st = j * num_heads + i;
        QELEM *dst = out + (rows[s0 + j] * num_heads + i) * (int64_t)head_dim_v;
        const v8 inv = (v8){0} + 1.f / denom[st];
#ifdef DOT_BF16
        pairs_order((float *)(acc + st * vc), head_dim_v);
#endif
        for (int c = 0; c < vc; ++c) QSTORE8(dst + 8 * c, acc[st * vc + c] * inv);
      }
    piece *const done = pieces;
    pieces = next_pieces, next_pieces = done, np = next_np;
    s0 = s1, s1 = s2;
  }
  free(mem);
#if defined(DOT_BF16) && (defined(__x86_64__) || defined(__i386__))
  _mm_setcsr(csr);
#endif
}

// paged_decode over parts ranges of sequences, [bounds[p], bounds[p + 1]), one per thread; the
// sequences are the caller's to check (paged_decode_ranges, decode_layers).
static void FN(decode_ranges)(const int32_t *bounds, int parts, QELEM *out, const QELEM *q,
                              const ELEM *k_cache, const ELEM *v_cache,
                              const int32_t *block_tables, const int32_t *ctx_lens,
                              const int64_t *rows, int max_blocks, int block_size, int num_heads,
                              int num_kv_heads, int head_dim, int head_dim_v,
                              int64_t q_token_stride, int64_t q_head_stride, float scale, int window,
                              float softcap, const float *sinks) {
  assert(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim % 8 == 0 && head_dim_v % 8 == 0);
  if (parts <= 0) return;  // no sequences: nothing to attend (num_threads needs a positive count)
#pragma omp parallel for num_threads(parts) schedule(static, 1)
  for (int p = 0; p < parts; ++p)
    FN(paged_decode)(out, q, k_cache, v_cache, block_tables, ctx_lens, rows, bounds[p],
                     bounds[p + 1], max_blocks, block_size, num_heads, num_kv_heads, head_dim,
                     head_dim_v, q_token_stride, q_head_stride, scale, window, softcap, sinks);
}

// decode_ranges over seqs sequences (block_tables [seqs, max_blocks], ctx_lens and rows [seqs]), a pool
// of num_blocks blocks and num_rows query rows (q and out), after checking every index the ranges
// reach (check_decode): 0, or (nothing written) what was out of range.
int FN(paged_decode_ranges)(const int32_t *bounds, int parts, QELEM *out, const QELEM *q,
                            const ELEM *k_cache, const ELEM *v_cache,
                            const int32_t *block_tables, const int32_t *ctx_lens,
                            const int64_t *rows, int max_blocks, int block_size, int num_heads,
                            int num_kv_heads, int head_dim, int head_dim_v,
                            int64_t q_token_stride, int64_t q_head_stride, float scale, int window,
                            float softcap, const float *sinks, int seqs, int64_t num_blocks,
                            int64_t num_rows, refusal *why) {
  const int refused = check_decode(bounds, parts, seqs, block_tables, ctx_lens, rows, max_blocks, block_size,
                                   num_blocks, num_rows, why);
  if (!refused)
    FN(decode_ranges)(bounds, parts, out, q, k_cache, v_cache, block_tables, ctx_lens, rows, max_blocks,
                      block_size, num_heads, num_kv_heads, head_dim, head_dim_v, q_token_stride,
                      q_head_stride, scale, window, softcap, sinks);
  return refused;
}

#undef QELEM
#undef QLOAD8
#undef QSTORE8
#undef ROW
#undef ROW_LOAD8
#undef ROW_LOAD16
#undef KROW
#undef QROW
#undef BF16_PROBS
#undef TILE
