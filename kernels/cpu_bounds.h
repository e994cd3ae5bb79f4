/* The index checks of the kernels' entry points.
 *
 * Every index a caller hands to a kernel (a token id, a pool slot, a block id, a context length, a
 * row) is checked against the buffer it indexes before anything is read or written through it: an
 * entry point that finds one out of range does nothing, returns which kind it was and fills a
 * `refusal` (pagedinfer/attention/cpu_kernel.py's `Refusal` turns it into an exception naming it).
 * Each index is read once, ahead of the work: integer compares over the step's metadata, against
 * calls that read megabytes. What the caller builds itself (tensor shapes, strides, head counts) it
 * vouches for; those preconditions are assert()ions, compiled in only in the debug build
 * (PAGEDINFER_KERNEL_DEBUG=1: -UNDEBUG after the default -DNDEBUG; the sanitizer tier's).
 */
#ifndef PAGEDINFER_CPU_BOUNDS_H
#define PAGEDINFER_CPU_BOUNDS_H
#include <assert.h>
#include <stdint.h>

/* What was out of range: an entry point's result (0: nothing, the work is done). */
enum {
    REFUSED_NONE = 0,
    REFUSED_SLOT = 1,   /* a new token's pool slot: at = the token, limit = the pool's slots */
    REFUSED_BLOCK = 2,  /* a block id in a sequence's table: at = the sequence, limit = the pool's blocks */
    REFUSED_LENGTH = 3, /* a context length: at = the sequence, limit = its table's slots */
    REFUSED_ROW = 4,    /* a sequence's query row: at = the sequence, limit = the query rows */
    REFUSED_RANGES = 5, /* the thread ranges of sequences: at = the range, limit = the sequences */
    REFUSED_TOKEN = 6,  /* a row of a weight (a token id of an embedding): at = its position, limit = the rows */
    REFUSED_LOGITS = 7, /* a logits row: at = its position, limit = the rows */
    REFUSED_ROW_RANGE = 8, /* rows [lo, hi) of a tensor: at = lo, found = hi, limit = its rows */
    REFUSED_EXPERT = 9, /* a row's chosen expert: at = its slot (row * k + rank), limit = the layer's experts */
};

typedef struct {
    int64_t at, found, limit; /* the index's position, its value, and the bound it broke */
} refusal;

static inline int refuse(refusal *why, int what, int64_t at, int64_t found, int64_t limit) {
    if (why) *why = (refusal){at, found, limit};
    return what;
}

/* idx[0, n) each in [lo, limit): 0, else `what` for the first that is not. */
static inline int check_indexes(const int64_t *idx, int n, int64_t lo, int64_t limit, int what, refusal *why) {
    for (int i = 0; i < n; i++)
        if (idx[i] < lo || idx[i] >= limit) return refuse(why, what, i, idx[i], limit);
    return REFUSED_NONE;
}

/* The new tokens' slots, each a slot of the pool or negative (padding, skipped). */
static inline int check_slots(const int64_t *slots, int n, int64_t num_slots, refusal *why) {
    return check_indexes(slots, n, INT64_MIN, num_slots, REFUSED_SLOT, why);
}

/* A decode call's sequences: the thread ranges [bounds[p], bounds[p + 1]) ascending within [0, seqs);
 * each sequence they cover with a context that fits its table [max_blocks] (ctx_lens[s] slots, from
 * 0), every block of the table it reads a block of the pool, and its query row one of num_rows. */
static inline int check_decode(const int32_t *bounds, int parts, int seqs, const int32_t *block_tables,
                               const int32_t *ctx_lens, const int64_t *rows, int max_blocks, int block_size,
                               int64_t num_blocks, int64_t num_rows, refusal *why) {
    for (int p = 0; p < parts; p++)
        if (bounds[p] < 0 || bounds[p] > bounds[p + 1] || bounds[p + 1] > seqs)
            return refuse(why, REFUSED_RANGES, p, bounds[p + 1], seqs);
    for (int s = parts > 0 ? bounds[0] : 0; s < (parts > 0 ? bounds[parts] : 0); s++) {
        const int64_t len = ctx_lens[s];
        if (len < 0 || len > (int64_t)max_blocks * block_size)
            return refuse(why, REFUSED_LENGTH, s, len, (int64_t)max_blocks * block_size);
        const int32_t *table = block_tables + (int64_t)s * max_blocks;
        for (int64_t b = 0; b * block_size < len; b++)
            if (table[b] < 0 || table[b] >= num_blocks) return refuse(why, REFUSED_BLOCK, s, table[b], num_blocks);
        if (rows[s] < 0 || rows[s] >= num_rows) return refuse(why, REFUSED_ROW, s, rows[s], num_rows);
    }
    return REFUSED_NONE;
}

#endif
