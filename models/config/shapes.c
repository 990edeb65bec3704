/* The published shapes the benchmarks and the plan use without a config file (docs/design.md,
 * section 4). */
#include "models/config.h"

#include <stdio.h>
#include <string.h>

/* A published Qwen2.5 shape: the values of its HF config.json (docs/design.md, section 4). */
static void qwen25(mt_model_config *c, int64_t d, int64_t I, int64_t L, int64_t H, int64_t KV, int64_t V,
                   bool tied)
{
    memset(c, 0, sizeof *c);
    c->family = MT_FAMILY_QWEN2;
    snprintf(c->model_type, sizeof c->model_type, "qwen2");
    c->hidden = d;
    c->intermediate = I;
    c->layers = L;
    c->heads = H;
    c->kv_heads = KV;
    c->head_dim = d / H;
    c->vocab = V;
    c->max_positions = 32768;
    c->rope_theta = 1e6;
    c->rms_eps = 1e-6;
    c->tied = tied;
    c->qkv_bias = true;
}

int mt_config_from_shape(const char *shape_name, mt_model_config *cfg)
{
    if (!shape_name) return -1;
    if (strcmp(shape_name, "qwen2.5-0.5b") == 0) qwen25(cfg, 896, 4864, 24, 14, 2, 151936, true);
    else if (strcmp(shape_name, "qwen2.5-1.5b") == 0) qwen25(cfg, 1536, 8960, 28, 12, 2, 151936, true);
    else if (strcmp(shape_name, "qwen2.5-3b") == 0) qwen25(cfg, 2048, 11008, 36, 16, 2, 151936, true);
    else if (strcmp(shape_name, "qwen2.5-7b") == 0) qwen25(cfg, 3584, 18944, 28, 28, 4, 152064, false);
    else if (strcmp(shape_name, "qwen2.5-14b") == 0) qwen25(cfg, 5120, 13824, 48, 40, 8, 152064, false);
    else if (strcmp(shape_name, "qwen2.5-32b") == 0) qwen25(cfg, 5120, 27648, 64, 40, 8, 152064, false);
    else if (strcmp(shape_name, "tiny") == 0) {
        /* models/configs/tiny-byte.json: a byte-level model for tests and smoke runs. */
        qwen25(cfg, 192, 512, 6, 6, 2, 256, true);
        cfg->head_dim = 32;
        cfg->max_positions = 256;
        cfg->rope_theta = 10000.0;
    } else
        return -1;
    return 0;
}
