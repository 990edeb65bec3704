/* The StarPU-free host state of fake_state.h. */
#include "tests/fuzz/fake_state.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char fuzz_tiny_config[] =
    "{\"architectures\": [\"Qwen2ForCausalLM\"], \"model_type\": \"qwen2\", \"hidden_size\": 8, "
    "\"intermediate_size\": 16, \"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"num_key_value_heads\": 1, "
    "\"head_dim\": 4, \"vocab_size\": 16, \"max_position_embeddings\": 32, \"rope_theta\": 10000.0, "
    "\"rms_norm_eps\": 1e-06, \"tie_word_embeddings\": false, \"hidden_act\": \"silu\"}";

mt_host_state *fuzz_fake_state(void)
{
    mt_host_state *st = calloc(1, sizeof *st);
    char err[1024];
    if (!st || mt_config_parse(fuzz_tiny_config, "tiny config", &st->cfg, err, sizeof err)) {
        fprintf(stderr, "fuzz: %s\n", err);
        abort();
    }
    st->compute_dtype = MT_DTYPE_F32;
    mt_layout_build(&st->cfg, MT_TILE_EMBED, &st->layout_embed);
    mt_layout_build(&st->cfg, MT_TILE_LAYER, &st->layout_layer);
    mt_layout_build(&st->cfg, MT_TILE_HEAD, &st->layout_head);
    st->ntiles = (int)st->cfg.layers + 2;
    st->tiles = calloc((size_t)st->ntiles, sizeof *st->tiles);
    for (int i = 0; i < st->ntiles; i++) {
        mt_tile *t = &st->tiles[i];
        t->index = i;
        t->layout = i == 0 ? &st->layout_embed : i == st->ntiles - 1 ? &st->layout_head : &st->layout_layer;
        t->numel = t->layout->numel;
        t->master = calloc((size_t)t->numel, sizeof(float));
        t->adam_m = calloc((size_t)t->numel, sizeof(float));
        t->adam_v = calloc((size_t)t->numel, sizeof(float));
        for (int64_t k = 0; k < t->numel; k++) t->master[k] = 0.001f * (float)k;
    }
    return st;
}

void mt_state_sync_weights(mt_host_state *st) { (void)st; }

/* The full layout's accessors: the fake state has no compact tiles and no streamed copy. */
void mt_state_read_master(const mt_host_state *st, int tile, int64_t offset, int64_t n, float *out)
{
    memcpy(out, st->tiles[tile].master + offset, sizeof(float) * (size_t)n);
}

void mt_state_write_master(mt_host_state *st, int tile, int64_t offset, int64_t n, const float *in)
{
    memcpy(st->tiles[tile].master + offset, in, sizeof(float) * (size_t)n);
}

const float *mt_state_master_f32(const mt_host_state *st, int tile, float **buf)
{
    (void)buf;
    return st->tiles[tile].master;
}
