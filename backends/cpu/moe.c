/* The type-free parts of the mixture-of-experts ops: grouping the assignments by expert, and the
 * value and gradient scale of the router's load-balancing loss (docs/moe.md). The float and
 * double bodies are in moe.inc. */
#include "backends/cpu/ops.h"

#include <assert.h>

void mt_moe_group(int64_t n, int64_t E, int64_t k, const int32_t *experts, int32_t *offsets, int32_t *order)
{
    assert(n * k < INT32_MAX);
    for (int64_t e = 0; e <= E; e++) offsets[e] = 0;
    for (int64_t a = 0; a < n * k; a++) {
        assert(experts[a] >= 0 && experts[a] < E);
        offsets[experts[a] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    /* Assignments in ascending order land in ascending order within each bucket: a token's k
     * experts are distinct, so each bucket lists its tokens ascending. offsets[e] walks bucket e
     * and ends at the start of e + 1; shifting back restores the starts. */
    for (int64_t a = 0; a < n * k; a++) order[offsets[experts[a]]++] = (int32_t)a;
    for (int64_t e = E; e > 0; e--) offsets[e] = offsets[e - 1];
    offsets[0] = 0;
}

double mt_moe_aux_loss(int64_t E, int64_t rows, const double *stats)
{
    if (rows <= 0) return 0.0;
    double sum = 0;
    for (int64_t e = 0; e < E; e++) sum += (stats[e] / (double)rows) * (stats[E + e] / (double)rows);
    return sum * (double)E;
}

double mt_moe_aux_grad_scale(int64_t E, int64_t rows, double coef, double weight)
{
    if (rows <= 0) return 0.0;
    return weight * coef * (double)E / ((double)rows * (double)rows);
}
