/*
 * SPDX-License-Identifier: GPL-2.0-or-later
 *
 * Stand-in for QEMU's qemu/osdep.h, so that block/pageshare-table.c (pure
 * functions over bytes) builds alone for the fuzzer: only what it uses.
 */
#ifndef FUZZ_QEMU_OSDEP_H
#define FUZZ_QEMU_OSDEP_H
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#endif
