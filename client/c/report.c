/*
 * report.c - the HTML calibration report (report.h).
 *
 * Every chart is an inline <svg> drawn here: bars of global amax per layer
 * for each kind of quantizer ("decoder.layers.*.mlp.linear_fc1.input_quantizer"),
 * bars per expert for each peer group (cold experts, which took the group's
 * max, in another colour), and bars of how far each of the most-moved
 * quantizers' global scale moved (log2 of the ratio to the previous epoch).
 */
#include "report.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_CHARTS 24 /* per section; the rest are listed in tables */
#define TOP_MOVERS 20

static const char *fmt_names[] = {"unspecified", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp8"};

/* ---- small helpers ---- */

/* Text as HTML (also safe inside attribute values and SVG text). */
static void html(FILE *o, const char *s)
{
    for (; *s; s++) {
        switch (*s) {
        case '&':
            fputs("&amp;", o);
            break;
        case '<':
            fputs("&lt;", o);
            break;
        case '>':
            fputs("&gt;", o);
            break;
        case '"':
            fputs("&quot;", o);
            break;
        case '\'':
            fputs("&#39;", o);
            break;
        default:
            fputc(*s, o);
        }
    }
}

static float f32(const ProtobufCBinaryData *b, size_t i)
{
    float f;
    memcpy(&f, b->data + 4 * i, 4);
    return f;
}

static size_t ncells(const Amaxd__V1__QuantizerResult *r)
{
    return r->amax.len / 4;
}

/* Cells of r that took their peer group's max. */
static size_t nfilled(const Amaxd__V1__QuantizerResult *r)
{
    return r->peer_fill_known ? r->peer_filled : 0;
}

static int cell_filled(const Amaxd__V1__QuantizerResult *r, size_t i)
{
    return r->peer_fill_known && r->peer_filled > 0 && i < r->filled.len && r->filled.data[i];
}

/* The layer of a name: the first dot-delimited run of digits ("layers.3.");
 * the kind is the name with it replaced by '*'. -1 when there is none. */
static long layer_of(const char *name, char *kind, size_t len)
{
    const char *p = name;
    while (*p) {
        if ((p == name || p[-1] == '.') && *p >= '0' && *p <= '9') {
            const char *q = p;
            while (*q >= '0' && *q <= '9')
                q++;
            if (*q == '.' || *q == '\0') {
                snprintf(kind, len, "%.*s*%s", (int)(p - name), name, q);
                return strtol(p, NULL, 10);
            }
        }
        p++;
    }
    snprintf(kind, len, "%s", name);
    return -1;
}

/* ---- SVG bar chart ---- */

typedef struct bar {
    double v;
    const char *label; /* x label (may be NULL) */
    int cold;          /* drawn in the cold colour */
    const char *title; /* tooltip */
} bar_t;

static void nice_num(FILE *o, double v)
{
    if (v == 0)
        fputs("0", o);
    else if (fabs(v) >= 1e4 || fabs(v) < 1e-2)
        fprintf(o, "%.2g", v);
    else
        fprintf(o, "%.3g", v);
}

/* A bar chart of n bars (values >= 0; log scale when `logy` and the values
 * span more than a factor 100; signed bars around 0 when `signed_`). */
static void svg_bars(FILE *o, const char *title, const char *ylabel, const bar_t *b, size_t n,
                     int logy, int signed_)
{
    const double W = 720, H = 260, L = 64, R = 12, T = 28, B = 56;
    double pw = W - L - R, ph = H - T - B;
    double lo = INFINITY, hi = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        if (b[i].v < lo)
            lo = b[i].v;
        if (b[i].v > hi)
            hi = b[i].v;
    }
    if (n == 0)
        lo = hi = 0;
    int use_log = 0;
    double minpos = INFINITY;
    for (size_t i = 0; i < n; i++)
        if (b[i].v > 0 && b[i].v < minpos)
            minpos = b[i].v;
    if (logy && !signed_ && isfinite(minpos) && hi / minpos > 100)
        use_log = 1;
    double y0, y1; /* data range on the axis */
    if (signed_) {
        double m = fmax(fabs(lo), fabs(hi));
        y0 = -(m > 0 ? m : 1);
        y1 = -y0;
    } else if (use_log) {
        y0 = floor(log10(minpos));
        y1 = ceil(log10(hi));
        if (y1 <= y0)
            y1 = y0 + 1;
    } else {
        y0 = 0;
        y1 = hi > 0 ? hi * 1.05 : 1;
    }
#define YPOS(val) (T + ph * (1 - ((val)-y0) / (y1 - y0)))
    fprintf(o,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" "
            "viewBox=\"0 0 %g %g\" role=\"img\">\n",
            W, H, W, H);
    fprintf(o, "<rect x=\"0\" y=\"0\" width=\"%g\" height=\"%g\" fill=\"#ffffff\"/>\n", W, H);
    fprintf(o,
            "<text x=\"%g\" y=\"18\" font-family=\"sans-serif\" font-size=\"13\" "
            "font-weight=\"bold\" fill=\"#222\">",
            L);
    html(o, title);
    fputs("</text>\n", o);
    /* Axis, grid and tick labels. */
    for (int k = 0; k <= 4; k++) {
        double v = y0 + (y1 - y0) * k / 4.0;
        double y = YPOS(v);
        fprintf(o,
                "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#ddd\" "
                "stroke-width=\"1\"/>\n",
                L, y, W - R, y);
        fprintf(o,
                "<text x=\"%g\" y=\"%.1f\" font-family=\"sans-serif\" font-size=\"10\" "
                "text-anchor=\"end\" fill=\"#444\">",
                L - 4, y + 3);
        nice_num(o, use_log ? pow(10, v) : v);
        fputs("</text>\n", o);
    }
    fprintf(o,
            "<text x=\"12\" y=\"%g\" font-family=\"sans-serif\" font-size=\"10\" fill=\"#444\" "
            "transform=\"rotate(-90 12 %g)\" text-anchor=\"middle\">",
            T + ph / 2, T + ph / 2);
    html(o, ylabel);
    fputs(use_log ? " (log)</text>\n" : "</text>\n", o);
    /* Bars. */
    double slot = n ? pw / (double)n : pw;
    double bw = slot * 0.8 > 1 ? slot * 0.8 : 1;
    size_t every = n > 32 ? (n + 31) / 32 : 1;
    for (size_t i = 0; i < n; i++) {
        double v = b[i].v, top, bot;
        if (signed_) {
            top = YPOS(v > 0 ? v : 0);
            bot = YPOS(v > 0 ? 0 : v);
        } else if (use_log) {
            top = v > 0 ? YPOS(log10(v)) : T + ph;
            bot = T + ph;
        } else {
            top = YPOS(v);
            bot = T + ph;
        }
        if (bot - top < 1 && v != 0)
            top = bot - 1;
        double x = L + slot * (double)i + (slot - bw) / 2;
        fprintf(o,
                "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"%s\">"
                "<title>",
                x, top, bw, bot - top, b[i].cold ? "#e8a33d" : "#3b6fb6");
        html(o, b[i].title ? b[i].title : "");
        fputs("</title></rect>\n", o);
        if (b[i].label != NULL && i % every == 0) {
            fprintf(o,
                    "<text x=\"%.2f\" y=\"%g\" font-family=\"sans-serif\" font-size=\"10\" "
                    "text-anchor=\"middle\" fill=\"#444\">",
                    x + bw / 2, T + ph + 14);
            html(o, b[i].label);
            fputs("</text>\n", o);
        }
    }
    fprintf(o,
            "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#444\" stroke-width=\"1\"/>\n",
            L, T, L, T + ph);
    double base = signed_ ? YPOS(0) : T + ph;
    fprintf(o,
            "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#444\" "
            "stroke-width=\"1\"/>\n",
            L, base, W - R, base);
#undef YPOS
    fputs("</svg>\n", o);
}

/* ---- sections ---- */

typedef struct kind {
    char name[320];
    size_t *idx; /* results, ordered by layer */
    long *layer;
    size_t n, cap;
} kind_t;

static int add_kind_member(kind_t *k, size_t i, long layer)
{
    if (k->n == k->cap) {
        size_t cap = k->cap ? 2 * k->cap : 8;
        size_t *ni = realloc(k->idx, cap * sizeof(*ni));
        if (ni == NULL)
            return -1;
        k->idx = ni;
        long *nl = realloc(k->layer, cap * sizeof(*nl));
        if (nl == NULL)
            return -1;
        k->layer = nl;
        k->cap = cap;
    }
    /* Insert in layer order. */
    size_t p = k->n;
    while (p > 0 && k->layer[p - 1] > layer) {
        k->idx[p] = k->idx[p - 1];
        k->layer[p] = k->layer[p - 1];
        p--;
    }
    k->idx[p] = i;
    k->layer[p] = layer;
    k->n++;
    return 0;
}

static int per_layer(FILE *o, const report_in_t *in)
{
    kind_t *kinds = NULL;
    size_t nk = 0;
    int rc = 0;
    for (size_t i = 0; i < in->nresults; i++) {
        char kn[320];
        long layer = layer_of(in->results[i]->name, kn, sizeof(kn));
        if (layer < 0)
            continue;
        size_t k = 0;
        while (k < nk && strcmp(kinds[k].name, kn) != 0)
            k++;
        if (k == nk) {
            kind_t *nkp = realloc(kinds, (nk + 1) * sizeof(*nkp));
            if (nkp == NULL) {
                rc = -1;
                goto out;
            }
            kinds = nkp;
            memset(&kinds[nk], 0, sizeof(kinds[nk]));
            snprintf(kinds[nk].name, sizeof(kinds[nk].name), "%s", kn);
            nk++;
        }
        if (add_kind_member(&kinds[k], i, layer) != 0) {
            rc = -1;
            goto out;
        }
    }
    fputs("<h2 id=\"layers\">Global amax per layer</h2>\n", o);
    if (nk == 0) {
        fputs("<p>No quantizer name carries a layer number.</p>\n", o);
        goto out;
    }
    fprintf(o,
            "<p>%zu kinds of quantizer over layers; one chart per kind (the layer number in the "
            "name replaced by <code>*</code>), bars = global amax of each layer's quantizer.",
            nk);
    if (nk > MAX_CHARTS)
        fprintf(o, " The first %d kinds are drawn.", MAX_CHARTS);
    fputs("</p>\n", o);
    for (size_t k = 0; k < nk && k < MAX_CHARTS; k++) {
        kind_t *kd = &kinds[k];
        bar_t *bars = calloc(kd->n ? kd->n : 1, sizeof(*bars));
        char(*labels)[24] = calloc(kd->n ? kd->n : 1, sizeof(*labels));
        char(*titles)[96] = calloc(kd->n ? kd->n : 1, sizeof(*titles));
        if (bars == NULL || labels == NULL || titles == NULL) {
            free(bars), free(labels), free(titles);
            rc = -1;
            goto out;
        }
        for (size_t m = 0; m < kd->n; m++) {
            const Amaxd__V1__QuantizerResult *r = in->results[kd->idx[m]];
            snprintf(labels[m], sizeof(labels[m]), "%ld", kd->layer[m]);
            snprintf(titles[m], sizeof(titles[m]), "layer %ld: global amax %.6g", kd->layer[m],
                     r->global_amax);
            bars[m].v = r->global_amax;
            bars[m].label = labels[m];
            bars[m].title = titles[m];
            bars[m].cold = nfilled(r) > 0 && nfilled(r) == ncells(r);
        }
        fputs("<figure>\n", o);
        svg_bars(o, kd->name, "global amax", bars, kd->n, 1, 0);
        fputs("</figure>\n", o);
        free(bars), free(labels), free(titles);
    }
out:
    for (size_t k = 0; k < nk; k++) {
        free(kinds[k].idx);
        free(kinds[k].layer);
    }
    free(kinds);
    return rc;
}

/* Per peer group: one bar per expert. A group of one quantizer with a 1-D
 * shape ([E]) has a bar per cell; otherwise a bar per member quantizer. */
static int per_expert(FILE *o, const report_in_t *in)
{
    const Amaxd__V1__ListQuantizersResponse *l = in->list;
    fputs("<h2 id=\"experts\">Amax per expert (peer groups)</h2>\n", o);
    /* Unique group names in catalog order. */
    const char **groups = calloc(l->n_quantizers + 1, sizeof(*groups));
    if (groups == NULL)
        return -1;
    size_t ng = 0;
    for (size_t i = 0; i < l->n_quantizers; i++) {
        const char *g = l->quantizers[i]->peer_group;
        if (g[0] == '\0')
            continue;
        size_t k = 0;
        while (k < ng && strcmp(groups[k], g) != 0)
            k++;
        if (k == ng)
            groups[ng++] = g;
    }
    if (ng == 0) {
        fputs("<p>No quantizer has a peer group.</p>\n", o);
        free(groups);
        return 0;
    }
    fprintf(o,
            "<p>%zu peer groups. <span class=\"cold\">Orange</span> bars are cold experts: no "
            "data in the last epoch, filled with the group's max.",
            ng);
    if (ng > MAX_CHARTS)
        fprintf(o, " The first %d groups are drawn.", MAX_CHARTS);
    fputs("</p>\n", o);
    int rc = 0;
    for (size_t g = 0; g < ng && g < MAX_CHARTS; g++) {
        size_t members = 0, last = 0;
        for (size_t i = 0; i < in->nresults; i++)
            if (strcmp(l->quantizers[i]->peer_group, groups[g]) == 0)
                members++, last = i;
        const Amaxd__V1__QuantizerResult *one = in->results[last];
        int by_cell = members == 1 && one->n_shape == 1;
        size_t nb = by_cell ? ncells(one) : members;
        bar_t *bars = calloc(nb ? nb : 1, sizeof(*bars));
        char(*labels)[24] = calloc(nb ? nb : 1, sizeof(*labels));
        char(*titles)[400] = calloc(nb ? nb : 1, sizeof(*titles));
        if (bars == NULL || labels == NULL || titles == NULL) {
            free(bars), free(labels), free(titles);
            rc = -1;
            break;
        }
        size_t m = 0;
        for (size_t i = 0; i < in->nresults && m < nb; i++) {
            const Amaxd__V1__QuantizerResult *r = in->results[i];
            if (strcmp(l->quantizers[i]->peer_group, groups[g]) != 0)
                continue;
            if (by_cell) {
                for (size_t c = 0; c < ncells(r); c++, m++) {
                    bars[m].v = f32(&r->amax, c);
                    bars[m].cold = cell_filled(r, c);
                    snprintf(labels[m], sizeof(labels[m]), "%zu", c);
                    snprintf(titles[m], sizeof(titles[m]), "expert %zu: amax %.6g%s", c, bars[m].v,
                             bars[m].cold ? " (cold: filled from the group)" : "");
                    bars[m].label = labels[m];
                    bars[m].title = titles[m];
                }
            } else {
                bars[m].v = r->global_amax;
                bars[m].cold = nfilled(r) > 0 && nfilled(r) == ncells(r);
                snprintf(labels[m], sizeof(labels[m]), "%zu", m);
                snprintf(titles[m], sizeof(titles[m]), "%.300s: global amax %.6g%s", r->name,
                         bars[m].v, bars[m].cold ? " (cold: filled from the group)" : "");
                bars[m].label = labels[m];
                bars[m].title = titles[m];
                m++;
            }
        }
        char title[400];
        snprintf(title, sizeof(title), "%.300s (%zu %s)", groups[g], nb,
                 by_cell ? "experts" : "quantizers");
        fputs("<figure>\n", o);
        svg_bars(o, title, by_cell ? "amax" : "global amax", bars, m, 1, 0);
        fputs("</figure>\n", o);
        free(bars), free(labels), free(titles);
    }
    free(groups);
    return rc;
}

static void cold_table(FILE *o, const report_in_t *in)
{
    fputs("<h2 id=\"cold\">Cold experts (filled from peers)</h2>\n", o);
    int known = 0;
    size_t total = 0;
    for (size_t i = 0; i < in->nresults; i++) {
        known |= in->results[i]->peer_fill_known;
        total += nfilled(in->results[i]);
    }
    if (!known) {
        fputs("<p>The daemon's state backend does not report which cells were filled from their "
              "peer group (the cuda backend does not yet).</p>\n",
              o);
        return;
    }
    if (total == 0) {
        fputs("<p class=\"ok\">None: every cell had data in the last epoch.</p>\n", o);
        return;
    }
    fprintf(o,
            "<p><b id=\"cold-total\">%zu</b> cells had no data in the last epoch and took their "
            "peer group's max.</p>\n<table>\n<tr><th>quantizer</th><th>peer group</th>"
            "<th>cold cells</th><th>of</th><th>filled with</th></tr>\n",
            total);
    for (size_t i = 0; i < in->nresults; i++) {
        const Amaxd__V1__QuantizerResult *r = in->results[i];
        if (nfilled(r) == 0)
            continue;
        fputs("<tr class=\"cold-row\"><td class=\"name\">", o);
        html(o, r->name);
        fputs("</td><td>", o);
        html(o, in->list->quantizers[i]->peer_group);
        fputs("</td><td class=\"cells\">", o);
        size_t shown = 0;
        float with = 0;
        for (size_t c = 0; c < ncells(r); c++)
            if (cell_filled(r, c)) {
                with = f32(&r->amax, c);
                if (shown < 64)
                    fprintf(o, shown ? ", %zu" : "%zu", c);
                else if (shown == 64)
                    fputs(", &hellip;", o);
                shown++;
            }
        fprintf(o, "</td><td>%zu</td><td>%.6g</td></tr>\n", ncells(r), with);
    }
    fputs("</table>\n", o);
}

typedef struct mover {
    size_t i;
    double moved; /* |log2(scale / previous scale)| */
} mover_t;

static int cmp_mover(const void *a, const void *b)
{
    const mover_t *x = a, *y = b;
    if (x->moved != y->moved)
        return x->moved < y->moved ? 1 : -1;
    return x->i < y->i ? -1 : x->i > y->i;
}

static int movers(FILE *o, const report_in_t *in)
{
    fputs("<h2 id=\"movers\">Scales that moved most since the previous epoch</h2>\n", o);
    mover_t *mv = calloc(in->nresults ? in->nresults : 1, sizeof(*mv));
    if (mv == NULL)
        return -1;
    size_t n = 0;
    for (size_t i = 0; i < in->nresults; i++) {
        const Amaxd__V1__QuantizerResult *r = in->results[i];
        if (!r->has_previous || !(r->global_scale > 0) || !(r->previous_global_scale > 0))
            continue;
        mv[n].i = i;
        mv[n].moved = fabs(log2((double)r->global_scale / (double)r->previous_global_scale));
        n++;
    }
    if (n == 0) {
        fputs("<p>No quantizer has a previous epoch yet (the report needs two reconciled "
              "epochs).</p>\n",
              o);
        free(mv);
        return 0;
    }
    qsort(mv, n, sizeof(*mv), cmp_mover);
    size_t top = n < TOP_MOVERS ? n : TOP_MOVERS;
    fprintf(o,
            "<p>Global scale of epoch %llu against epoch %llu, the %zu largest moves of %zu "
            "quantizers, as log<sub>2</sub>(scale / previous scale): +1 means the scale "
            "doubled (amax halved).</p>\n",
            in->epoch, in->epoch - 1, top, n);
    bar_t *bars = calloc(top, sizeof(*bars));
    char(*labels)[8] = calloc(top, sizeof(*labels));
    char(*titles)[400] = calloc(top, sizeof(*titles));
    if (bars == NULL || labels == NULL || titles == NULL) {
        free(bars), free(labels), free(titles), free(mv);
        return -1;
    }
    for (size_t k = 0; k < top; k++) {
        const Amaxd__V1__QuantizerResult *r = in->results[mv[k].i];
        bars[k].v = log2((double)r->global_scale / (double)r->previous_global_scale);
        snprintf(labels[k], sizeof(labels[k]), "%zu", k + 1);
        snprintf(titles[k], sizeof(titles[k]), "%.300s: scale %.6g -> %.6g", r->name,
                 r->previous_global_scale, r->global_scale);
        bars[k].label = labels[k];
        bars[k].title = titles[k];
    }
    fputs("<figure>\n", o);
    svg_bars(o, "log2(scale / previous scale)", "log2 ratio", bars, top, 0, 1);
    fputs("</figure>\n<table>\n<tr><th>#</th><th>quantizer</th><th>format</th>"
          "<th>previous amax</th><th>amax</th><th>previous scale</th><th>scale</th>"
          "<th>log<sub>2</sub> ratio</th></tr>\n",
          o);
    for (size_t k = 0; k < top; k++) {
        const Amaxd__V1__QuantizerResult *r = in->results[mv[k].i];
        const Amaxd__V1__QuantizerInfo *q = in->list->quantizers[mv[k].i];
        fprintf(o, "<tr class=\"mover\"><td>%zu</td><td class=\"name\">", k + 1);
        html(o, r->name);
        fprintf(o,
                "</td><td>%s</td><td>%.6g</td><td>%.6g</td><td>%.6g</td><td>%.6g</td>"
                "<td class=\"ratio\">%+.3f</td></tr>\n",
                fmt_names[q->recipe && q->recipe->format <= 4 ? q->recipe->format : 0],
                r->previous_global_amax, r->global_amax, r->previous_global_scale, r->global_scale,
                bars[k].v);
    }
    fputs("</table>\n", o);
    free(bars), free(labels), free(titles), free(mv);
    return 0;
}

static void missing_table(FILE *o, const report_in_t *in)
{
    size_t total = 0;
    for (size_t i = 0; i < in->nresults; i++)
        total += in->results[i]->missing;
    fputs("<h2 id=\"missing\">Cells without data</h2>\n", o);
    if (total == 0) {
        fputs("<p class=\"ok\">None: every cell has an amax.</p>\n", o);
        return;
    }
    fprintf(o,
            "<p><b id=\"missing-total\">%zu</b> cells never had data and have no peer group to "
            "fill them: they read 0 and get the recipe's scale for 0.</p>\n<table>\n"
            "<tr><th>quantizer</th><th>cells without data</th><th>of</th></tr>\n",
            total);
    for (size_t i = 0; i < in->nresults; i++) {
        const Amaxd__V1__QuantizerResult *r = in->results[i];
        if (r->missing == 0)
            continue;
        fputs("<tr class=\"missing-row\"><td class=\"name\">", o);
        html(o, r->name);
        fprintf(o, "</td><td>%u</td><td>%zu</td></tr>\n", r->missing, ncells(r));
    }
    fputs("</table>\n", o);
}

static void all_table(FILE *o, const report_in_t *in)
{
    fputs("<h2 id=\"all\">Every quantizer</h2>\n<table>\n<tr><th>quantizer</th><th>shape</th>"
          "<th>format</th><th>global amax</th><th>global scale</th><th>min cell amax</th>"
          "<th>max cell amax</th></tr>\n",
          o);
    for (size_t i = 0; i < in->nresults; i++) {
        const Amaxd__V1__QuantizerResult *r = in->results[i];
        const Amaxd__V1__QuantizerInfo *q = in->list->quantizers[i];
        float lo = INFINITY, hi = -INFINITY;
        for (size_t c = 0; c < ncells(r); c++) {
            float v = f32(&r->amax, c);
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        fputs("<tr class=\"q\"><td class=\"name\">", o);
        html(o, r->name);
        fputs("</td><td>[", o);
        for (size_t d = 0; d < r->n_shape; d++)
            fprintf(o, d ? ", %u" : "%u", r->shape[d]);
        fprintf(o,
                "]</td><td>%s</td><td class=\"gamax\">%.9g</td><td>%.9g</td><td>%.6g</td>"
                "<td>%.6g</td></tr>\n",
                fmt_names[q->recipe && q->recipe->format <= 4 ? q->recipe->format : 0],
                r->global_amax, r->global_scale, ncells(r) ? lo : 0, ncells(r) ? hi : 0);
    }
    fputs("</table>\n", o);
}

int report_write(FILE *o, const report_in_t *in)
{
    char when[64];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", &tm);
    fputs("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>amaxd "
          "calibration report: ",
          o);
    html(o, in->job);
    fputs("</title>\n<style>\n"
          "body{font-family:sans-serif;margin:2em;color:#222;max-width:1100px}\n"
          "table{border-collapse:collapse;margin:0.5em 0 1.5em}\n"
          "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}\n"
          "td.name{text-align:left;font-family:monospace}\n"
          "th{background:#f0f0f0}\nfigure{margin:0.5em 0}\n"
          ".cold{color:#c57f12;font-weight:bold}\n.ok{color:#2a7a2a}\n"
          "dl{display:grid;grid-template-columns:max-content auto;gap:2px 16px}\n"
          "dt{font-weight:bold}\n"
          "</style>\n</head>\n<body>\n<h1>Calibration report: <span id=\"job\">",
          o);
    html(o, in->job);
    fputs("</span></h1>\n<dl>\n", o);
    fprintf(o, "<dt>last reconciled epoch</dt><dd id=\"epoch\">%llu</dd>\n", in->epoch);
    fprintf(o, "<dt>quantizers</dt><dd id=\"quantizers\">%zu</dd>\n", in->nresults);
    if (in->js != NULL)
        fprintf(o,
                "<dt>cells</dt><dd>%llu</dd>\n<dt>world size</dt><dd>%u</dd>\n"
                "<dt>epochs failed</dt><dd>%llu</dd>\n",
                (unsigned long long)in->js->cells, in->js->world_size,
                (unsigned long long)in->js->epochs_failed);
    if (in->status != NULL) {
        fputs("<dt>daemon</dt><dd>amaxd ", o);
        html(o, in->status->version);
        fputs(", backend ", o);
        html(o, in->status->backend);
        fputs(", collective ", o);
        html(o, in->status->collective);
        fputs("</dd>\n", o);
    }
    fprintf(o, "<dt>generated</dt><dd>%s by amaxctl report</dd>\n</dl>\n", when);
    fputs("<p><a href=\"#layers\">per layer</a> &middot; <a href=\"#experts\">per expert</a> "
          "&middot; <a href=\"#cold\">cold experts</a> &middot; <a href=\"#movers\">scales that "
          "moved</a> &middot; <a href=\"#missing\">cells without data</a> &middot; <a "
          "href=\"#all\">every quantizer</a></p>\n",
          o);
    if (per_layer(o, in) != 0 || per_expert(o, in) != 0)
        return -1;
    cold_table(o, in);
    if (movers(o, in) != 0)
        return -1;
    missing_table(o, in);
    all_table(o, in);
    fputs("</body>\n</html>\n", o);
    return 0;
}
