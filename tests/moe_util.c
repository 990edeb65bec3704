/* The mixture-of-experts suites' shared helpers (tests/moe_util.h). */
#include "tests/moe_util.h"

#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backends/cpu/ops.h"
#include "models/util.h"

/* Five-point central differences in double: truncation ~h^4, rounding ~1e-16 |L| / h, small
 * enough for the experts that few tokens reach, whose gradients are small against the loss. */
#define FD_STEP 1e-5
#define FD_TOL 1e-6 /* ||analytic - fd|| / ||fd|| per tensor */

double weighted_sum(const double *w, const double *y, int64_t n)
{
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += w[i] * y[i];
    return s;
}

/* The finite-difference gradient of f over x (n), perturbing x in place, against analytic.
 * A zero gradient must be exactly zero on both sides (an expert no token chose). */
void check_grad(const char *what, double (*f)(void *), void *ctx, double *x, int64_t n, const double *analytic)
{
    double *fd = mt_test_alloc_f64(n);
    for (int64_t i = 0; i < n; i++) {
        const double keep = x[i];
        double at[4];
        const double steps[4] = { -2, -1, 1, 2 };
        for (int j = 0; j < 4; j++) {
            x[i] = keep + steps[j] * FD_STEP;
            at[j] = f(ctx);
        }
        x[i] = keep;
        /* differences first: a parameter f does not read gives exactly 0 */
        fd[i] = (8 * (at[2] - at[1]) - (at[3] - at[0])) / (12 * FD_STEP);
    }
    double norm = 0, anorm = 0;
    for (int64_t i = 0; i < n; i++) {
        norm += fd[i] * fd[i];
        anorm += analytic[i] * analytic[i];
    }
    if (norm == 0) {
        fprintf(stderr, "  %-52s zero gradient, analytic norm %.3e\n", what, sqrt(anorm));
        ck_assert_msg(anorm == 0, "%s: finite differences are zero, the analytic gradient is not", what);
    } else {
        fprintf(stderr, "  %-52s |grad| %.3e\n", what, sqrt(norm));
        mt_test_report(what, mt_test_rel_err_f64(analytic, fd, n), FD_TOL);
    }
    free(fd);
}

/* Random tile: norm weights near 1, everything else N(0, scale). */
void fill_tile(mt_test_rng *rng, const mt_tile_layout *lay, double *tile, double scale)
{
    memset(tile, 0, (size_t)lay->numel * sizeof(double));
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        const bool is_norm = t->ndim == 1 && strstr(t->name, "norm") != NULL;
        mt_test_fill_f64(rng, tile + t->offset, t->numel, is_norm ? 0.2 : scale);
        if (is_norm)
            for (int64_t i = 0; i < t->numel; i++) tile[t->offset + i] += 1.0;
    }
}

/* Checks every present tensor of a tile against finite differences. */
void check_tile_grads(const char *what, double (*f)(void *), void *ctx, const mt_tile_layout *lay, double *tile,
                      const double *dtile)
{
    for (int s = 0; s < lay->ntensors; s++) {
        const mt_tensor_desc *t = &lay->tensors[s];
        if (t->numel == 0) continue;
        char label[128];
        snprintf(label, sizeof label, "%s %s", what, t->name);
        check_grad(label, f, ctx, tile + t->offset, t->numel, dtile + t->offset);
    }
}

mt_model_config parse_ok(const char *json, const char *name)
{
    mt_model_config cfg;
    char err[512] = "";
    ck_assert_msg(mt_config_parse(json, name, &cfg, err, sizeof err) == 0, "%s: %s", name, err);
    return cfg;
}

/* The message of a config that must be refused contains every one of the fragments. */
void parse_fails(const char *json, const char *name, const char *want1, const char *want2)
{
    mt_model_config cfg;
    char err[512] = "";
    ck_assert_msg(mt_config_parse(json, name, &cfg, err, sizeof err) != 0, "%s: accepted", name);
    fprintf(stderr, "  refused: %s\n", err);
    ck_assert_msg(strstr(err, name) && strstr(err, want1) && (!want2 || strstr(err, want2)),
                  "%s: message '%s' lacks '%s' / '%s'", name, err, want1, want2 ? want2 : "");
}



mt_model_config moe_config(const char *base, const char *extra)
{
    char json[2048];
    snprintf(json, sizeof json, "%s%s}", base, extra);
    return parse_ok(json, "test-config");
}

double topk_gap(const double *probs, int64_t n, int64_t E, int64_t k)
{
    if (k == E) return INFINITY;
    double gap = INFINITY;
    int32_t *sel = mt_xmalloc((size_t)(k + 1) * sizeof(int32_t));
    double *w = mt_test_alloc_f64(k + 1);
    for (int64_t r = 0; r < n; r++) {
        mt_cpu_router_topk_f64(1, E, k + 1, false, probs + r * E, sel, w);
        if (w[k - 1] - w[k] < gap) gap = w[k - 1] - w[k];
    }
    free(sel);
    free(w);
    return gap;
}
