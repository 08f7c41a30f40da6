/* A command-line driver of the torch engine's CPU kernels (stoa/backends/torch/kernels), for running
 * them where there is no Python: tests/test_kernels_arm.py cross-compiles it with the kernels for
 * 64-bit ARM and runs it under qemu-aarch64.
 *
 *   kernel_driver CASE_DIR...
 *
 * Each CASE_DIR holds args.txt (an operation's name, then its integer and float arguments; floats may
 * be C99 hex floats, read exactly) and the operation's inputs as raw little-endian arrays; the driver
 * writes its outputs there (out_*.bin) and the kernel's return codes to rc.txt. Operations:
 *
 *   info                                      rc.txt: vector width, has_int, stoa_qmatmul_int's rc
 *   qmatmul digits n K m threads outs[m]      x.bin, c<i>/s<i>/b<i>.bin -> out_y.bin
 *   attn n nkv rep d cap slots scale window threads
 *                                             q, kc, vc, rows, pos .bin -> out_o.bin
 *   sample n V ld inv_temp threads            logits, lo, hi .bin -> out_tok.bin, out_lp.bin
 *   noise count                               codes.bin -> out_noise.bin, out_table.bin
 *   step nl n hidden nq nkv d cap rope_len ntab eps scale digits threads slots, then per layer:
 *        window rope has_qk_norm, and per matrix (qkv, o, gu, down): m has_bias outs[m]
 *                                             x, rows, pos, cos<t>, sin<t>, kc<l>, vc<l>,
 *                                             L<l>_<mat>_c/s/b<j>.bin, L<l>_<mat>_bias.bin,
 *                                             L<l>_norm_in/norm_post/q_norm/k_norm.bin
 *                                             -> out_x.bin, out_kc<l>.bin, out_vc<l>.bin
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int stoa_qmatmul(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                 const float *const *scales, const float *const *biases, const int64_t *outs,
                 float *y, int64_t ldy, int threads);
int stoa_qmatmul_int(const float *x, int64_t n, int64_t K, int m, const uint8_t *const *codes,
                     const float *const *scales, const float *const *biases, const int64_t *outs,
                     float *y, int64_t ldy, int threads, int digits);
int stoa_qmatmul_width(void);
int stoa_qmatmul_has_int(void);
int stoa_attn_decode(const float *q, const float *kc, const float *vc, const int64_t *rows, const int64_t *pos,
                     int64_t n, int nkv, int rep, int d, int64_t cap, float scale, int64_t window, float *out,
                     int threads);
int stoa_sample(const float *logits, int64_t n, int64_t V, int64_t ld, const uint32_t *lo, const uint32_t *hi,
                float inv_temp, int64_t *tok, float *lp, int threads);
int stoa_sample_noise(const uint32_t *codes, int64_t n, float *out);
int stoa_sample_table(uint32_t *out, int cap);

/* step.c's structs (as stoa.backends.torch.cstep declares them too) */
typedef struct {
    int64_t m, K, N;
    const uint8_t *const *codes;
    const float *const *scales;
    const float *const *biases;
    const int64_t *outs;
    const float *bias;
} stoa_mat;

typedef struct {
    stoa_mat qkv, o, gate_up, down;
    const float *norm_in, *norm_post;
    const float *q_norm, *k_norm;
    int64_t window;
    int64_t rope;
} stoa_layer;

int stoa_decode_layers(const stoa_layer *L, int nl, float *x, int64_t n, const int64_t *rows, const int64_t *pos,
                       int64_t hidden, int nq, int nkv, int d, int64_t cap, float *const *kcs, float *const *vcs,
                       const float *const *cos, const float *const *sin, int64_t rope_len, float eps, float scale,
                       int digits, int threads);

static const char *dir;
static FILE *args;

static void die(const char *what, const char *name) {
    fprintf(stderr, "kernel_driver: %s: %s/%s\n", what, dir, name);
    exit(2);
}

static int64_t arg_i(void) {
    long long v;
    if (fscanf(args, "%lld", &v) != 1) die("bad integer argument", "args.txt");
    return (int64_t)v;
}

static float arg_f(void) { /* a float32 argument, as ctypes.c_float rounds a Python float */
    double v;
    if (fscanf(args, "%lf", &v) != 1) die("bad float argument", "args.txt");
    return (float)v;
}

/* The whole file dir/name; its size in bytes must be `bytes`. */
static void *load(const char *name, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "rb");
    if (!f) die("cannot open", name);
    void *p = malloc(bytes ? bytes : 1);
    if (!p) die("out of memory reading", name);
    if (fread(p, 1, bytes, f) != bytes || fgetc(f) != EOF) die("wrong size", name);
    fclose(f);
    return p;
}

static void save(const char *name, const void *p, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, bytes, f) != bytes || fclose(f)) die("cannot write", name);
}

static void save_rc(const char *text) { save("rc.txt", text, strlen(text)); }

/* A printf-made file name or rc.txt line (one buffer: use it before the next call). */
static const char *str(const char *f, ...) {
    static char buf[256];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

static void op_info(void) {
    float x[64] = {0}, y[1];
    uint8_t c[64] = {0};
    float s = 1.f, b = 0.f;
    const uint8_t *cs[1] = {c};
    const float *ss[1] = {&s}, *bs[1] = {&b};
    const int64_t outs[1] = {1};
    const int rc = stoa_qmatmul_int(x, 1, 64, 1, cs, ss, bs, outs, y, 1, 1, 3);
    save_rc(str("%d %d %d\n", stoa_qmatmul_width(), stoa_qmatmul_has_int(), rc));
}

/* One matrix group: m matrices of K inputs, read from <prefix>c<j>.bin, s<j>.bin, b<j>.bin. */
typedef struct {
    int m;
    int64_t N, outs[8];
    const uint8_t *codes[8];
    const float *scales[8], *biases[8];
} group;

static void read_group(group *g, const char *prefix, int m, int64_t K) {
    if (m < 1 || m > 8) die("1 to 8 matrices a group", "args.txt");
    g->m = m;
    g->N = 0;
    for (int j = 0; j < m; j++) g->N += g->outs[j] = arg_i();
    for (int j = 0; j < m; j++) {
        g->codes[j] = load(str("%sc%d.bin", prefix, j), g->outs[j] * K);
        g->scales[j] = load(str("%ss%d.bin", prefix, j), g->outs[j] * (K / 64) * 4);
        g->biases[j] = load(str("%sb%d.bin", prefix, j), g->outs[j] * (K / 64) * 4);
    }
}

static void op_qmatmul(void) {
    const int digits = (int)arg_i();
    const int64_t n = arg_i(), K = arg_i();
    const int m = (int)arg_i(), threads = (int)arg_i();
    group g;
    read_group(&g, "", m, K);
    const float *x = load("x.bin", n * K * 4);
    float *y = calloc(n * g.N + 1, 4);
    const int rc = digits ? stoa_qmatmul_int(x, n, K, m, g.codes, g.scales, g.biases, g.outs, y, g.N, threads, digits)
                          : stoa_qmatmul(x, n, K, m, g.codes, g.scales, g.biases, g.outs, y, g.N, threads);
    save("out_y.bin", y, n * g.N * 4);
    save_rc(str("%d\n", rc));
}

static void op_attn(void) {
    const int64_t n = arg_i();
    const int nkv = (int)arg_i(), rep = (int)arg_i(), d = (int)arg_i();
    const int64_t cap = arg_i(), slots = arg_i();
    const float scale = arg_f();
    const int64_t window = arg_i();
    const int threads = (int)arg_i();
    const float *q = load("q.bin", n * nkv * rep * d * 4);
    const float *kc = load("kc.bin", slots * nkv * cap * d * 4), *vc = load("vc.bin", slots * nkv * cap * d * 4);
    const int64_t *rows = load("rows.bin", n * 8), *pos = load("pos.bin", n * 8);
    float *out = calloc(n * nkv * rep * d, 4);
    const int rc = stoa_attn_decode(q, kc, vc, rows, pos, n, nkv, rep, d, cap, scale, window, out, threads);
    save("out_o.bin", out, n * nkv * rep * d * 4);
    save_rc(str("%d\n", rc));
}

static void op_sample(void) {
    const int64_t n = arg_i(), V = arg_i(), ld = arg_i();
    const float inv_temp = arg_f();
    const int threads = (int)arg_i();
    const float *logits = load("logits.bin", n * ld * 4);
    const uint32_t *lo = load("lo.bin", n * 4), *hi = load("hi.bin", n * 4);
    int64_t *tok = calloc(n + 1, 8);
    float *lp = calloc(n + 1, 4);
    const int rc = stoa_sample(logits, n, V, ld, lo, hi, inv_temp, tok, lp, threads);
    save("out_tok.bin", tok, n * 8);
    save("out_lp.bin", lp, n * 4);
    save_rc(str("%d\n", rc));
}

static void op_noise(void) {
    const int64_t count = arg_i();
    const uint32_t *codes = load("codes.bin", count * 4);
    float *out = calloc(count + 1, 4);
    uint32_t table[256] = {0};
    const int rc = stoa_sample_noise(codes, count, out);
    const int len = stoa_sample_table(table, 256);
    save("out_noise.bin", out, count * 4);
    save("out_table.bin", table, (size_t)(len < 256 ? len : 256) * 4);
    save_rc(str("%d %d\n", rc, len));
}

static void op_step(void) {
    const int nl = (int)arg_i();
    const int64_t n = arg_i(), hidden = arg_i();
    const int nq = (int)arg_i(), nkv = (int)arg_i(), d = (int)arg_i();
    const int64_t cap = arg_i(), rope_len = arg_i(), ntab = arg_i();
    const float eps = arg_f(), scale = arg_f();
    const int digits = (int)arg_i(), threads = (int)arg_i();
    const int64_t slots_kv = arg_i(); /* cache rows */
    stoa_layer *L = calloc(nl, sizeof *L);
    group *groups = calloc(4 * nl, sizeof *groups);
    float **kcs = calloc(nl, sizeof *kcs), **vcs = calloc(nl, sizeof *vcs);
    const float **cos = calloc(ntab, sizeof *cos), **sin = calloc(ntab, sizeof *sin);
    const int64_t cache = slots_kv * nkv * cap * d * 4;
    for (int64_t t = 0; t < ntab; t++) {
        cos[t] = load(str("cos%d.bin", (int)t), rope_len * d * 4);
        sin[t] = load(str("sin%d.bin", (int)t), rope_len * d * 4);
    }
    static const char *names[4] = {"qkv", "o", "gu", "down"};
    for (int i = 0; i < nl; i++) {
        stoa_layer *y = &L[i];
        y->window = arg_i();
        y->rope = arg_i();
        const int qk = (int)arg_i();
        stoa_mat *mats[4] = {&y->qkv, &y->o, &y->gate_up, &y->down};
        for (int k = 0; k < 4; k++) {
            group *g = &groups[4 * i + k];
            const int m = (int)arg_i(), has_bias = (int)arg_i();
            /* K: qkv and gate|up read the hidden state, o the attention's heads, down the MLP's width */
            int64_t K = k == 0 || k == 2 ? hidden : k == 1 ? (int64_t)nq * d : groups[4 * i + 2].N / 2;
            char prefix[64];
            snprintf(prefix, sizeof prefix, "L%d_%s_", i, names[k]);
            read_group(g, prefix, m, K);
            *mats[k] = (stoa_mat){m, K, g->N, g->codes, g->scales, g->biases, g->outs, NULL};
            if (has_bias) mats[k]->bias = load(str("L%d_%s_bias.bin", i, names[k]), g->N * 4);
        }
        y->norm_in = load(str("L%d_norm_in.bin", i), hidden * 4);
        y->norm_post = load(str("L%d_norm_post.bin", i), hidden * 4);
        if (qk) {
            y->q_norm = load(str("L%d_q_norm.bin", i), d * 4);
            y->k_norm = load(str("L%d_k_norm.bin", i), d * 4);
        }
        kcs[i] = load(str("kc%d.bin", i), cache);
        vcs[i] = load(str("vc%d.bin", i), cache);
    }
    float *x = load("x.bin", n * hidden * 4);
    const int64_t *rows = load("rows.bin", n * 8), *pos = load("pos.bin", n * 8);
    const int rc = stoa_decode_layers(L, nl, x, n, rows, pos, hidden, nq, nkv, d, cap, kcs, vcs, cos, sin, rope_len,
                                      eps, scale, digits, threads);
    save("out_x.bin", x, n * hidden * 4);
    for (int i = 0; i < nl; i++) {
        save(str("out_kc%d.bin", i), kcs[i], cache);
        save(str("out_vc%d.bin", i), vcs[i], cache);
    }
    save_rc(str("%d\n", rc));
}

int main(int argc, char **argv) {
    for (int c = 1; c < argc; c++) {
        dir = argv[c];
        char path[4096], op[32];
        snprintf(path, sizeof path, "%s/args.txt", dir);
        args = fopen(path, "r");
        if (!args || fscanf(args, "%31s", op) != 1) die("no operation in", "args.txt");
        if (!strcmp(op, "info")) op_info();
        else if (!strcmp(op, "qmatmul")) op_qmatmul();
        else if (!strcmp(op, "attn")) op_attn();
        else if (!strcmp(op, "sample")) op_sample();
        else if (!strcmp(op, "noise")) op_noise();
        else if (!strcmp(op, "step")) op_step();
        else die("unknown operation", op);
        fclose(args);
    }
    return 0;
}
