/*
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * The filter's read counts (block/pageshare-count.c) outside QEMU: the
 * space-saving invariants against exact counts on random streams, then
 * what counting costs the read path per block.  Built and run by
 * qemu-patches/count_test.py against the build's work tree.
 */

#include "pageshare-count.c"
#include <pthread.h>
#include <time.h>

static uint32_t rng = 1;
static uint32_t xr(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 17;
    rng ^= rng << 5;
    return rng;
}

static void check_heap(PSHeavy *h)
{
    for (unsigned i = 1; i < h->used; i++) {
        assert(h->heap[(i - 1) / PS_HH_ARITY].count <= h->heap[i].count);
    }
    unsigned filled = 0;
    for (unsigned i = 0; i < (1u << PS_HH_SLOT_BITS); i++) {
        if (h->slot[i]) {
            filled++;
            assert(h->heap[h->slot[i] - 1].slot == i);
        }
    }
    assert(filled == h->used);
    for (unsigned i = 0; i < h->used; i++) {
        unsigned sl;
        assert(ps_hh_find(h, h->heap[i].block, &sl) == i + 1);
    }
}

static BDRVPageshareState s;
static PSHHReport out[PS_HH_K];

static void check(void)
{
    for (int round = 0; round < 40; round++) {
        unsigned nblocks = round % 3 ? 50 + xr() % 20000 : 11 + xr() % 1000;
        unsigned n = 1000 + xr() % 60000;
        uint32_t *truth = g_new0(uint32_t, nblocks);
        for (unsigned i = 0; i < n; i++) {
            /* skewed: a few heavy blocks */
            unsigned b = (xr() % 4 == 0) ? xr() % 10 : xr() % nblocks;
            truth[b]++;
            ps_count_unlisted(&s, b, 1);
            if (i % 997 == 0) {
                check_heap(&s.heavy[0]);
            }
        }
        check_heap(&s.heavy[0]);
        bool ev;
        int m = ps_hh_drain(&s.heavy[0], out, &ev);
        assert(m >= 0);
        uint32_t *got = g_new0(uint32_t, nblocks);
        for (int i = 0; i < m; i++) {
            assert(out[i].block < nblocks);
            got[out[i].block] = out[i].reads;
            assert(i == 0 || out[i - 1].reads >= out[i].reads);
        }
        double bound = (double)n / PS_HH_K;
        for (unsigned b = 0; b < nblocks; b++) {
            assert(got[b] <= truth[b]);
            assert(truth[b] - got[b] <= bound);
            assert(ev || got[b] == truth[b]);
            if (truth[b] > bound) {
                assert(got[b] > 0);
            }
        }
        g_free(truth);
        g_free(got);
    }
}

static double now(void)
{
    struct timespec t;

    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

/* ns per block of the read path's counting, best of 5 */
static double run(int kind)
{
    const unsigned n = 4000000;
    double best = 1e9;
    static unsigned long seen[16384 * 2 / 64];
    PSTable t = { .seen = seen };
    for (int r = 0; r < 5; r++) {
        bool ev;
        ps_hh_drain(&s.heavy[0], out, &ev);
        double t0 = now();
        for (unsigned i = 0; i < n; i++) {
            if (kind == 0) {
                ps_count_unlisted(&s, i % 16384, 1);
            } else if (kind == 1) {
                ps_count_unlisted(&s, i % 500, 1);
            } else if (kind == 2 && i % 32 == 0) {
                ps_count_unlisted(&s, i % 16384, 0xffffffffULL);
            } else if (kind == 3) {
                ps_mark_listed(&t, (i * 2) % 32768);
            }
        }
        double d = (now() - t0) / n * 1e9;
        best = d < best ? d : best;
    }
    return best;
}

/* threads reading at once: every read counted once, in some shard */
#define THREAD_READS 2000000

static void *reader(void *arg)
{
    uintptr_t seed = (uintptr_t)arg;

    for (unsigned i = 0; i < THREAD_READS; i++) {
        ps_count_unlisted(&s, (seed * 7919 + i) % 300, 1);
    }
    return NULL;
}

static void threads(unsigned nthreads)
{
    pthread_t th[8];
    uint64_t total = 0, lost0 = stat64_get(&s.stats.feedback_lost);

    for (unsigned i = 0; i < PS_HH_SHARDS; i++) {
        bool ev;

        ps_hh_drain(&s.heavy[i], out, &ev);
    }
    for (uintptr_t i = 0; i < nthreads; i++) {
        pthread_create(&th[i], NULL, reader, (void *)i);
    }
    for (unsigned i = 0; i < nthreads; i++) {
        pthread_join(th[i], NULL);
    }
    for (unsigned i = 0; i < PS_HH_SHARDS; i++) {
        bool ev;
        int m = ps_hh_drain(&s.heavy[i], out, &ev);

        assert(m >= 0 && !ev);
        for (int j = 0; j < m; j++) {
            total += out[j].reads;
        }
    }
    /* 300 blocks fit a shard: exact, nothing lost while shards are free */
    assert(total + stat64_get(&s.stats.feedback_lost) - lost0 ==
           (uint64_t)nthreads * THREAD_READS);
}

int main(void)
{
    s.heavy = g_malloc0(sizeof(PSHeavy) * PS_HH_SHARDS);
    check();
    printf("invariants hold\n");
    printf("4 KiB reads over 16384 distinct blocks (each replaces an entry): "
           "%.1f ns per block\n", run(0));
    printf("4 KiB reads over 500 blocks (each finds its entry): "
           "%.1f ns per block\n", run(1));
    printf("128 KiB reads over 16384 distinct blocks: %.1f ns per block\n",
           run(2));
    printf("listed blocks, bit already set: %.1f ns per block\n", run(3));
    for (unsigned n = 1; n <= 6; n++) {
        uint64_t lost = stat64_get(&s.stats.feedback_lost);
        threads(n);
        printf("%u threads counting at once, 2M reads each in a tight loop: "
               "%" PRIu64 " reads lost (every shard held), the rest counted "
               "exactly\n", n, stat64_get(&s.stats.feedback_lost) - lost);
    }
    printf("sizeof(PSHeavy) = %zu\n", sizeof(PSHeavy));
    return 0;
}
