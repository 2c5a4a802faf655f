/*
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * libFuzzer target: what a page server sends the pageshare filter.
 *
 * Input: a TABLE message payload (the first PS_TABLE_MSG_SIZE bytes) and
 * the table memfd's contents (the rest), exactly as the filter gets them.
 * Whatever the bytes, ps_table_parse_msg() and ps_table_check() must not
 * read outside them (ASan: the memfd is a heap copy of exactly its size),
 * and a table they accept must be safe for the read path:
 *   - a lookup of any block ends after at most max_probe + 1 buckets
 *     (the old unbounded loop spun forever on a full table);
 *   - it returns 0 or the address the server's layout gives that block,
 *     arena + 4096 * block, for a block inside the image;
 *   - every key in the buckets is found by its lookup, or the lookup says
 *     "not listed" (never another block's address).
 *
 * Built and run by tests/qemu/test_qemu_table_fuzz.py against the patched
 * tree's block/pageshare-table.c.
 */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>

#include "qemu/osdep.h"
#include "qemu/bswap.h"
#include "pageshare-table.h"

static uint64_t probes;

static uint64_t counted_lookup(const PSTableView *v, uint64_t block)
{
    /* the same walk as ps_table_lookup(), counting buckets read */
    const uint64_t key = block + 1;
    uint64_t i = (key * 0x9E3779B97F4A7C15ULL) >> v->shift;

    for (uint64_t n = 0; n <= v->max_probe; n++) {
        uint64_t k = le64_to_cpu(v->buckets[i].key);

        probes++;
        if (k == 0) {
            return 0;
        }
        if (k == key) {
            return le64_to_cpu(v->buckets[i].addr);
        }
        i = (i + 1) & v->mask;
    }
    return 0;
}

static void check_block(const PSTableView *v, const PSTableInfo *info,
                        uint64_t arena, uint64_t block)
{
    uint64_t got = ps_table_lookup(v, block);

    assert(got == counted_lookup(v, block));
    if (got) {
        assert(block < info->image_size / PS_BLOCK_SIZE);
        assert(got == arena + block * PS_BLOCK_SIZE);
    }
}

/* PS_FUZZ_REPORT set: say per input what the filter would do with it */
static void report(const char *verdict)
{
    static int on = -1;

    if (on < 0) {
        on = getenv("PS_FUZZ_REPORT") != NULL;
    }
    if (on) {
        fprintf(stderr, "PS-FUZZ-VERDICT %s\n", verdict ? verdict : "accepted");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    PSTableInfo info;
    PSTableView view;
    const char *why;
    uint8_t *map;
    size_t map_len;
    uint64_t arena, nb;

    if (size < PS_TABLE_MSG_SIZE) {
        report("short");
        return 0;
    }
    why = ps_table_parse_msg(data, PS_TABLE_MSG_SIZE, &info);
    if (why) {
        report(why);
        return 0;
    }
    map_len = size - PS_TABLE_MSG_SIZE;
    map = malloc(map_len ? map_len : 1);
    memcpy(map, data + PS_TABLE_MSG_SIZE, map_len);
    /*
     * The filter passes the memfd's fstat() size, which the check compares
     * with the message; a mutated byte there would only hide the rest.
     */
    info.memfd_size = map_len;
    why = ps_table_check(map, map_len, &info, info.image_size, &view);
    report(why);
    if (!why) {
        arena = ldq_le_p(map + 104);
        nb = view.mask + 1;
        assert(view.max_probe < nb);
        for (uint64_t i = 0; i < nb; i++) {
            uint64_t key = le64_to_cpu(view.buckets[i].key);

            if (key) {
                check_block(&view, &info, arena, key - 1);
            }
            check_block(&view, &info, arena, i);
            check_block(&view, &info, arena, ~i);
        }
        /* bounded: never more than nb + 1 buckets per lookup */
        assert(probes <= 2 * 3 * nb * (view.max_probe + 1));
        probes = 0;
    }
    free(map);
    return 0;
}
