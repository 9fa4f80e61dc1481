/*
 * grow.h - the one array-growth rule: capacity doubles from a minimum until
 * it holds what is needed. Header only; any thread (on arrays its caller
 * owns).
 */
#ifndef AMX_GROW_H
#define AMX_GROW_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/*
 * Makes the array *(T **)pp of `elem`-byte elements, whose capacity is *cap,
 * hold at least `need` elements. New elements are zeroed when `zero`. 0, or
 * -1 when out of memory or too large (*pp and *cap unchanged).
 */
static inline int amx_grow(void *pp, size_t *cap, size_t need, size_t elem, size_t min, int zero)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : (min ? min : 1);
    while (c < need) {
        if (c > SIZE_MAX / 2)
            return -1;
        c *= 2;
    }
    if (c > SIZE_MAX / elem)
        return -1;
    void **p = (void **)pp;
    unsigned char *q = realloc(*p, c * elem);
    if (q == NULL)
        return -1;
    if (zero)
        memset(q + *cap * elem, 0, (c - *cap) * elem);
    *p = q;
    *cap = c;
    return 0;
}

#endif
