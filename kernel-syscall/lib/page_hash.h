/* SPDX-License-Identifier: LGPL-2.1-or-later */
/*
 * page_hash.h - the 64-bit content hash of a 4 KiB page that the end-to-end
 * benchmark's sampler classifies guest pages by (its HASHFILE holds the
 * listed blocks' hashes; bench/e2e_vs_ksm.py computes the same in Python,
 * page_hash()), and that the filter test writes such a file with.
 *
 * FNV-1a over the page's little-endian 64-bit words.  A classifier, not a
 * proof: a collision only moves a page between classes.
 */
#ifndef PAGESHARE_PAGE_HASH_H
#define PAGESHARE_PAGE_HASH_H

#include <stddef.h>
#include <stdint.h>

static inline uint64_t page_hash(const uint64_t *w)
{
	uint64_t h = 0xcbf29ce484222325ULL;

	for (size_t i = 0; i < 4096 / 8; i++) {
		h ^= w[i];
		h *= 0x100000001b3ULL;
	}
	return h;
}

#endif /* PAGESHARE_PAGE_HASH_H */
