/*
 * report.h - the calibration report of one job: a self-contained HTML page
 * (inline CSS and SVG, no scripts, nothing fetched) with per-layer and
 * per-expert amax, cold experts filled from their peer group, and the
 * quantizers whose scale moved most between the last two epochs.
 */
#ifndef AMAXCTL_REPORT_H
#define AMAXCTL_REPORT_H

#include <stdio.h>

#include "amaxc.h"

/* What the report is made from; the answers are borrowed. `results` are the
 * job's whole tensors in the order of `list` (GetScales with global=true,
 * windows joined by the caller). */
typedef struct report_in {
    const char *job;
    const Amaxd__V1__StatusResponse *status; /* the daemon (and the job's entry) */
    const Amaxd__V1__JobStatus *js;
    const Amaxd__V1__ListQuantizersResponse *list;
    Amaxd__V1__QuantizerResult **results;
    size_t nresults;
    unsigned long long epoch; /* the last reconciled epoch */
} report_in_t;

/* Writes the page to `out`. Returns 0, or -1 when out of memory. */
int report_write(FILE *out, const report_in_t *in);

#endif
