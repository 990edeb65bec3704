/* Rope scaling: its fields checked, a --rope-scaling TYPE:FACTOR given by the user, and the
 * sequence lengths a config takes with it (each refusal says which --rope-scaling would do). */
#include "models/config.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/config/internal.h"
#include "models/report.h"

/* The rope_type names of HF configs, by mt_rope_type. */
const char *const mt_cfg_rope_type_names[MT_ROPE_LLAMA3 + 1] = {"default", "linear", "dynamic", "yarn",
                                                               "llama3"};

const char *mt_cfg_rope_type_name(mt_rope_type t)
{
    return (unsigned)t < sizeof mt_cfg_rope_type_names / sizeof mt_cfg_rope_type_names[0] ? mt_cfg_rope_type_names[t] : "?";
}

/* The length a scaling's factor multiplies: the original pretraining context for yarn and
 * llama3, max_position_embeddings itself for linear and dynamic (transformers' formulas use it). */
int64_t mt_cfg_rope_original_length(const mt_model_config *cfg)
{
    return cfg->rope_type == MT_ROPE_YARN || cfg->rope_type == MT_ROPE_LLAMA3 ? cfg->rope_original_max_positions
                                                                              : cfg->max_positions;
}

/* The rope scaling fields of a config against what each type needs. */
int mt_cfg_validate_rope_scaling(const mt_model_config *cfg, const char *name, char *err, size_t errlen)
{
    if ((unsigned)cfg->rope_type > MT_ROPE_LLAMA3)
        return mt_fail(err, errlen, "%s: key 'rope_scaling': unknown rope type %d", name, (int)cfg->rope_type);
    if (cfg->rope_type == MT_ROPE_DEFAULT) {
        if (cfg->rope_scaling_factor != 0)
            return mt_fail(err, errlen, "%s: key 'rope_scaling': factor %g without a rope_type", name,
                           cfg->rope_scaling_factor);
        return 0;
    }
    const char *type = mt_cfg_rope_type_name(cfg->rope_type);
    if (!(cfg->rope_scaling_factor > 0) || !isfinite(cfg->rope_scaling_factor))
        return mt_fail(err, errlen, "%s: key 'rope_scaling': %s factor must be positive, got %g", name, type,
                    cfg->rope_scaling_factor);
    if (cfg->rope_type == MT_ROPE_LLAMA3 &&
        (!(cfg->rope_low_freq_factor > 0) || !(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor) ||
         !isfinite(cfg->rope_high_freq_factor)))
        return mt_fail(err, errlen, "%s: key 'rope_scaling': needs 0 < low_freq_factor < high_freq_factor, "
                    "got %g and %g", name, cfg->rope_low_freq_factor, cfg->rope_high_freq_factor);
    if ((cfg->rope_type == MT_ROPE_YARN || cfg->rope_type == MT_ROPE_LLAMA3) &&
        (cfg->rope_original_max_positions <= 0 || cfg->rope_original_max_positions > MAX_SIZE))
        return mt_fail(err, errlen, "%s: key 'rope_scaling': original_max_position_embeddings must be a "
                    "positive integer, got %lld", name, (long long)cfg->rope_original_max_positions);
    if (cfg->rope_type == MT_ROPE_YARN) {
        /* The ramp's ends are dims at which a wavelength makes beta turns over the original
         * context: log(original / (beta 2 pi)) needs beta > 0, and the ramp rises only when the
         * fast end (more turns, shorter wavelengths) is at or above the slow one. */
        if (!(cfg->rope_beta_fast > 0) || !(cfg->rope_beta_slow > 0) || !isfinite(cfg->rope_beta_fast) ||
            cfg->rope_beta_fast < cfg->rope_beta_slow)
            return mt_fail(err, errlen, "%s: key 'rope_scaling': yarn needs beta_fast >= beta_slow > 0, got %g and %g",
                        name, cfg->rope_beta_fast, cfg->rope_beta_slow);
        if (!isfinite(cfg->rope_mscale) || !isfinite(cfg->rope_mscale_all_dim) ||
            !(cfg->rope_attention_factor >= 0) || !isfinite(cfg->rope_attention_factor))
            return mt_fail(err, errlen, "%s: key 'rope_scaling': yarn's mscale %g, mscale_all_dim %g and "
                        "attention_factor %g must be finite (attention_factor positive, or 0 when derived)", name,
                        cfg->rope_mscale, cfg->rope_mscale_all_dim, cfg->rope_attention_factor);
    }
    /* dynamic raises the base to the power D / (D - 2) */
    if (cfg->rope_type == MT_ROPE_DYNAMIC && cfg->head_dim <= 2)
        return mt_fail(err, errlen, "%s: key 'rope_scaling': dynamic scaling needs head_dim > 2, got %lld", name,
                    (long long)cfg->head_dim);
    const double longest = cfg->rope_scaling_factor * (double)mt_cfg_rope_original_length(cfg);
    if (!(longest <= (double)MAX_SIZE))
        return mt_fail(err, errlen, "%s: key 'rope_scaling': factor %g x %lld positions is absurdly large (limit %lld)",
                    name, cfg->rope_scaling_factor, (long long)mt_cfg_rope_original_length(cfg), (long long)MAX_SIZE);
    return 0;
}

int64_t mt_config_max_seq_len(const mt_model_config *cfg)
{
    int64_t limit = cfg->max_positions;
    if (cfg->rope_type != MT_ROPE_DEFAULT) {
        /* validate bounds factor x original by MAX_SIZE, so the product fits */
        const int64_t scaled = (int64_t)floor(cfg->rope_scaling_factor * (double)mt_cfg_rope_original_length(cfg));
        if (scaled > limit) limit = scaled;
    }
    /* Mistral's and Mixtral's window is not computed (their attention here is full causal, the
     * same up to the window); gpt_oss's sliding layers are windowed in the attention itself */
    if (cfg->family != MT_FAMILY_GPT_OSS && cfg->sliding_window > 0 && cfg->sliding_window < limit)
        limit = cfg->sliding_window;
    return limit;
}

/* The smallest whole factor above 1 that takes seq_len over `original` positions. */
static long long factor_for(int64_t seq_len, int64_t original)
{
    const long long f = (long long)((seq_len + original - 1) / original);
    return f < 2 ? 2 : f;
}

int mt_config_check_seq_len(const mt_model_config *cfg, int64_t seq_len, char *err, size_t errlen)
{
    if (seq_len < 1) return mt_fail(err, errlen, "sequence length %lld: must be at least 1", (long long)seq_len);
    const int64_t limit = mt_config_max_seq_len(cfg);
    if (seq_len <= limit) return 0;
    const long long T = (long long)seq_len, L = (long long)limit;
    if (cfg->family != MT_FAMILY_GPT_OSS && cfg->sliding_window > 0 && limit == cfg->sliding_window)
        return mt_fail(err, errlen, "sequence length %lld exceeds the model's sliding_window %lld: sliding-window "
                       "attention is not implemented (full causal attention, which is the same up to that length)",
                       T, L);
    const int64_t original = mt_cfg_rope_original_length(cfg);
    switch (cfg->rope_type) {
    case MT_ROPE_DEFAULT:
        return mt_fail(err, errlen, "sequence length %lld exceeds the model's max_position_embeddings %lld: "
                       "--rope-scaling yarn:%lld (or linear:%lld, dynamic:%lld) extends the rope to %lld positions",
                       T, L, factor_for(seq_len, original), factor_for(seq_len, original),
                       factor_for(seq_len, original), factor_for(seq_len, original) * (long long)original);
    case MT_ROPE_LLAMA3:
        return mt_fail(err, errlen, "sequence length %lld exceeds the model's %lld positions (max_position_embeddings, "
                       "with llama3 rope scaling of factor %g over %lld, which --rope-scaling does not change)", T, L,
                       cfg->rope_scaling_factor, (long long)original);
    default:
        return mt_fail(err, errlen, "sequence length %lld exceeds the model's %lld positions (%s rope scaling: factor %g "
                       "x %lld): --rope-scaling %s:%lld extends it to %lld", T, L, mt_cfg_rope_type_name(cfg->rope_type),
                       cfg->rope_scaling_factor, (long long)original, mt_cfg_rope_type_name(cfg->rope_type),
                       factor_for(seq_len, original), factor_for(seq_len, original) * (long long)original);
    }
}

int mt_rope_scaling_parse(const char *spec, mt_rope_type *type, double *factor, char *err, size_t errlen)
{
    const char *colon = spec ? strchr(spec, ':') : NULL;
    if (!colon)
        return mt_fail(err, errlen, "--rope-scaling %s: expected TYPE:FACTOR, TYPE one of linear, dynamic, yarn "
                       "(e.g. yarn:4)", spec ? spec : "");
    const size_t n = (size_t)(colon - spec);
    mt_rope_type t;
    if (n == 6 && strncmp(spec, "linear", n) == 0) t = MT_ROPE_LINEAR;
    else if (n == 7 && strncmp(spec, "dynamic", n) == 0) t = MT_ROPE_DYNAMIC;
    else if (n == 4 && strncmp(spec, "yarn", n) == 0) t = MT_ROPE_YARN;
    else if (n == 6 && strncmp(spec, "llama3", n) == 0)
        return mt_fail(err, errlen, "--rope-scaling %s: llama3 is not offered (its factor does not set the length: "
                       "Llama 3.1 has factor 8 over 8192 and 131072 positions); one of linear, dynamic, yarn", spec);
    else
        return mt_fail(err, errlen, "--rope-scaling %s: type '%.*s' is not one of linear, dynamic, yarn", spec,
                       (int)n, spec);
    char *end;
    errno = 0;
    const double f = strtod(colon + 1, &end);
    if (errno || end == colon + 1 || *end || !isfinite(f))
        return mt_fail(err, errlen, "--rope-scaling %s: factor '%s' is not a number", spec, colon + 1);
    if (!(f > 1))
        return mt_fail(err, errlen, "--rope-scaling %s: factor %g must be above 1 (the new length over the original)",
                       spec, f);
    *type = t;
    *factor = f;
    return 0;
}

int mt_config_set_rope_scaling(mt_model_config *cfg, const char *spec, char *err, size_t errlen)
{
    mt_rope_type type;
    double factor;
    if (mt_rope_scaling_parse(spec, &type, &factor, err, errlen)) return -1;
    mt_model_config c = *cfg;
    if (c.rope_type == MT_ROPE_DEFAULT) {
        c.rope_type = type;
        if (type == MT_ROPE_YARN) {
            /* transformers' defaults for the keys a user does not give (_compute_yarn_parameters) */
            c.rope_original_max_positions = c.max_positions;
            c.rope_beta_fast = 32;
            c.rope_beta_slow = 1;
            c.rope_mscale = c.rope_mscale_all_dim = c.rope_attention_factor = 0;
            c.rope_truncate = true;
        }
    } else if (c.rope_type != type || type == MT_ROPE_LLAMA3) {
        return c.rope_type == MT_ROPE_LLAMA3
                   ? mt_fail(err, errlen, "--rope-scaling %s: the model's rope is already llama3-scaled (factor %g), "
                             "which --rope-scaling does not change", spec, c.rope_scaling_factor)
                   : mt_fail(err, errlen, "--rope-scaling %s: the model's rope is already %s-scaled (factor %g); "
                             "--rope-scaling can change its factor (%s:F), not its type", spec,
                             mt_cfg_rope_type_name(c.rope_type), c.rope_scaling_factor, mt_cfg_rope_type_name(c.rope_type));
    }
    c.rope_scaling_factor = factor;
    const double longest = factor * (double)mt_cfg_rope_original_length(&c);
    if (!(longest <= (double)MAX_SIZE))
        return mt_fail(err, errlen, "--rope-scaling %s: factor %g x %lld positions is absurdly large (limit %lld)", spec,
                       factor, (long long)mt_cfg_rope_original_length(&c), (long long)MAX_SIZE);
    char name[128];
    snprintf(name, sizeof name, "--rope-scaling %s", spec);
    if (mt_cfg_validate_rope_scaling(&c, name, err, errlen)) return -1;
    *cfg = c;
    return 0;
}
