/* The typed half of cpu_decode_step.c, included once per element type (a C template): ELEM is the
 * element type of every activation and norm weight; FN(name) names that type's kernels (the GEMMs'
 * formats come with their segments); KV(name) the cpu_paged_decode.c
 * K/V write and attention for a pool of that type or, with float32 activations, a 16-bit one;
 * STEP(name) names the instantiation. The parameters are undefined at the end. */

/* A branch's output h [rows, H] as it joins the stream (model/llama.py, DecoderLayer._branch): normed
 * by w where the family norms it (w not NULL), times the residual multiplier where it is not 1. */
static void STEP(branch)(ELEM *h, const ELEM *w, const step_meta *s) {
    if (w) FN(add_rms_norm)(h, NULL, w, h, s->rows, s->hidden, s->eps);
    if (s->residual_scale != 1.0f) FN(scale_rows)(h, (int64_t)s->rows * s->hidden, s->residual_scale);
}

/* residual [rows, H] in: the embeddings; out: the residual stream after the last layer. x [rows, H]
 * out: the final norm of that stream. h [rows, H], qkv [rows, (Hq + 2 Hkv) D], attn [rows, Hq D],
 * act [rows, I], (step_meta.gelu) gate_up [rows, 2 I] and (a layer with experts) moe_work
 * [moe_layer_work(layer's moe, rows)] are scratch. Each layer group's slots and sequences are checked once, before the
 * first layer (a group's layers read the same ones, in pools of the same blocks): 0, or (nothing done)
 * what was out of range (cpu_bounds.h). */
int STEP(decode_layers)(const step_layer *layer, const step_meta *s, ELEM *residual, ELEM *h, ELEM *x, ELEM *qkv,
                        ELEM *attn, ELEM *act, ELEM *gate_up, ELEM *moe_work, refusal *why) {
    const int d = s->head_dim, qkv_n = (s->q_heads + 2 * s->kv_heads) * d, qd = s->q_heads * d;
    const int64_t n = (int64_t)s->rows * s->hidden;
    int refused = REFUSED_NONE;
    for (int g = 0; g < s->groups && !refused; g++) {
        refused = check_slots(s->slots[g], s->rows, s->num_blocks * s->block_size, why);
        if (!refused)
            refused = check_decode(s->bounds, s->parts, s->rows, s->tables[g], s->ctx_lens, s->query_rows,
                                   s->max_blocks[g], s->block_size, s->num_blocks, s->rows, why);
    }
    if (refused) return refused;
    for (int i = 0; i < s->layers; i++, layer++) {
        const int g = layer->group;
        ELEM *in = x; /* each branch's input: the normed stream, or where no norm precedes it, the stream */
        if (layer->input_norm)
            FN(add_rms_norm)(residual, i ? h : NULL, layer->input_norm, x, s->rows, s->hidden, s->eps);
        else {
            if (i) FN(add_rows)(residual, h, n);
            in = residual;
        }
        TIMED(gemm_seconds, gemm_segments(layer->qkv, layer->qkv_segments, in, qkv, s->rows, s->hidden, 0));
        /* per-head q/k norms in the RoPE chain, or (the layer path's _norm_all_qk) norms over all of a
         * row's q and k, then the clip, before it */
        const int norm_all = s->qk_norm_all || s->clip_qkv != 0.0f;
        if (s->qk_norm_all) /* one RMSNorm over all of a row's q, one over all of its k, in place */
            for (int r = 0; r < s->rows; r++) {
                ELEM *q = qkv + (int64_t)r * qkv_n;
                FN(add_rms_norm)(q, NULL, layer->q_norm, q, 1, qd, s->eps);
                FN(add_rms_norm)(q + qd, NULL, layer->k_norm, q + qd, 1, s->kv_heads * d, s->eps);
            }
        if (s->clip_qkv != 0.0f) FN(clamp_rows)(qkv, (int64_t)s->rows * qkv_n, s->clip_qkv);
        FN(qk_norm_rope)(qkv, qkv_n, s->rows, s->q_heads, s->kv_heads, d, s->cos[layer->rope],
                         s->sin[layer->rope],
                         norm_all ? NULL : layer->q_norm, norm_all ? NULL : layer->k_norm, s->eps);
        const ELEM *k = qkv + qd, *v = qkv + qd + s->kv_heads * d;
        TIMED(attention_seconds, {
            KV(store_rows)(layer->k_cache, layer->v_cache, k, v, s->slots[g], s->rows, s->kv_heads, d, d, qkv_n, d,
                           qkv_n, d);
            KV(decode_ranges)(s->bounds, s->parts, attn, qkv, layer->k_cache, layer->v_cache, s->tables[g],
                              s->ctx_lens, s->query_rows, s->max_blocks[g], s->block_size, s->q_heads, s->kv_heads, d,
                              d, qkv_n, d, s->scale, layer->window, 0.f, NULL);
        });
        TIMED(gemm_seconds, gemm_segments(&layer->o, 1, attn, h, s->rows, qd, 0));
        STEP(branch)(h, layer->attn_out_norm, s);
        if (layer->post_norm)
            FN(add_rms_norm)(residual, h, layer->post_norm, x, s->rows, s->hidden, s->eps);
        else
            FN(add_rows)(residual, h, n);
        if (layer->moe)
            TIMED(gemm_seconds, FN(moe_layer)(layer->moe, in, s->rows, h, moe_work));
        else {
            if (s->gelu) {
                TIMED(gemm_seconds, gemm_segments(&layer->gate_up, 1, in, gate_up, s->rows, s->hidden, 0));
                FN(gelu_tanh_mul)(gate_up, act, s->rows, s->inter);
            } else
                TIMED(gemm_seconds, gemm_segments(&layer->gate_up, 1, in, act, s->rows, s->hidden, 1));
            TIMED(gemm_seconds, gemm_segments(&layer->down, 1, act, h, s->rows, s->inter, 0));
        }
        STEP(branch)(h, layer->mlp_out_norm, s);
    }
    FN(add_rms_norm)(residual, h, s->final_norm, x, s->rows, s->hidden, s->eps);
    return REFUSED_NONE;
}

#undef ELEM
#undef FN
#undef KV
#undef STEP
