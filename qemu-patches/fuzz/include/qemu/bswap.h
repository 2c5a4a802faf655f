/*
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Stand-in for QEMU's qemu/bswap.h: little-endian loads (the fuzzer runs
 * on x86_64, like the filter).
 */
#ifndef FUZZ_QEMU_BSWAP_H
#define FUZZ_QEMU_BSWAP_H
#include <stdint.h>
#include <string.h>
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the table fuzzer assumes a little-endian host"
#endif
static inline uint32_t ldl_le_p(const void *p)
{
    uint32_t v;

    memcpy(&v, p, sizeof(v));
    return v;
}

static inline uint64_t ldq_le_p(const void *p)
{
    uint64_t v;

    memcpy(&v, p, sizeof(v));
    return v;
}

static inline uint64_t le64_to_cpu(uint64_t v)
{
    return v;
}
#endif
