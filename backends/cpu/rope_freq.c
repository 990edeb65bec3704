/* Rotary inverse frequencies for a model config: theta^(-2j/D), optionally rescaled the way
 * Llama 3.x does (HF transformers' _compute_llama3_parameters). Computed once, in double. */
#include <math.h>

#include "backends/cpu/ops.h"

/* inv_freq (D/2), D = cfg->head_dim. */
void mt_rope_inv_freq(const mt_model_config *cfg, double *inv_freq)
{
    const int64_t D = cfg->head_dim;
    for (int64_t j = 0; j < D / 2; j++)
        inv_freq[j] = 1.0 / pow(cfg->rope_theta, (double)(2 * j) / (double)D);
    if (!(cfg->rope_scaling_factor > 0)) return;

    /* Llama 3: wavelengths longer than the original context / low_freq_factor are stretched by
     * factor, shorter than context / high_freq_factor kept, and the band between interpolated. */
    const double factor = cfg->rope_scaling_factor;
    const double low = cfg->rope_low_freq_factor, high = cfg->rope_high_freq_factor;
    const double orig = (double)cfg->rope_original_max_positions;
    const double low_freq_wavelen = orig / low, high_freq_wavelen = orig / high;
    for (int64_t j = 0; j < D / 2; j++) {
        const double f = inv_freq[j];
        const double wavelen = 2.0 * M_PI / f;
        if (wavelen < high_freq_wavelen) continue;
        if (wavelen > low_freq_wavelen) {
            inv_freq[j] = f / factor;
        } else {
            const double smooth = (orig / wavelen - low) / (high - low);
            inv_freq[j] = (1.0 - smooth) * f / factor + smooth * f;
        }
    }
}
