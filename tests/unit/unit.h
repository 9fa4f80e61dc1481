/*
 * unit.h - what several Check files of tests/unit share: an assertion that
 * a message holds a phrase (printing both), and a spec builder for tests
 * that need a catalog without going through amx_qspec_parse.
 */
#ifndef AMX_TEST_UNIT_H
#define AMX_TEST_UNIT_H

#include <check.h>
#include <string.h>

#include "catalog.h"

/* `s` contains `sub`; on failure both are printed. */
#define AMX_ASSERT_HAS(s, sub)                                                                     \
    ck_assert_msg(strstr((s), (sub)) != NULL, "'%s' does not contain '%s'", (s), (sub))

/* An owned FP8 E4M3 current-scaling, running-max spec of `n` cells (0: a
 * scalar), in peer group `peer` (NULL: none) with PEER_FILL. */
static inline amx_qspec_t *unit_spec(const char *name, uint32_t n, const char *peer)
{
    amx_qspec_t s;
    memset(&s, 0, sizeof(s));
    s.name = (char *)name;
    s.ndim = n ? 1 : 0;
    s.shape[0] = n;
    s.ncells = n ? n : 1;
    s.recipe.format = AMX_FMT_FP8_E4M3;
    s.recipe.rule = AMX_RULE_CURRENT;
    s.recipe.history_len = 1;
    s.recipe.history_reduce = AMX_HIST_MAX;
    s.recipe.output_convention = AMX_OUT_TE;
    s.recipe.scaled_max = 448.0f;
    s.accumulation = AMX_ACC_RUNNING_MAX;
    s.peer_group = (char *)(peer ? peer : "");
    s.peer_mode = peer ? AMX_PEER_FILL : 0;
    s.scale_group = "";
    amx_qspec_t *d = amx_qspec_dup(&s);
    ck_assert_ptr_nonnull(d);
    return d;
}

#endif
