/*
 * backend_compare - the host and CUDA state backends must produce the same
 * bytes.
 *
 *  1. Every conformance vector (tests/vectors/recipes.tsv) evaluated on the
 *     device with the recipe.h functions the kernels use.
 *  2. One quantizer per recipe with N cells (default 10^7) of random amax
 *     (random bit patterns, wide log-uniform values, edge values, cells
 *     without data), peer and scale groups, several epochs with overlapping
 *     batches, run through both backends; every result array is compared
 *     byte for byte after every epoch.
 *
 *   backend_compare [VECTORS_TSV] [N]      exit 0 when everything matches
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "postproc.h"
#include "state.h"

enum {
    K_E4M3,
    K_E8M0,
    K_CUR,
    K_CUR_P2,
    K_CUR_E5,
    K_DEL,
    K_DEL_M1,
    K_NVG,
    K_NVTE,
    K_NVMO,
    K_MX,
    K_NVTE_LEG,
    K_NVMO_ST,
    K_GSI_TE,
    K_GSI_MO,
    K_INV_MO,
    K_ENC_TE,
    K_DEC_TE,
    K_ENC_OCP,
    K_DEC_OCP,
    K_MX_MO,
    K_ENC_MO,
    K_DEC_MO,
    K_ENC_TE_LEG,
    K_DEC_TE_LEG,
    K_ENC_TE_218,
    K_DEC_TE_218,
    K_BLK_BF16,
    K_BLK_BF16_P2,
    K_BLK_FP16,
    K_BLK_FP16_P2,
    K_BLK_FP16_E5,
    K_NVG_PC,
    K_NVPC,
    K_NVPC_ENC
};
static const char *kinds[] = {"e4m3",
                              "e8m0",
                              "fp8_current",
                              "fp8_current_pow2",
                              "fp8_current_e5m2",
                              "fp8_delayed",
                              "fp8_delayed_margin1",
                              "nvfp4_global",
                              "nvfp4_te",
                              "nvfp4_modelopt",
                              "mxfp8",
                              "nvfp4_te_legacy",
                              "nvfp4_modelopt_static",
                              "nvfp4_gsi_te",
                              "nvfp4_gsi_modelopt",
                              "fp8_inv_modelopt",
                              "e8m0_enc_te",
                              "e8m0_dec_te",
                              "e8m0_enc_ocp",
                              "e8m0_dec_ocp",
                              "mxfp8_modelopt",
                              "e8m0_enc_modelopt",
                              "e8m0_dec_modelopt",
                              "e8m0_enc_te_legacy",
                              "e8m0_dec_te_legacy",
                              "e8m0_enc_te_2_18",
                              "e8m0_dec_te_2_18",
                              "fp8_block_bf16",
                              "fp8_block_bf16_pow2",
                              "fp8_block_fp16",
                              "fp8_block_fp16_pow2",
                              "fp8_block_fp16_e5m2",
                              "nvfp4_global_partial_cast",
                              "nvfp4_partial_cast",
                              "nvfp4_enc_partial_cast"};

__global__ void k_vectors(const int *kind, const float *x, const float *p, uint32_t *out, int n,
                          float scaled_max_m1)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    float a = x[i], q = p[i];
    uint32_t r = 0;
    switch (kind[i]) {
    case K_E4M3:
        r = amx_e4m3_from_float(a);
        break;
    case K_E8M0:
        r = amx_e8m0_from_float(a);
        break;
    case K_CUR:
        r = amx_f2u(amx_fp8_current_scale(a, AMX_E4M3_MAX, 0, q));
        break;
    case K_CUR_P2:
        r = amx_f2u(amx_fp8_current_scale(a, AMX_E4M3_MAX, 1, q));
        break;
    case K_CUR_E5:
        r = amx_f2u(amx_fp8_current_scale(a, AMX_E5M2_MAX, 0, q));
        break;
    case K_DEL:
        r = amx_f2u(amx_fp8_delayed_scale(a, AMX_E4M3_MAX, q));
        break;
    case K_DEL_M1:
        r = amx_f2u(amx_fp8_delayed_scale(a, scaled_max_m1, q));
        break;
    case K_NVG:
        r = amx_f2u(amx_nvfp4_global_encode(a));
        break;
    case K_NVTE:
        r = amx_nvfp4_block_te(a, q);
        break;
    case K_NVMO:
        r = amx_nvfp4_block_modelopt(a, q);
        break;
    case K_MX:
        r = amx_mxfp8_e8m0(a);
        break;
    case K_NVTE_LEG:
        r = amx_nvfp4_block_te_legacy(a, q);
        break;
    case K_NVMO_ST:
        r = amx_nvfp4_block_modelopt_static(a, q);
        break;
    case K_GSI_TE:
        r = amx_f2u(amx_nvfp4_global_decode(AMX_OUT_TE, a));
        break;
    case K_GSI_MO:
        r = amx_f2u(amx_nvfp4_global_decode(AMX_OUT_MODELOPT, a));
        break;
    case K_INV_MO:
        r = amx_f2u(amx_fp8_scale_inv_modelopt(a, AMX_E4M3_MAX));
        break;
    case K_ENC_TE:
        r = amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE, (uint8_t)amx_f2u(a)));
        break;
    case K_DEC_TE:
        r = amx_f2u(amx_e8m0_decode_conv(AMX_MX_TE, (uint8_t)amx_f2u(a)));
        break;
    case K_ENC_OCP:
        r = amx_f2u(amx_e8m0_encode_conv(AMX_MX_OCP, (uint8_t)amx_f2u(a)));
        break;
    case K_DEC_OCP:
        r = amx_f2u(amx_e8m0_decode_conv(AMX_MX_OCP, (uint8_t)amx_f2u(a)));
        break;
    case K_MX_MO:
        r = amx_mxfp8_e8m0_modelopt(a);
        break;
    case K_ENC_MO:
        r = amx_f2u(amx_e8m0_encode_conv(AMX_MX_MODELOPT, (uint8_t)amx_f2u(a)));
        break;
    case K_DEC_MO:
        r = amx_f2u(amx_e8m0_decode_conv(AMX_MX_MODELOPT, (uint8_t)amx_f2u(a)));
        break;
    case K_ENC_TE_LEG:
        r = amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE_LEGACY, (uint8_t)amx_f2u(a)));
        break;
    case K_DEC_TE_LEG:
        r = amx_f2u(amx_e8m0_decode_conv(AMX_MX_TE_LEGACY, (uint8_t)amx_f2u(a)));
        break;
    case K_ENC_TE_218:
        r = amx_f2u(amx_e8m0_encode_conv(AMX_MX_TE_2_18, (uint8_t)amx_f2u(a)));
        break;
    case K_DEC_TE_218:
        r = amx_f2u(amx_e8m0_decode_conv(AMX_MX_TE_2_18, (uint8_t)amx_f2u(a)));
        break;
    case K_BLK_BF16:
        r = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_BF16, a, AMX_E4M3_MAX, 0, q));
        break;
    case K_BLK_BF16_P2:
        r = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_BF16, a, AMX_E4M3_MAX, 1, q));
        break;
    case K_BLK_FP16:
        r = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_FP16, a, AMX_E4M3_MAX, 0, q));
        break;
    case K_BLK_FP16_P2:
        r = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_FP16, a, AMX_E4M3_MAX, 1, q));
        break;
    case K_BLK_FP16_E5:
        r = amx_f2u(amx_fp8_current_scale_rule(AMX_RULE_BLOCK_FP16, a, AMX_E5M2_MAX, 0, q));
        break;
    case K_NVG_PC:
        r = amx_f2u(amx_nvfp4_global_encode_partial_cast(a));
        break;
    case K_NVPC:
        r = amx_nvfp4_block(AMX_NVFP4_TE_PARTIAL_CAST, a, q,
                            amx_nvfp4_global_encode_partial_cast(q));
        break;
    case K_NVPC_ENC: {
        float s_enc = amx_nvfp4_global_encode_partial_cast(q);
        uint8_t b = amx_nvfp4_block(AMX_NVFP4_TE_PARTIAL_CAST, a, q, s_enc);
        r = amx_f2u(amx_nvfp4_partial_cast_encode(amx_e4m3_to_float(b), s_enc));
        break;
    }
    }
    out[i] = r;
}

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_));                            \
            exit(2);                                                                               \
        }                                                                                          \
    } while (0)

static int run_vectors(const char *path)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "cannot open %s\n", path);
        return 1;
    }
    int cap = 1024, n = 0, *kind = (int *)malloc(cap * sizeof(int));
    float *x = (float *)malloc(cap * 4), *p = (float *)malloc(cap * 4);
    uint32_t *want = (uint32_t *)malloc(cap * 4);
    char line[512];
    while (fgets(line, sizeof(line), f) && n < cap) {
        char k[64];
        unsigned xb, pb, w;
        if (line[0] == '#' || sscanf(line, "%63[^\t]\t%x\t%x\t%x", k, &xb, &pb, &w) != 4)
            continue;
        kind[n] = -1;
        for (int i = 0; i < (int)(sizeof(kinds) / sizeof(kinds[0])); i++)
            if (!strcmp(k, kinds[i]))
                kind[n] = i;
        x[n] = amx_u2f(xb), p[n] = amx_u2f(pb), want[n] = w;
        n++;
    }
    fclose(f);
    int *dk;
    float *dx, *dp;
    uint32_t *dout, *got = (uint32_t *)malloc(n * 4);
    CK(cudaMalloc(&dk, n * 4));
    CK(cudaMalloc(&dx, n * 4));
    CK(cudaMalloc(&dp, n * 4));
    CK(cudaMalloc(&dout, n * 4));
    CK(cudaMemcpy(dk, kind, n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dx, x, n * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dp, p, n * 4, cudaMemcpyHostToDevice));
    k_vectors<<<(n + 127) / 128, 128>>>(dk, dx, dp, dout, n, AMX_E4M3_MAX * powf(2.0f, -1.0f));
    CK(cudaGetLastError());
    CK(cudaMemcpy(got, dout, n * 4, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < n; i++)
        if (kind[i] < 0 || got[i] != want[i]) {
            fprintf(stderr, "vector %d (%s, x=0x%08x p=0x%08x): device 0x%x, expected 0x%x\n", i,
                    kind[i] >= 0 ? kinds[kind[i]] : "?", amx_f2u(x[i]), amx_f2u(p[i]), got[i],
                    want[i]);
            bad++;
        }
    printf("vectors on device: %d rows, %d mismatches\n", n, bad);
    cudaFree(dk), cudaFree(dx), cudaFree(dp), cudaFree(dout);
    free(kind), free(x), free(p), free(want), free(got);
    return bad != 0;
}

/* xorshift64*: reproducible across runs. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 2685821657736338717ull;
}

static float random_amax(void)
{
    static const float edge[] = {0.0f,     1.0f,    448.0f,        449.0f,        464.0f,
                                 57344.0f, 2688.0f, 1.0f / 448.0f, 1e-45f,        1.17549435e-38f,
                                 FLT_MAX,  6.0f,    0.001953125f,  0.0009765625f, 1.0625f,
                                 1.1875f,  432.0f,  3.0f,          1e30f,         2.0f};
    uint64_t r = rnd();
    switch (r % 20) {
    case 0:
    case 1:
        return -INFINITY; /* no data in this batch */
    case 2:
    case 3:
        return edge[(r >> 8) % (sizeof(edge) / sizeof(edge[0]))];
    case 4:
    case 5:
    case 6:
    case 7:
    case 8:
        return amx_u2f((uint32_t)(r >> 32) % 0x7f800000u); /* any finite non-negative */
    case 9: /* 448 * 2^k (k = -140..119) plus 0..63 ulps: MXFP8 te and modelopt differ */
        return amx_u2f(amx_f2u(ldexpf(448.0f, (int)((r >> 8) % 260) - 140)) +
                       (uint32_t)(r >> 40) % 64);
    default:
        return expf(((float)((r >> 20) % 4000000) / 100000.0f) - 20.0f); /* e^-20 .. e^20 */
    }
}

/* The catalog being compared, to name a mismatching cell's quantizer. */
static const amx_qdesc_t *cur_q;
static uint32_t cur_nq;

static uint32_t q_of(size_t cell)
{
    uint32_t i = 0;
    while (i + 1 < cur_nq && cur_q[i + 1].base <= cell)
        i++;
    return i;
}

static int compare(const char *what, const void *a, const void *b, size_t n, size_t elem, int epoch)
{
    if (memcmp(a, b, n * elem) == 0)
        return 0;
    size_t shown = 0, diff = 0;
    for (size_t i = 0; i < n; i++) {
        if (memcmp((const char *)a + i * elem, (const char *)b + i * elem, elem) == 0)
            continue;
        diff++;
        if (shown++ < 5) {
            unsigned long long x = 0, y = 0; /* elem <= 8 */
            memcpy(&x, (const char *)a + i * elem, elem);
            memcpy(&y, (const char *)b + i * elem, elem);
            int cellwise =
                cur_q != NULL && n == (size_t)(cur_q[cur_nq - 1].base + cur_q[cur_nq - 1].ncells);
            uint32_t qi = cellwise ? q_of(i) : (uint32_t)i;
            fprintf(stderr, "epoch %d %s[%zu] (quantizer %u, cell %zu): host 0x%llx, cuda 0x%llx\n",
                    epoch, what, i, qi, cellwise ? i - (size_t)cur_q[qi].base : 0, x, y);
        }
    }
    fprintf(stderr, "epoch %d %s: %zu of %zu differ\n", epoch, what, diff, n);
    return 1;
}

/* Two states of one catalog, one per backend. */
typedef struct {
    amx_state_t *h, *c;
} pair_t;

static int setup(pair_t *p, uint64_t ncells, uint64_t nhist, uint32_t nq, uint64_t nslices = 0)
{
    amx_err_t err = {AMX_OK, ""};
    /* The replicated state follows a layout change from nothing to the
     * catalog (what the engine does when a catalog is first agreed). */
    amx_layout_change_t lc;
    memset(&lc, 0, sizeof(lc));
    lc.ncells = ncells, lc.nhist = nhist, lc.nq = nq, lc.nslices = nslices;
    p->h = p->c = NULL;
    if (amx_state_create("host", 0, &p->h, &err) || amx_state_create("cuda", 0, &p->c, &err) ||
        p->h->ops->reserve_pending(p->h, ncells, &err) ||
        p->c->ops->reserve_pending(p->c, ncells, &err) || p->h->ops->remap(p->h, &lc, &err) ||
        p->c->ops->remap(p->c, &lc, &err) || p->h->ops->remap_active(p->h, &lc, &err) ||
        p->c->ops->remap_active(p->c, &lc, &err)) {
        fprintf(stderr, "backend set-up: %s\n", err.msg);
        return 2;
    }
    return 0;
}

/* What one epoch of a catalog looks like. */
typedef struct {
    const char *label;
    int epochs;
    /* Cells of quantizer i that see no value in this epoch. */
    int (*silent)(uint32_t i, int epoch);
    /* Quantizer i is reset at this epoch. */
    int (*reset)(uint32_t i, int epoch);
} plan_t;

/*
 * Runs `plan` through both backends and compares every result byte for
 * byte after each epoch. Each epoch stages every cell (one run per
 * quantizer), then 1024 random overlapping runs (the atomic path), and
 * finishes with the descriptors dirty only when the engine would say so
 * (a reset now or in the previous epoch, or a history), so the CUDA
 * backend's clean-epoch path is covered too.
 */
static int run_catalog(const plan_t *plan, amx_qdesc_t *q, uint32_t nq, uint64_t ncells,
                       uint64_t nhist, uint32_t npeer, uint32_t nscale, pair_t *p)
{
    amx_state_t *h = p->h, *c = p->c;
    amx_err_t err = {AMX_OK, ""};
    int bad = 0;
    uint64_t vcap = ncells > 1024u * 4096u ? ncells : 1024u * 4096u;
    float *vals = (float *)malloc(vcap * sizeof(float));
    amx_run_t *runs = (amx_run_t *)malloc((nq + 1024) * sizeof(amx_run_t));
    float *ra[2], *rs[2], *ri[2];
    uint8_t *rb[2], *rf[2];
    for (int k = 0; k < 2; k++) {
        ra[k] = (float *)malloc(ncells * 4), rs[k] = (float *)malloc(ncells * 4);
        ri[k] = (float *)malloc(ncells * 4), rb[k] = (uint8_t *)malloc(ncells);
        rf[k] = (uint8_t *)malloc(ncells);
    }
    amx_run_t all = {0, 0, ncells};
    cur_q = q, cur_nq = nq;
    int had_reset = 0;
    for (int epoch = 1; epoch <= plan->epochs; epoch++) {
        for (uint32_t i = 0; i < nq; i++) {
            int quiet = plan->silent != NULL && plan->silent(i, epoch);
            for (uint64_t k = 0; k < q[i].ncells; k++)
                vals[q[i].base + k] = quiet ? -INFINITY : random_amax();
            runs[i] = (amx_run_t){q[i].base, q[i].base, q[i].ncells};
        }
        if (h->ops->merge(h, vals, ncells, runs, nq, 0, &err) ||
            c->ops->merge(c, vals, ncells, runs, nq, 0, &err)) {
            fprintf(stderr, "merge: %s\n", err.msg);
            return 2;
        }
        uint64_t nv = 0;
        size_t nr = 0;
        for (int k = 0; k < 1024; k++) {
            uint64_t len = 1 + rnd() % (ncells < 4096 ? ncells / 2 : 4096);
            uint64_t dst = rnd() % (ncells - len);
            runs[nr++] = (amx_run_t){dst, nv, len};
            for (uint64_t i = 0; i < len; i++)
                vals[nv + i] = random_amax();
            nv += len;
        }
        if (h->ops->merge(h, vals, nv, runs, nr, 1, &err) ||
            c->ops->merge(c, vals, nv, runs, nr, 1, &err)) {
            fprintf(stderr, "merge: %s\n", err.msg);
            return 2;
        }
        int resets = 0;
        for (uint32_t i = 0; i < nq; i++) {
            q[i].hist_head = (uint32_t)((epoch - 1) % q[i].hist_len);
            q[i].reset = plan->reset != NULL && plan->reset(i, epoch);
            resets += q[i].reset;
        }
        int dirty = epoch == 1 || resets > 0 || had_reset || nhist > 0;
        had_reset = resets > 0;
        h->ops->flip(h);
        c->ops->flip(c);
        if (h->ops->finish(h, q, nq, ncells, npeer, nscale, 1, dirty, &err) ||
            c->ops->finish(c, q, nq, ncells, npeer, nscale, 1, dirty, &err)) {
            fprintf(stderr, "finish: %s\n", err.msg);
            return 2;
        }
        h->ops->publish(h);
        c->ops->publish(c);
        amx_state_t *st[2] = {h, c};
        for (int k = 0; k < 2; k++)
            if (st[k]->ops->read_results(st[k], &all, 1, ncells, ra[k], rs[k], ri[k], rb[k],
                                         &err) ||
                st[k]->ops->read_filled == NULL ||
                st[k]->ops->read_filled(st[k], &all, 1, rf[k], &err)) {
                fprintf(stderr, "read_results / read_filled: %s\n",
                        st[k]->ops->read_filled ? err.msg : "read_filled missing");
                return 2;
            }
        int e = 0, hf = h->front, cf = c->front;
        e |= compare("amax", ra[0], ra[1], ncells, 4, epoch);
        e |= compare("scale", rs[0], rs[1], ncells, 4, epoch);
        e |= compare("scale_inv", ri[0], ri[1], ncells, 4, epoch);
        e |= compare("bytes", rb[0], rb[1], ncells, 1, epoch);
        e |= compare("filled", rf[0], rf[1], ncells, 1, epoch);
        uint64_t counts[2][2] = {{h->last_filled, h->last_missing},
                                 {c->last_filled, c->last_missing}};
        e |= compare("filled/missing counts", counts[0], counts[1], 2, 8, epoch);
        e |= compare("global_amax", h->g_amax[hf], c->g_amax[cf], nq, 4, epoch);
        e |= compare("global_scale", h->g_scale[hf], c->g_scale[cf], nq, 4, epoch);
        e |= compare("global_scale_inv", h->g_inv[hf], c->g_inv[cf], nq, 4, epoch);
        uint64_t ns = amx_qdesc_slices(q, nq);
        if (ns > 0) {
            if (h->out_ns[hf] != ns || c->out_ns[cf] != ns) {
                fprintf(stderr, "epoch %d: %llu / %llu slice results, not %llu\n", epoch,
                        (unsigned long long)h->out_ns[hf], (unsigned long long)c->out_ns[cf],
                        (unsigned long long)ns);
                e = 1;
            } else {
                e |= compare("slice_amax", h->s_amax[hf], c->s_amax[cf], ns, 4, epoch);
                e |= compare("slice_scale", h->s_scale[hf], c->s_scale[cf], ns, 4, epoch);
                e |= compare("slice_scale_inv", h->s_inv[hf], c->s_inv[cf], ns, 4, epoch);
            }
        }
        uint64_t nonfinite = 0;
        for (uint64_t i = 0; i < ncells; i++)
            nonfinite += !isfinite(rs[1][i]) || !isfinite(ri[1][i]);
        printf("%s, epoch %d (%s descriptors, %d resets): %llu cells of %u quantizers compared: "
               "%s; non-finite scales: %llu; filled %llu, missing %llu\n",
               plan->label, epoch, dirty ? "new" : "same", resets, (unsigned long long)ncells, nq,
               e ? "MISMATCH" : "identical", (unsigned long long)nonfinite,
               (unsigned long long)c->last_filled, (unsigned long long)c->last_missing);
        bad |= e | (nonfinite != 0);
    }
    free(vals);
    free(runs);
    for (int k = 0; k < 2; k++)
        free(ra[k]), free(rs[k]), free(ri[k]), free(rb[k]), free(rf[k]);
    return bad;
}

static void init_recipe(amx_recipe_t *r)
{
    r->history_len = r->history_len ? r->history_len : 1;
    r->history_reduce = r->history_reduce ? r->history_reduce : AMX_HIST_MAX;
    r->scaled_max = r->format <= 2 ? amx_fp8_max(r->format) * powf(2.0f, -r->margin) : 0.0f;
    /* Defaults as the catalog resolves them (catalog.c normalize_recipe). */
    r->output_convention = r->output_convention ? r->output_convention : AMX_OUT_TE;
    if (r->rule == AMX_RULE_DELAYED && r->history_convention == 0)
        r->history_convention = AMX_HISTCONV_TE;
    if (r->format == AMX_FMT_MXFP8 && r->mxfp8_convention == 0)
        r->mxfp8_convention = AMX_MX_TE;
}

/* Appends quantizer i of `ncells` cells with recipe r to q. */
static void add_q(amx_qdesc_t *q, uint32_t i, const amx_recipe_t *r, uint64_t n, uint64_t *ncells,
                  uint64_t *nhist, int peer, int scale)
{
    memset(&q[i], 0, sizeof(q[i]));
    q[i].recipe = *r;
    q[i].base = *ncells;
    q[i].ncells = n;
    q[i].accumulation = r->rule == AMX_RULE_DELAYED ? AMX_ACC_PER_EPOCH : AMX_ACC_RUNNING_MAX;
    q[i].hist_len = q[i].accumulation == AMX_ACC_PER_EPOCH ? r->history_len : 1;
    q[i].hist_base = *nhist;
    if (q[i].accumulation == AMX_ACC_PER_EPOCH)
        *nhist += n * q[i].hist_len;
    q[i].peer_group = peer;
    q[i].scale_group = scale;
    q[i].peer_mode = peer >= 0 ? AMX_PEER_FILL : 0;
    q[i].gbase = i > 0 ? q[i - 1].gbase + q[i - 1].nslices : 0;
    *ncells += n;
}

/* Gives quantizer i (the last one added) `ns` global slices of its cells
 * (ncells divisible by ns); the next add_q starts after them. */
static void add_slices(amx_qdesc_t *q, uint32_t i, uint64_t ns)
{
    q[i].nslices = ns;
    q[i].slice_cells = q[i].ncells / ns;
}

/* The peer-mode and slice catalog: whole quantizers silent now and then
 * (the group fills or shares them), a sliced quantizer reset in epoch 3. */
static int silent_modes(uint32_t i, int epoch)
{
    return (i % 4 == 1 && epoch % 2 == 0) || (i == 6 && epoch <= 2);
}

static int reset_modes(uint32_t i, int epoch)
{
    return epoch == 3 && (i == 2 || i == 7);
}

/* The recipe catalog: the delayed quantizers see nothing in epoch 4 (and
 * two of them in epoch 5 too, so that TE's history rule keeps the window
 * over two empty epochs), quantizer 0 is reset in epoch 3. */
static int silent8(uint32_t i, int epoch)
{
    return (epoch == 4 && (i == 2 || i == 3 || i == 8 || i == 14 || i == 15)) ||
           (epoch == 5 && (i == 8 || i == 15));
}

static int reset8(uint32_t i, int epoch)
{
    return epoch == 3 && i == 0;
}

/* The many-quantizer catalog: every 7th quantizer never sees data (its
 * peer group fills it), every 1000th is reset in epoch 3. */
static int silent_many(uint32_t i, int epoch)
{
    (void)epoch;
    return i % 7 == 3;
}

static int reset_many(uint32_t i, int epoch)
{
    return epoch == 3 && i % 1000 == 0;
}

int main(int argc, char **argv)
{
    const char *vec = argc > 1 ? argv[1] : "tests/vectors/recipes.tsv";
    uint64_t per = argc > 2 ? strtoull(argv[2], NULL, 10) : 10000000ull;
    int bad = run_vectors(vec);

    /* One quantizer per recipe and convention. */
    enum { NREC = 22 };
    amx_recipe_t rec[NREC];
    memset(rec, 0, sizeof(rec));
    rec[0].format = AMX_FMT_FP8_E4M3, rec[0].rule = AMX_RULE_CURRENT;
    rec[1].format = AMX_FMT_FP8_E5M2, rec[1].rule = AMX_RULE_CURRENT, rec[1].power_of_2 = 1,
    rec[1].eps = 1e-4f;
    rec[2].format = AMX_FMT_FP8_E4M3, rec[2].rule = AMX_RULE_DELAYED, rec[2].history_len = 4,
    rec[2].history_reduce = AMX_HIST_MAX, rec[2].margin = 1.0f;
    rec[3].format = AMX_FMT_FP8_E4M3, rec[3].rule = AMX_RULE_DELAYED, rec[3].history_len = 1,
    rec[3].history_reduce = AMX_HIST_MOST_RECENT;
    rec[4].format = AMX_FMT_NVFP4, rec[4].nvfp4_convention = AMX_NVFP4_TE;
    rec[5].format = AMX_FMT_NVFP4, rec[5].nvfp4_convention = AMX_NVFP4_MODELOPT;
    rec[6].format = AMX_FMT_MXFP8;
    rec[7].format = AMX_FMT_FP8_E5M2, rec[7].rule = AMX_RULE_DELAYED, rec[7].history_len = 2,
    rec[7].history_reduce = AMX_HIST_MAX;
    /* The conventions of docs/NUMERICS.md beyond the defaults above. */
    rec[8].format = AMX_FMT_FP8_E4M3, rec[8].rule = AMX_RULE_DELAYED, rec[8].history_len = 4,
    rec[8].history_reduce = AMX_HIST_MAX, rec[8].history_convention = AMX_HISTCONV_TE_UNFUSED;
    rec[9].format = AMX_FMT_NVFP4, rec[9].nvfp4_convention = AMX_NVFP4_TE_LEGACY;
    rec[10].format = AMX_FMT_NVFP4, rec[10].nvfp4_convention = AMX_NVFP4_MODELOPT_STATIC,
    rec[10].output_convention = AMX_OUT_MODELOPT;
    rec[11].format = AMX_FMT_NVFP4, rec[11].nvfp4_convention = AMX_NVFP4_MODELOPT,
    rec[11].output_convention = AMX_OUT_MODELOPT;
    rec[12].format = AMX_FMT_FP8_E4M3, rec[12].rule = AMX_RULE_CURRENT,
    rec[12].output_convention = AMX_OUT_MODELOPT;
    rec[13].format = AMX_FMT_MXFP8, rec[13].mxfp8_convention = AMX_MX_OCP;
    rec[14].format = AMX_FMT_FP8_E4M3, rec[14].rule = AMX_RULE_DELAYED, rec[14].history_len = 3,
    rec[14].history_reduce = AMX_HIST_MOST_RECENT;
    rec[15].format = AMX_FMT_FP8_E4M3, rec[15].rule = AMX_RULE_DELAYED, rec[15].history_len = 16,
    rec[15].history_reduce = AMX_HIST_MAX;
    rec[16].format = AMX_FMT_MXFP8, rec[16].mxfp8_convention = AMX_MX_MODELOPT;
    rec[17].format = AMX_FMT_MXFP8, rec[17].mxfp8_convention = AMX_MX_TE_LEGACY;
    rec[18].format = AMX_FMT_MXFP8, rec[18].mxfp8_convention = AMX_MX_TE_2_18;
    /* FP8 block scaling as TE's block quantizer kernels on bf16 / fp16
     * input, and TE's NVFP4 2D master-weight cast. */
    rec[19].format = AMX_FMT_FP8_E4M3, rec[19].rule = AMX_RULE_BLOCK_BF16;
    rec[20].format = AMX_FMT_FP8_E5M2, rec[20].rule = AMX_RULE_BLOCK_FP16, rec[20].power_of_2 = 1,
    rec[20].eps = 1e-40f;
    rec[21].format = AMX_FMT_NVFP4, rec[21].nvfp4_convention = AMX_NVFP4_TE_PARTIAL_CAST;
    const char *names[NREC] = {"fp8-e4m3-current",
                               "fp8-e5m2-current-pow2-eps",
                               "fp8-delayed-H4-m1",
                               "fp8-delayed-most-recent",
                               "nvfp4-te",
                               "nvfp4-modelopt",
                               "mxfp8",
                               "fp8-e5m2-delayed-H2",
                               "fp8-delayed-H4-te-unfused",
                               "nvfp4-te-legacy",
                               "nvfp4-modelopt-static-out-mo",
                               "nvfp4-modelopt-out-mo",
                               "fp8-current-out-modelopt",
                               "mxfp8-ocp",
                               "fp8-delayed-H3-most-recent",
                               "fp8-delayed-H16",
                               "mxfp8-modelopt",
                               "mxfp8-te-legacy",
                               "mxfp8-te-2.18",
                               "fp8-block-bf16",
                               "fp8-e5m2-block-fp16-pow2-eps",
                               "nvfp4-te-partial-cast"};
    for (int i = 0; i < NREC; i++)
        init_recipe(&rec[i]);
    {
        uint32_t nq = NREC;
        amx_qdesc_t q[NREC];
        uint64_t ncells = 0, nhist = 0;
        for (uint32_t i = 0; i < nq; i++)
            add_q(q, i, &rec[i], per, &ncells, &nhist,
                  (i == 4 || i == 5 || i == 6 || i == 10 || i == 13 || i == 16 || i == 21) ? 0 : -1,
                  (i == 0 || i == 1 || i == 12) ? 0
                  : (i == 2 || i == 3)          ? 1
                  : (i == 9 || i == 11)         ? 2
                                                : -1);
        pair_t p;
        if (setup(&p, ncells, nhist, nq))
            return 2;
        plan_t plan = {"22 recipes", 6, silent8, reset8};
        bad |= run_catalog(&plan, q, nq, ncells, nhist, 1, 3, &p);
        for (uint32_t i = 0; i < nq; i++)
            printf("  %-28s global_amax %-14.7g global_scale %-14.7g\n", names[i],
                   p.c->g_amax[p.c->front][i], p.c->g_scale[p.c->front][i]);
        amx_state_destroy(p.h);
        amx_state_destroy(p.c);
    }
    {
        /* Many quantizers of every size from 1 cell up (the shape of a real
         * catalog: many per-tensor quantizers, some per-channel ones), the
         * recipes without history so that most epochs keep the descriptors,
         * 64 peer groups and 32 scale groups. */
        static const int pick[5] = {0, 1, 4, 5, 6};
        uint32_t nq = 120000;
        amx_qdesc_t *q = (amx_qdesc_t *)malloc(nq * sizeof(amx_qdesc_t));
        uint64_t ncells = 0, nhist = 0;
        for (uint32_t i = 0; i < nq; i++) {
            uint64_t r = rnd();
            uint64_t n = i < 100000 ? 1 : (r % 10 == 0 ? 1 + r % 20000 : 1 + r % 700);
            int peer = i % 5 == 2 || i % 7 == 3 ? (int)(i % 64) : -1;
            int scale = i % 11 == 0 ? (int)(i % 32) : -1;
            add_q(q, i, &rec[pick[i % 5]], n, &ncells, &nhist, peer, scale);
            /* Odd groups share; every 13th NVFP4 quantizer of 8+ cells has
             * 8 global slices when it has no scale group. */
            if (peer >= 0 && peer % 2 == 1)
                q[i].peer_mode = AMX_PEER_SHARE;
            if (pick[i % 5] == 4 && i % 13 == 0 && scale < 0 && n >= 8) {
                q[i].ncells = n - n % 8;
                ncells -= n % 8;
                add_slices(q, i, 8);
            }
        }
        pair_t p;
        if (setup(&p, ncells, nhist, nq, amx_qdesc_slices(q, nq)))
            return 2;
        plan_t plan = {"many quantizers", 5, silent_many, reset_many};
        bad |= run_catalog(&plan, q, nq, ncells, nhist, 64, 32, &p);
        amx_state_destroy(p.h);
        amx_state_destroy(p.c);
        free(q);
    }
    {
        /* Peer modes and global slices (global_axes): a share group and a
         * fill group with the same kinds of members, sliced NVFP4 (TE and
         * ModelOpt), a sliced delayed FP8 (per-slice previous scales), many
         * small slices and one slice per cell row. */
        uint32_t nq = 12;
        amx_qdesc_t q[12];
        uint64_t ncells = 0, nhist = 0, n = per - per % 64;
        for (uint32_t g = 0; g < 2; g++) {
            uint32_t b = g * 5;
            add_q(q, b + 0, &rec[0], 1, &ncells, &nhist, (int)g, -1);
            add_q(q, b + 1, &rec[6], n / 4, &ncells, &nhist, (int)g, -1);
            add_q(q, b + 2, &rec[4], n, &ncells, &nhist, (int)g, -1);
            add_slices(q, b + 2, 64);
            add_q(q, b + 3, &rec[11], n, &ncells, &nhist, (int)g, -1);
            add_slices(q, b + 3, n / 16);
            add_q(q, b + 4, &rec[14], 64, &ncells, &nhist, (int)g, -1);
            add_slices(q, b + 4, 8);
            for (uint32_t k = b; k < b + 5; k++)
                q[k].peer_mode = g == 0 ? AMX_PEER_SHARE : AMX_PEER_FILL;
        }
        add_q(q, 10, &rec[10], n, &ncells, &nhist, -1, -1);
        add_slices(q, 10, 4);
        add_q(q, 11, &rec[2], 256, &ncells, &nhist, -1, -1);
        add_slices(q, 11, 256);
        pair_t p;
        if (setup(&p, ncells, nhist, nq, amx_qdesc_slices(q, nq)))
            return 2;
        plan_t plan = {"peer modes and global slices", 5, silent_modes, reset_modes};
        bad |= run_catalog(&plan, q, nq, ncells, nhist, 2, 0, &p);
        amx_state_destroy(p.h);
        amx_state_destroy(p.c);
    }
    printf("backend_compare: %s\n", bad ? "FAILED" : "host and CUDA backends agree byte for byte");
    return bad ? 1 : 0;
}
