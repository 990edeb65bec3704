/* Rotary inverse frequencies and the attention factor for a model config and the length run,
 * computed once per layer call in double: the same numbers feed the CPU kernels and the CUDA
 * tables. Each rope type follows its function in transformers' modeling_rope_utils.py (named
 * below), in double where transformers computes in fp32. */
#include <assert.h>
#include <math.h>

#include "backends/cpu/ops.h"

/* transformers' default frequencies: 1 / base^(2j/D). */
static double base_inv_freq(double base, int64_t j, int64_t D)
{
    return 1.0 / pow(base, (double)(2 * j) / (double)D);
}

/* _compute_llama3_parameters: wavelengths longer than the original context / low_freq_factor
 * are stretched by factor, shorter than context / high_freq_factor kept, the band between
 * interpolated. */
static void llama3(const mt_model_config *cfg, double *inv_freq)
{
    const int64_t D = cfg->head_dim;
    const double factor = cfg->rope_scaling_factor;
    const double low = cfg->rope_low_freq_factor, high = cfg->rope_high_freq_factor;
    const double orig = (double)cfg->rope_original_max_positions;
    const double low_freq_wavelen = orig / low, high_freq_wavelen = orig / high;
    for (int64_t j = 0; j < D / 2; j++) {
        const double f = base_inv_freq(cfg->rope_theta, j, D);
        const double wavelen = 2.0 * M_PI / f;
        if (wavelen < high_freq_wavelen) {
            inv_freq[j] = f;
        } else if (wavelen > low_freq_wavelen) {
            inv_freq[j] = f / factor;
        } else {
            const double smooth = (orig / wavelen - low) / (high - low);
            inv_freq[j] = (1.0 - smooth) * f / factor + smooth * f;
        }
    }
}

/* _compute_dynamic_ntk_parameters for seq_len = max(the length run, max_position_embeddings):
 * base * (factor * len / max_position_embeddings - (factor - 1))^(D / (D - 2)), so that the base
 * is the model's own up to max_position_embeddings and grows past it. transformers' rotary
 * module recomputes it for the longest length it has seen since the last shorter-than-original
 * one (dynamic_rope_update); here each call's length decides, which is the same for a run of
 * one length. */
static void dynamic(const mt_model_config *cfg, int64_t seq_len, double *inv_freq)
{
    const int64_t D = cfg->head_dim;
    const double max_pos = (double)cfg->max_positions;
    const double len = seq_len > cfg->max_positions ? (double)seq_len : max_pos;
    const double factor = cfg->rope_scaling_factor;
    const double base = cfg->rope_theta * pow(factor * len / max_pos - (factor - 1.0), (double)D / (double)(D - 2));
    for (int64_t j = 0; j < D / 2; j++) inv_freq[j] = base_inv_freq(base, j, D);
}

/* get_mscale of _compute_yarn_parameters: 0.1 mscale ln(scale) + 1, 1 for scale <= 1. */
static double yarn_mscale(double scale, double mscale)
{
    return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

/* find_correction_dim of _compute_yarn_parameters: the dim whose wavelength turns num_rotations
 * times over the original context. */
static double yarn_correction_dim(double num_rotations, int64_t D, double base, double orig)
{
    return (double)D * log(orig / (num_rotations * 2.0 * M_PI)) / (2.0 * log(base));
}

/* _compute_yarn_parameters: frequencies interpolated (/ factor) below the slow end of a linear
 * ramp over the dims, extrapolated (kept) above its fast end, blended between; returns the
 * attention factor that multiplies cos and sin. */
static double yarn(const mt_model_config *cfg, double *inv_freq)
{
    const int64_t D = cfg->head_dim;
    const double base = cfg->rope_theta, factor = cfg->rope_scaling_factor;
    const double orig = (double)cfg->rope_original_max_positions;
    double attention = cfg->rope_attention_factor;
    if (!(attention > 0))
        attention = cfg->rope_mscale != 0 && cfg->rope_mscale_all_dim != 0
                        ? yarn_mscale(factor, cfg->rope_mscale) / yarn_mscale(factor, cfg->rope_mscale_all_dim)
                        : yarn_mscale(factor, 1.0);
    /* find_correction_range: beta_fast turns give the low end, beta_slow the high one */
    double low = yarn_correction_dim(cfg->rope_beta_fast, D, base, orig);
    double high = yarn_correction_dim(cfg->rope_beta_slow, D, base, orig);
    if (cfg->rope_truncate) {
        low = floor(low);
        high = ceil(high);
    }
    if (low < 0) low = 0;
    if (high > (double)(D - 1)) high = (double)(D - 1);
    if (low == high) high += 0.001; /* linear_ramp_factor's guard against a zero-width ramp */
    for (int64_t j = 0; j < D / 2; j++) {
        double ramp = ((double)j - low) / (high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        const double extrapolation_factor = 1.0 - ramp;
        const double pos_freq = pow(base, (double)(2 * j) / (double)D);
        const double extrapolated = 1.0 / pos_freq, interpolated = 1.0 / (factor * pos_freq);
        inv_freq[j] = interpolated * (1.0 - extrapolation_factor) + extrapolated * extrapolation_factor;
    }
    return attention;
}

double mt_rope_inv_freq(const mt_model_config *cfg, int64_t seq_len, double *inv_freq)
{
    const int64_t D = cfg->head_dim;
    /* a config with a factor names its type (mt_config_validate) */
    assert(cfg->rope_type != MT_ROPE_DEFAULT || cfg->rope_scaling_factor == 0);
    switch (cfg->rope_type) {
    case MT_ROPE_DEFAULT:
        for (int64_t j = 0; j < D / 2; j++) inv_freq[j] = base_inv_freq(cfg->rope_theta, j, D);
        return 1.0;
    case MT_ROPE_LINEAR:
        /* _compute_linear_scaling_rope_parameters: positions / factor, i.e. frequencies / factor */
        for (int64_t j = 0; j < D / 2; j++) inv_freq[j] = base_inv_freq(cfg->rope_theta, j, D) / cfg->rope_scaling_factor;
        return 1.0;
    case MT_ROPE_DYNAMIC:
        dynamic(cfg, seq_len, inv_freq);
        return 1.0;
    case MT_ROPE_YARN:
        return yarn(cfg, inv_freq);
    case MT_ROPE_LLAMA3:
        llama3(cfg, inv_freq);
        return 1.0;
    }
    assert(!"unknown rope type");
    return 1.0;
}
