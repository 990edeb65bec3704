/* megatrain eval and generate (runtime/eval.h, runtime/generate.h) on a tiny random Llama-style
 * model saved as an HF directory with the SentencePiece-style tokenizer fixture, and a prepared
 * directory made with that tokenizer: eval's loss against a loss computed here from the fp32 CPU
 * forward and a cross entropy in double; generation against a plain argmax loop; the sampler's
 * greedy ties, nucleus and seeded draws; an end-of-sequence id; refusals of bad input. */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backends/cpu/ops.h"
#include "models/tokenizer.h"
#include "runtime/data.h"
#include "runtime/dataset.h"
#include "runtime/eval.h"
#include "runtime/generate.h"
#include "runtime/hf.h"
#include "runtime/prepare.h"
#include "runtime/runtime.h"
#include "runtime/step.h"
#include "tests/testutil.h"

#define SPM_TOKENIZER "tests/fixtures/tokenizers/spm/tokenizer.json"
#define OTHER_TOKENIZER "tests/fixtures/tokenizers/spm-metaspace/tokenizer.json"
#define SEQ_LEN 16

static char dir[256], model_dir[300], data_dir[300];
static mt_host_state *st;   /* the saved model's, while the runtime is up */
static mt_tokenizer *tok;

static void copy_file(const char *from, const char *to)
{
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    ck_assert_msg(in && out, "copy %s to %s", from, to);
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0) ck_assert(fwrite(buf, 1, n, out) == n);
    fclose(in);
    fclose(out);
}

/* A random model (seeded, weights N(0, 0.1^2) so that its distributions are far from uniform) in
 * dir/model with the tokenizer and a generation_config.json naming no end-of-sequence id, and
 * random-word text prepared into dir/data (30% of the paragraphs held out). Leaves the runtime
 * up with the model in st. */
static void fixture(void)
{
    snprintf(dir, sizeof dir, "/tmp/mt-eval.XXXXXX");
    ck_assert(mkdtemp(dir) != NULL);
    snprintf(model_dir, sizeof model_dir, "%s/model", dir);
    snprintf(data_dir, sizeof data_dir, "%s/data", dir);
    char err[1024];
    const char *tok_path = mt_test_source_path(SPM_TOKENIZER);
    tok = mt_tokenizer_load(tok_path, err, sizeof err);
    ck_assert_msg(tok, "%s", err);
    char config[1024];
    snprintf(config, sizeof config,
             "{\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 128, \"num_hidden_layers\": 2,"
             " \"num_attention_heads\": 2, \"num_key_value_heads\": 1, \"head_dim\": 32, \"vocab_size\": %d,"
             " \"max_position_embeddings\": 64, \"tie_word_embeddings\": false, \"rms_norm_eps\": 1e-6}",
             mt_tokenizer_vocab_size(tok));
    mt_model_config cfg;
    ck_assert_msg(mt_config_parse(config, "tiny-llama", &cfg, err, sizeof err) == 0, "%s", err);
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(st, "%s", err);
    mt_state_init_random(st, 2026, 0.1);
    ck_assert_msg(mt_hf_save(model_dir, st, MT_DTYPE_F32, 0, err, sizeof err) == 0, "%s", err);
    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", model_dir);
    copy_file(tok_path, path);

    static const char *const words[] = { "the", "cat", "sat", "on", "a", "mat", "while", "rain", "fell", "over",
                                         "quiet", "hills", "and", "rivers", "ran", "to", "sea", "under", "stars" };
    snprintf(path, sizeof path, "%s/text.txt", dir);
    FILE *f = fopen(path, "w");
    mt_test_rng r;
    mt_test_rng_seed(&r, 99);
    for (int p = 0; p < 30; p++) {
        for (int w = 0; w < 40; w++) fprintf(f, "%s%s", w ? " " : "", words[(int)(mt_test_uniform(&r) * 19)]);
        fprintf(f, ".\n\n");
    }
    fclose(f);
    mt_prepare_options po = mt_prepare_defaults();
    po.tokenizer_path = tok_path;
    po.input_path = path;
    po.output_dir = data_dir;
    po.format = MT_INPUT_TEXT;
    po.family = MT_CHAT_MISTRAL;
    po.seq_len = SEQ_LEN;
    po.val_fraction = 0.3;
    mt_prepare_result pr;
    ck_assert_msg(mt_prepare(&po, &pr, NULL, err, sizeof err) == 0, "%s", err);
}

/* Removes fixture's directory. */
static void remove_fixture(void)
{
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    ck_assert(system(cmd) == 0);
}

/* Ends what fixture started (the model stays on disk for the runs that load it). */
static void stop_runtime(void)
{
    mt_state_destroy(st);
    st = NULL;
    mt_runtime_shutdown();
}

/* logits (T, V) of one sequence through mt_host_hidden and the head of an fp32 state s; caller
 * frees. */
static float *logits_of_state(mt_host_state *s, const int32_t *ids, int64_t T)
{
    const mt_model_config *cfg = &s->cfg;
    const int64_t d = cfg->hidden, V = cfg->vocab;
    float *x = malloc(sizeof *x * T * d), *y = malloc(sizeof *y * T * d);
    float *scratch = malloc(sizeof(float) * mt_layer_scratch_numel(cfg, 1, T));
    float *hscratch = malloc(sizeof(float) * mt_head_scratch_numel(cfg, T));
    float *logits = malloc(sizeof *logits * T * V);
    const float *h = mt_host_hidden(s, 1, T, ids, x, y, scratch);
    mt_cpu_head_logits_f32(cfg, &s->layout_head, mt_state_head(s)->master,
                           cfg->tied ? mt_state_embed(s)->master : NULL, T, h, logits, hscratch);
    free(x); free(y); free(scratch); free(hscratch);
    return logits;
}

/* logits (T, V) of one sequence of the fixture's model; caller frees. */
static float *logits_of(const int32_t *ids, int64_t T) { return logits_of_state(st, ids, T); }

/* -log softmax(row)[target] in double. */
static double nll(const float *row, int64_t V, int32_t target)
{
    double mx = row[0], z = 0;
    for (int64_t v = 1; v < V; v++) mx = fmax(mx, row[v]);
    for (int64_t v = 0; v < V; v++) z += exp((double)row[v] - mx);
    return mx + log(z) - row[target];
}

/* The cross entropy of the first n validation windows (all: n < 0), in double; *count the targets. */
static double reference_loss(int64_t n, int64_t *count, int64_t *windows)
{
    mt_dataset ds;
    char err[1024];
    ck_assert_msg(mt_dataset_open(data_dir, &ds, err, sizeof err) == 0, "%s", err);
    if (n < 0 || n > ds.val.n_seq) n = ds.val.n_seq;
    *windows = n;
    const int64_t V = st->cfg.vocab;
    int32_t tokens[SEQ_LEN], targets[SEQ_LEN];
    double sum = 0;
    *count = 0;
    for (int64_t w = 0; w < n; w++) {
        mt_dataset_window(&ds, &ds.val, w, tokens, targets);
        float *logits = logits_of(tokens, SEQ_LEN);
        for (int64_t t = 0; t < SEQ_LEN; t++) {
            if (targets[t] < 0) continue;
            sum += nll(logits + t * V, V, targets[t]);
            (*count)++;
        }
        free(logits);
    }
    mt_dataset_close(&ds);
    return sum / (double)*count;
}

static mt_eval_options eval_options(void)
{
    mt_eval_options o = mt_eval_defaults();
    o.model_dir = model_dir;
    o.data_path = data_dir;
    o.B = 4;
    o.runtime.sched = "eager";
    o.runtime.ncpu = 2;
    o.runtime.ncuda = 0;
    return o;
}

/* Every validation window (their count not a multiple of B: the padding counts nothing), and
 * the first two: the loss within 1e-5 of the reference, the same targets, perplexity exp(loss). */
START_TEST(test_eval_loss)
{
    fixture();
    int64_t count_all, count_two, windows_all, windows_two;
    const double ref_all = reference_loss(-1, &count_all, &windows_all);
    const double ref_two = reference_loss(2, &count_two, &windows_two);
    ck_assert_msg(windows_all > 4 && windows_all % 4 != 0, "%lld validation windows: the test needs more, not a "
                  "multiple of 4", (long long)windows_all);
    stop_runtime();
    char err[1024];
    mt_eval_options o = eval_options();
    mt_eval_result r;
    ck_assert_msg(mt_eval_run(&o, &r, NULL, err, sizeof err) == 0, "%s", err);
    printf("eval: loss %.9f (reference %.9f), %lld tokens in %lld windows\n", r.loss, ref_all, (long long)r.tokens,
           (long long)r.sequences);
    ck_assert_int_eq(r.tokens, count_all);
    ck_assert_int_eq(r.sequences, windows_all);
    ck_assert_int_eq(r.T, SEQ_LEN);
    mt_test_report("eval loss, every window", fabs(r.loss - ref_all) / ref_all, 1e-5);
    mt_test_report("perplexity = exp(loss)", fabs(r.perplexity - exp(r.loss)) / r.perplexity, 1e-12);
    o.max_sequences = 2;
    ck_assert_msg(mt_eval_run(&o, &r, NULL, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(r.tokens, count_two);
    ck_assert_int_eq(r.sequences, 2);
    mt_test_report("eval loss, --max-sequences 2", fabs(r.loss - ref_two) / ref_two, 1e-5);
    remove_fixture();
}
END_TEST

/* A byte-level model on a text file: the validation blocks' first windows, as train reads them. */
START_TEST(test_eval_text)
{
    fixture();
    stop_runtime();
    char err[1024];
    mt_model_config cfg;
    ck_assert_msg(mt_config_load(mt_test_source_path("models/configs/tiny-byte.json"), &cfg, err, sizeof err) == 0,
                  "%s", err);
    mt_runtime_options ro = { .sched = "eager", .ncpu = 2, .ncuda = 0 };
    ck_assert_msg(mt_runtime_init(&ro, err, sizeof err) == 0, "%s", err);
    st = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(st, "%s", err);
    mt_state_init_random(st, 31, 0.1);
    char bytes_model[512], text[512];
    snprintf(bytes_model, sizeof bytes_model, "%s/bytes-model", dir);
    snprintf(text, sizeof text, "%s/bytes.txt", dir);
    FILE *f = fopen(text, "w");
    mt_test_rng r0;
    mt_test_rng_seed(&r0, 12);
    for (int i = 0; i < 60000; i++) fputc("etaoin shrdlu\n"[(int)(mt_test_uniform(&r0) * 14)], f);
    fclose(f);
    ck_assert_msg(mt_hf_save(bytes_model, st, MT_DTYPE_F32, 0, err, sizeof err) == 0, "%s", err);
    enum { T = 32, N = 8 };
    mt_corpus c;
    ck_assert_msg(mt_corpus_load(text, 10, T + 1, &c, err, sizeof err) == 0, "%s", err);
    int32_t tokens[N * T], targets[N * T];
    ck_assert_int_eq(mt_corpus_validation(&c, N, T, tokens, targets), N);
    double sum = 0;
    for (int w = 0; w < N; w++) {
        float *logits = logits_of(tokens + w * T, T);
        for (int t = 0; t < T; t++) {
            sum += nll(logits + t * cfg.vocab, cfg.vocab, targets[w * T + t]);
        }
        free(logits);
    }
    const double ref = sum / (N * T);
    mt_corpus_free(&c);
    stop_runtime();
    mt_eval_options o = eval_options();
    o.model_dir = bytes_model;
    o.data_path = text;
    o.T = T;
    o.max_sequences = N;
    mt_eval_result r;
    ck_assert_msg(mt_eval_run(&o, &r, NULL, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(r.tokens, N * T);
    mt_test_report("eval loss, text read as bytes", fabs(r.loss - ref) / ref, 1e-5);
    /* The same text for the tokenizer's model: refused, with the prepare command. */
    o.model_dir = model_dir;
    ck_assert_int_eq(mt_eval_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "not a byte-level model") && strstr(err, "megatrain prepare"), "%s", err);
    remove_fixture();
}
END_TEST

/* Bad input is refused naming the file: a missing model, a model whose tokenizer is not the
 * data's (accepted with allow_other_tokenizer), data without validation windows, a --seq-len
 * that is not the data's. */
START_TEST(test_eval_refusals)
{
    fixture();
    stop_runtime();
    char err[2048];
    mt_eval_result r;
    mt_eval_options o = eval_options();
    o.model_dir = "/nonexistent/model";
    ck_assert_int_eq(mt_eval_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "/nonexistent/model/config.json"), "%s", err);

    o = eval_options();
    o.data_path = "/nonexistent/data";
    ck_assert_int_eq(mt_eval_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "/nonexistent/data"), "%s", err);

    o = eval_options();
    o.T = SEQ_LEN * 2;
    ck_assert_int_eq(mt_eval_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "seq_len 16") && strstr(err, "--seq-len 32"), "%s", err);

    char path[512];
    snprintf(path, sizeof path, "%s/tokenizer.json", model_dir);
    copy_file(mt_test_source_path(OTHER_TOKENIZER), path);
    o = eval_options();
    ck_assert_int_eq(mt_eval_run(&o, &r, NULL, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "was prepared with the tokenizer") && strstr(err, path), "%s", err);
    o.allow_other_tokenizer = true;
    ck_assert_msg(mt_eval_run(&o, &r, NULL, err, sizeof err) == 0, "%s", err);
    ck_assert(isfinite(r.loss) && r.tokens > 0);
    remove_fixture();
}
END_TEST

/* The argmax of each row, the lowest id among equal maxima. */
static int32_t argmax(const float *row, int64_t V)
{
    int32_t best = 0;
    for (int64_t v = 1; v < V; v++)
        if (row[v] > row[best]) best = (int32_t)v;
    return best;
}

static int64_t generate(const int32_t *prompt, int64_t n_prompt, const mt_generate_args *a, int32_t *out, bool *eos)
{
    char err[512];
    const int64_t n = mt_generate_ids(st, prompt, n_prompt, a, out, eos, err, sizeof err);
    ck_assert_msg(n >= 0, "%s", err);
    return n;
}

#define NEW 10

/* Greedy generation is the argmax loop over the whole sequence; a nucleus of almost nothing is
 * greedy at any temperature; draws at a temperature repeat with their seed and differ across
 * seeds; an end-of-sequence id stops the text before it. */
START_TEST(test_generate_ids)
{
    fixture();
    char err[512];
    size_t np;
    int32_t *prompt = mt_tokenizer_encode(tok, "the cat sat on", 14, &np, err, sizeof err);
    ck_assert_msg(prompt && np > 1, "%s", err);
    const int64_t V = st->cfg.vocab;
    int32_t seq[64];
    memcpy(seq, prompt, np * sizeof *seq);
    int32_t want[NEW];
    for (int k = 0; k < NEW; k++) {
        float *logits = logits_of(seq, (int64_t)np + k);
        want[k] = seq[np + k] = argmax(logits + ((int64_t)np + k - 1) * V, V);
        free(logits);
    }
    int32_t got[NEW];
    bool eos;
    mt_generate_args a = { .max_new = NEW, .sampling = { .temperature = 0, .top_p = 1 } };
    ck_assert_int_eq(generate(prompt, (int64_t)np, &a, got, &eos), NEW);
    ck_assert(!eos);
    for (int k = 0; k < NEW; k++) ck_assert_msg(got[k] == want[k], "token %d: %d, the argmax loop %d", k, got[k], want[k]);

    a.sampling = (mt_sampling){ .temperature = 1.5, .top_p = 1e-9 };
    a.seed = 5;
    ck_assert_int_eq(generate(prompt, (int64_t)np, &a, got, &eos), NEW);
    for (int k = 0; k < NEW; k++) ck_assert_msg(got[k] == want[k], "top-p 1e-9, token %d: %d, greedy %d", k, got[k], want[k]);

    int32_t first[NEW], again[NEW], other[NEW];
    a.sampling = (mt_sampling){ .temperature = 1.0, .top_p = 0.95 };
    generate(prompt, (int64_t)np, &a, first, &eos);
    generate(prompt, (int64_t)np, &a, again, &eos);
    ck_assert_msg(memcmp(first, again, sizeof first) == 0, "the same seed drew other tokens");
    a.seed = 6;
    generate(prompt, (int64_t)np, &a, other, &eos);
    ck_assert_msg(memcmp(first, other, sizeof first) != 0, "seeds 5 and 6 drew the same %d tokens", NEW);

    /* The first greedy token that did not come before it: the text stops just before it. */
    int stop = 1;
    for (bool earlier = true; stop < NEW; stop++) {
        earlier = false;
        for (int k = 0; k < stop; k++) earlier |= want[k] == want[stop];
        if (!earlier) break;
    }
    ck_assert_msg(stop < NEW, "greedy repeats one token: the test needs another");
    a = (mt_generate_args){ .max_new = NEW, .sampling = { .temperature = 0, .top_p = 1 }, .eos = &want[stop], .neos = 1 };
    ck_assert_int_eq(generate(prompt, (int64_t)np, &a, got, &eos), stop);
    ck_assert(eos);
    for (int k = 0; k < stop; k++) ck_assert_int_eq(got[k], want[k]);
    free(prompt);
    remove_fixture();
}
END_TEST

/* max |got - want| over max |want| of n values. */
static double max_rel(const float *got, const float *want, int64_t n)
{
    double diff = 0, scale = 0;
    for (int64_t k = 0; k < n; k++) {
        diff = fmax(diff, fabs((double)got[k] - want[k]));
        scale = fmax(scale, fabs((double)want[k]));
    }
    return diff / scale;
}

/* A forward-only graph of B sequences of T tokens on the runtime's workers. */
static mt_graph *logits_graph(mt_host_state *s, int64_t B, int64_t T)
{
    mt_step_config sc = mt_step_defaults();
    sc.B = B;
    sc.T = T;
    sc.K = 1;
    sc.clip = 0;
    sc.head_chunk = 1;
    char err[1024];
    mt_graph *g = mt_graph_create(s, &sc, err, sizeof err);
    ck_assert_msg(g, "%s", err);
    return g;
}

/* Random ids (n) of a vocabulary of V. */
static void random_ids(mt_test_rng *r, int32_t *ids, int64_t n, int64_t V)
{
    for (int64_t k = 0; k < n; k++) ids[k] = (int32_t)(mt_test_uniform(r) * (double)V);
}

/* The graph's logits of one position per sequence against the host forward over that
 * sequence's prefix alone (so the tokens after the position, different in each sequence, change
 * nothing): fp32 within 1e-5 relative to the largest logit, for the untied fixture (two sequences,
 * the second one's rows offset by T) and a tied model; bf16 weights on the CPU workers within 2e-2
 * of the fp32 host forward (bf16 keeps 8 bits of mantissa). */
START_TEST(test_graph_logits)
{
    fixture();
    char err[1024];
    const int64_t V = st->cfg.vocab, T = 32;
    mt_test_rng r;
    mt_test_rng_seed(&r, 4711);
    int32_t tokens[2 * 32];
    random_ids(&r, tokens, 2 * T, V);
    float *logits = malloc(sizeof *logits * 2 * V);
    mt_graph *g = logits_graph(st, 2, T);
    const int32_t picks[3][2] = { { 31, 9 }, { 0, 31 }, { 17, 3 } };
    for (int k = 0; k < 3; k++) {
        mt_graph_logits(g, tokens, picks[k], logits);
        for (int b = 0; b < 2; b++) {
            float *want = logits_of(tokens + b * T, picks[k][b] + 1);
            char what[128];
            snprintf(what, sizeof what, "graph logits, fp32, sequence %d position %d", b, picks[k][b]);
            mt_test_report(what, max_rel(logits + b * V, want + picks[k][b] * V, V), 1e-5);
            free(want);
        }
    }
    mt_graph_destroy(g);

    mt_model_config cfg = st->cfg;
    cfg.tied = true;
    mt_host_state *tied = mt_state_create(&cfg, MT_DTYPE_F32, 0, err, sizeof err);
    ck_assert_msg(tied, "%s", err);
    mt_state_init_random(tied, 99, 0.1);
    mt_host_state *tied_bf16 = mt_state_create(&cfg, MT_DTYPE_BF16, 0, err, sizeof err);
    ck_assert_msg(tied_bf16, "%s", err);
    mt_state_init_random(tied_bf16, 99, 0.1);
    const int32_t last = 20;
    float *want = logits_of_state(tied, tokens, last + 1);
    g = logits_graph(tied, 1, T);
    mt_graph_logits(g, tokens, &last, logits);
    mt_graph_destroy(g);
    mt_test_report("graph logits, tied, fp32", max_rel(logits, want + last * V, V), 1e-5);
    g = logits_graph(tied_bf16, 1, T);
    mt_graph_logits(g, tokens, &last, logits);
    mt_graph_destroy(g);
    mt_test_report("graph logits, tied, bf16 weights", max_rel(logits, want + last * V, V), 2e-2);
    free(want);
    mt_state_destroy(tied);
    mt_state_destroy(tied_bf16);
    free(logits);
    remove_fixture();
}
END_TEST

/* Greedy generation through the graph on the CPU workers gives the host forward's tokens, one for
 * one, over a context that outgrows the first graph (32 tokens) and ends at the longest sequence
 * the call reaches. */
START_TEST(test_generate_graph)
{
    fixture();
    char err[512];
    size_t np;
    int32_t *prompt = mt_tokenizer_encode(tok, "the cat sat on", 14, &np, err, sizeof err);
    ck_assert_msg(prompt && np > 1, "%s", err);
    enum { LONG = 40 };
    ck_assert((int64_t)np < MT_GENERATE_MIN_BUCKET && (int64_t)np + LONG > MT_GENERATE_MIN_BUCKET);
    int32_t want[LONG], got[LONG];
    bool eos_want, eos_got;
    mt_generate_args a = { .max_new = LONG, .sampling = { .temperature = 0, .top_p = 1 } };
    const int64_t n_want = generate(prompt, (int64_t)np, &a, want, &eos_want);
    const int64_t n_got = mt_generate_ids_graph(st, prompt, (int64_t)np, &a, got, &eos_got, err, sizeof err);
    ck_assert_msg(n_got >= 0, "%s", err);
    ck_assert_int_eq(n_want, LONG);
    ck_assert_int_eq(n_got, n_want);
    ck_assert(!eos_want && !eos_got);
    for (int k = 0; k < LONG; k++)
        ck_assert_msg(got[k] == want[k], "token %d: the graph's %d, the host forward's %d", k, got[k], want[k]);
    free(prompt);
    remove_fixture();
}
END_TEST

/* The graph lengths: powers of two from 32 up to the generation's longest sequence; with a
 * dynamic-NTK rope none beyond max_position_embeddings unless the context is. */
START_TEST(test_generate_bucket)
{
    mt_model_config cfg = { .max_positions = 64, .rope_type = MT_ROPE_DEFAULT };
    ck_assert_int_eq(mt_generate_bucket(&cfg, 5, 100), 32);
    ck_assert_int_eq(mt_generate_bucket(&cfg, 32, 100), 32);
    ck_assert_int_eq(mt_generate_bucket(&cfg, 33, 100), 64);
    ck_assert_int_eq(mt_generate_bucket(&cfg, 65, 100), 100);
    ck_assert_int_eq(mt_generate_bucket(&cfg, 5, 10), 10);
    cfg.rope_type = MT_ROPE_DYNAMIC;
    ck_assert_int_eq(mt_generate_bucket(&cfg, 10, 200), 32);
    ck_assert_int_eq(mt_generate_bucket(&cfg, 40, 200), 64);
    ck_assert_int_eq(mt_generate_bucket(&cfg, 70, 200), 70);
}
END_TEST

/* The sampler alone: ties go to the lowest id; with probabilities 0.5, 0.3, 0.2 and top-p 0.7
 * only the first two are drawn, as 5:3 (within 0.015 over 40000 draws). */
START_TEST(test_sampler)
{
    mt_sampler s;
    ck_assert(mt_sampler_init(&s, 4) == 0);
    mt_rng rng;
    mt_rng_seed(&rng, 3);
    const float tied[4] = { 0.25f, 1.5f, 1.5f, -2.0f };
    const mt_sampling greedy = { .temperature = 0, .top_p = 1 };
    ck_assert_int_eq(mt_sample(&s, tied, &greedy, &rng), 1);
    const float logits[4] = { (float)log(0.5), (float)log(0.3), (float)log(0.2), -INFINITY };
    const mt_sampling nucleus = { .temperature = 1, .top_p = 0.7 };
    int64_t seen[4] = { 0 };
    const int64_t draws = 40000;
    for (int64_t k = 0; k < draws; k++) seen[mt_sample(&s, logits, &nucleus, &rng)]++;
    ck_assert_int_eq(seen[2] + seen[3], 0);
    mt_test_report("nucleus share of id 0 (want 0.625)", fabs((double)seen[0] / draws - 0.625), 0.015);
    /* Without a nucleus all three come, as 5:3:2. */
    const mt_sampling all = { .temperature = 1, .top_p = 1 };
    memset(seen, 0, sizeof seen);
    for (int64_t k = 0; k < draws; k++) seen[mt_sample(&s, logits, &all, &rng)]++;
    ck_assert_int_eq(seen[3], 0);
    mt_test_report("share of id 2 (want 0.2)", fabs((double)seen[2] / draws - 0.2), 0.015);
    mt_sampler_free(&s);
}
END_TEST

/* The command's options for the fixture's model on two CPU workers (fp32: the host forward's
 * tokens). */
static mt_generate_options generate_options(void)
{
    mt_generate_options o = mt_generate_defaults();
    o.model_dir = model_dir;
    o.runtime.sched = "eager";
    o.runtime.ncpu = 2;
    o.runtime.ncuda = 0;
    return o;
}

/* The whole command's job: the text printed is the decoding of the greedy ids; an empty prompt,
 * a missing model and a tokenizer with more ids than the model are refused before any work. */
START_TEST(test_generate_run)
{
    fixture();
    char err[2048];
    const char *text = "rain fell over";
    size_t np;
    int32_t *prompt = mt_tokenizer_encode(tok, text, strlen(text), &np, err, sizeof err);
    ck_assert(prompt);
    int32_t ids[64];
    bool eos;
    mt_generate_args a = { .max_new = 6, .sampling = { .temperature = 0, .top_p = 1 } };
    const int64_t n = generate(prompt, (int64_t)np, &a, ids + np, &eos);
    memcpy(ids, prompt, np * sizeof *ids);
    size_t all_len, prompt_len;
    char *all = mt_tokenizer_decode(tok, ids, np + (size_t)n, &all_len, err, sizeof err);
    char *head = mt_tokenizer_decode(tok, ids, np, &prompt_len, err, sizeof err);
    stop_runtime();

    mt_generate_options o = generate_options();
    o.prompt = text;
    o.max_new_tokens = 6;
    char *printed;
    size_t printed_len;
    FILE *out = open_memstream(&printed, &printed_len);
    mt_generate_result r;
    ck_assert_msg(mt_generate_run(&o, out, &r, err, sizeof err) == 0, "%s", err);
    fclose(out);
    printf("generate: \"%s\" + \"%s\"\n", text, printed);
    ck_assert_int_eq(r.prompt_tokens, (int64_t)np);
    ck_assert_int_eq(r.new_tokens, n);
    ck_assert_uint_eq(printed_len, all_len - prompt_len);
    ck_assert_msg(memcmp(printed, all + prompt_len, printed_len) == 0, "printed \"%s\", decoded \"%s\"", printed,
                  all + prompt_len);
    free(printed); free(all); free(head); free(prompt);

    /* --chat: the prompt is the template's user turn, the assistant's opened. */
    const char *rendered = "<s> [INST] rain fell over [/INST]";
    size_t nchat;
    int32_t *chat_ids = mt_tokenizer_encode(tok, rendered, strlen(rendered), &nchat, err, sizeof err);
    ck_assert(chat_ids && chat_ids[0] == mt_tokenizer_token_id(tok, "<s>"));
    o.chat = true;
    o.family = "mistral";
    o.max_new_tokens = 2;
    ck_assert_msg(mt_generate_run(&o, NULL, &r, err, sizeof err) == 0, "%s", err);
    ck_assert_int_eq(r.prompt_tokens, (int64_t)nchat);
    free(chat_ids);
    o.chat = false;
    o.family = NULL;

    o.prompt = "";
    ck_assert_int_eq(mt_generate_run(&o, NULL, &r, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "--prompt") && strstr(err, "empty"), "%s", err);
    o.prompt = text;
    o.model_dir = "/nonexistent/model";
    ck_assert_int_eq(mt_generate_run(&o, NULL, &r, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "/nonexistent/model/config.json"), "%s", err);
    o.model_dir = model_dir;
    o.tokenizer_path = mt_test_source_path("tests/fixtures/tokenizers/qwen3/tokenizer.json");
    ck_assert_int_eq(mt_generate_run(&o, NULL, &r, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "vocab_size") && strstr(err, "qwen3/tokenizer.json"), "%s", err);
    o.tokenizer_path = NULL;
    o.chat = true;
    o.family = "nonesuch";
    ck_assert_int_eq(mt_generate_run(&o, NULL, &r, err, sizeof err), -1);
    ck_assert_msg(strstr(err, "--family") && strstr(err, "nonesuch"), "%s", err);
    remove_fixture();
}
END_TEST

/* An end-of-sequence id from generation_config.json ends the command's text. */
START_TEST(test_generate_eos_file)
{
    fixture();
    char err[1024];
    const char *text = "the quiet hills";
    size_t np;
    int32_t *prompt = mt_tokenizer_encode(tok, text, strlen(text), &np, err, sizeof err);
    int32_t ids[8];
    bool eos;
    mt_generate_args a = { .max_new = 1, .sampling = { .temperature = 0, .top_p = 1 } };
    ck_assert_int_eq(generate(prompt, (int64_t)np, &a, ids, &eos), 1);
    stop_runtime();
    char path[512];
    snprintf(path, sizeof path, "%s/generation_config.json", model_dir);
    FILE *f = fopen(path, "w");
    fprintf(f, "{\"eos_token_id\": [%d, %d]}\n", ids[0] == 0 ? 1 : 0, ids[0]);
    fclose(f);
    mt_generate_options o = generate_options();
    o.prompt = text;
    o.max_new_tokens = 5;
    mt_generate_result r;
    ck_assert_msg(mt_generate_run(&o, NULL, &r, err, sizeof err) == 0, "%s", err);
    ck_assert(r.eos);
    ck_assert_int_eq(r.new_tokens, 0);
    free(prompt);
    remove_fixture();
}
END_TEST

int main(void)
{
    Suite *s = suite_create("eval");
    TCase *tc = tcase_create("eval");
    tcase_set_timeout(tc, 600);
    tcase_add_test(tc, test_eval_loss);
    tcase_add_test(tc, test_eval_refusals);
    tcase_add_test(tc, test_eval_text);
    tcase_add_test(tc, test_sampler);
    tcase_add_test(tc, test_generate_ids);
    tcase_add_test(tc, test_graph_logits);
    tcase_add_test(tc, test_generate_graph);
    tcase_add_test(tc, test_generate_bucket);
    tcase_add_test(tc, test_generate_run);
    tcase_add_test(tc, test_generate_eos_file);
    suite_add_tcase(s, tc);
    return mt_test_run(s, false);
}
