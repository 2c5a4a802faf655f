/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * pageshare_table.h - header-only C reader for pageshare-server tables.
 *
 * The page server sends, per base image, a sealed read-only memfd holding an
 * open-addressing hash table from 4 KiB block number (sector / 8) to the
 * address of that block in the server (page-server/PROTOCOL.md).  This
 * header validates and maps such a memfd and looks blocks up; it is the
 * reference for QEMU's pageshare filter.  No allocation, no locking: a
 * mapped table is immutable.
 *
 *   struct pst_table t;
 *   char err[128];
 *   if (pst_open(&t, memfd, err, sizeof(err)) < 0) ... err ...
 *   uint64_t src = pst_lookup(&t, offset >> 12);   // 0: not listed
 *   pst_close(&t);
 */
#ifndef PAGESHARE_TABLE_H
#define PAGESHARE_TABLE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PST_MAGIC "PSTABLE1"
#define PST_VERSION 1u
#define PST_HEADER_SIZE 128u
#define PST_HASH_MULT 0x9E3779B97F4A7C15ull
#define PST_FLAG_DEGRADED 1u

/* Message types on the image socket (PROTOCOL.md). */
#define PST_MSG_TABLE 1u
#define PST_MSG_NO_TABLE 2u
#define PST_MSG_BYE 3u
#define PST_MSG_SWITCHED 16u
#define PST_MSG_STATS 17u
#define PST_MSG_READS 18u
#define PST_MSG_LISTED_READ 19u

struct pst_header {            /* little endian, 128 bytes */
	char magic[8];
	uint32_t version;
	uint32_t header_size;
	uint64_t generation;
	uint64_t image_virtual_size;
	uint8_t image_content_sha256[32];
	uint64_t entry_count;
	uint64_t bucket_count;
	uint32_t bucket_bits;
	uint32_t block_size;
	uint64_t buckets_offset;
	uint32_t server_pid;
	uint32_t flags;
	uint64_t arena_base;
	uint64_t arena_len;
	uint64_t reserved;
};
_Static_assert(sizeof(struct pst_header) == PST_HEADER_SIZE, "header layout");

struct pst_bucket {
	uint64_t key;                  /* block + 1; 0 = empty */
	uint64_t addr;                 /* address in the server */
};

/* Payload of a TABLE message, version 2 (136 bytes); fds: [table memfd,
 * server pidfd].  Little endian. */
#define PST_TABLE_MSG_VERSION 2u
#define PST_FORMAT_RAW 1u
#define PST_FORMAT_QCOW2 2u
#define PST_PROOF_FILE 1u              /* file_* fields are valid */
struct pst_table_msg {
	uint32_t version;              /* PST_TABLE_MSG_VERSION */
	uint32_t flags;                /* PST_FLAG_DEGRADED */
	uint64_t generation;
	uint64_t entry_count;
	uint64_t table_bytes;
	uint64_t image_virtual_size;
	uint8_t image_content_sha256[32];
	uint32_t server_pid;
	uint32_t image_format;         /* PST_FORMAT_*: how the server read it */
	uint64_t published_at_bits;    /* IEEE-754 double, Unix seconds */
	uint32_t proof_flags;          /* PST_PROOF_FILE */
	uint32_t reserved;
	/* The image file the server verified, unchanged since (fstat()). */
	uint64_t file_dev;             /* st_dev */
	uint64_t file_ino;             /* st_ino */
	uint64_t file_size;            /* st_size (file size, not virtual size) */
	int64_t file_mtime_ns;         /* st_mtim: sec * 1000000000 + nsec */
	int64_t file_ctime_ns;         /* st_ctim: sec * 1000000000 + nsec */
} __attribute__((packed));
_Static_assert(sizeof(struct pst_table_msg) == 136, "TABLE payload layout");

/**
 * pst_msg_check_file - is @fd the very file the server verified, unchanged?
 * @m:      a TABLE message
 * @fd:     the client's open descriptor of its base image file
 * @err:    message on failure
 * @errlen: size of @err
 *
 * The proof of identity (PROTOCOL.md): same st_dev and st_ino, and the same
 * st_size, mtime and ctime to the nanosecond.  Re-check it (it is one
 * fstat()) before trusting the table again after any pause: a change of the
 * file changes its ctime.
 *
 * Return: 0 if it matches, -1 with @err set if not (do not use the table).
 */
static inline int pst_msg_check_file(const struct pst_table_msg *m, int fd, char *err, size_t errlen)
{
	struct stat st;

	if (m->version != PST_TABLE_MSG_VERSION || !(m->proof_flags & PST_PROOF_FILE)) {
		snprintf(err, errlen, "TABLE v%u without a file proof", m->version);
		return -1;
	}
	if (fstat(fd, &st) < 0) {
		snprintf(err, errlen, "fstat: %s", strerror(errno));
		return -1;
	}
	if ((uint64_t)st.st_dev != m->file_dev || (uint64_t)st.st_ino != m->file_ino) {
		snprintf(err, errlen, "not the file the server verified");
		return -1;
	}
	if ((uint64_t)st.st_size != m->file_size ||
	    (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec != m->file_mtime_ns ||
	    (int64_t)st.st_ctim.tv_sec * 1000000000 + st.st_ctim.tv_nsec != m->file_ctime_ns) {
		snprintf(err, errlen, "the file changed since the server verified it");
		return -1;
	}
	return 0;
}

struct pst_table {
	const void *map;
	size_t map_len;
	const struct pst_header *h;
	const struct pst_bucket *b;
	uint64_t mask;
	uint64_t max_probe;            /* longest distance of an entry from its home */
	unsigned int shift;            /* 64 - bucket_bits */
};

/* pst_open()'s walk over every bucket; fills t->max_probe. */
static inline int pst_check_buckets(struct pst_table *t, char *err, size_t errlen)
{
	const struct pst_header *h = t->h;
	const uint64_t image_blocks = h->image_virtual_size / 4096;
	uint64_t found = 0, max_probe = 0;

	if (h->arena_base % 4096 || h->arena_len / 4096 < image_blocks ||
	    h->arena_base > UINT64_MAX - h->arena_len) {
		snprintf(err, errlen, "malformed table: bad arena");
		return -1;
	}
	for (uint64_t i = 0; i < h->bucket_count; i++) {
		const uint64_t key = t->b[i].key;
		uint64_t home;

		if (!key)
			continue;
		if (key - 1 >= image_blocks || t->b[i].addr != h->arena_base + (key - 1) * 4096) {
			snprintf(err, errlen, "malformed table: an entry outside the image or arena");
			return -1;
		}
		home = (key * PST_HASH_MULT) >> t->shift;
		if (((i - home) & t->mask) > max_probe)
			max_probe = (i - home) & t->mask;
		found++;
	}
	if (found != h->entry_count) {
		snprintf(err, errlen, "malformed table: entry count does not match the buckets");
		return -1;
	}
	t->max_probe = max_probe;
	return 0;
}

/**
 * pst_open - validate and map a table memfd.
 * @t:      filled on success
 * @memfd:  the table memfd from a TABLE message (not consumed)
 * @err:    message on failure
 * @errlen: size of @err
 *
 * Checks the seals (a table that could shrink would SIGBUS a reader), the
 * size, magic, version and geometry, and then every bucket once, as QEMU's
 * filter does (block/pageshare-table.c): each key a block of the image,
 * each address the one the layout gives it (arena_base + 4096 * block), and
 * exactly entry_count of them.  The table comes from another process, so it
 * is input: a header that claims fewer entries than the buckets hold (every
 * bucket taken) would otherwise make pst_lookup() spin forever.  The
 * longest probe found bounds every lookup.  The caller should also compare
 * image_virtual_size (and the content sha256 if known) with its base image.
 *
 * Return: 0, or -1 with @err set.
 */
static inline int pst_open(struct pst_table *t, int memfd, char *err, size_t errlen)
{
	const int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE;
	struct stat st;
	const struct pst_header *h;
	void *map;
	int seals;

	memset(t, 0, sizeof(*t));
	seals = fcntl(memfd, F_GET_SEALS);
	if (seals < 0 || (seals & need) != need) {
		snprintf(err, errlen, "table memfd is not sealed (seals %#x)", seals);
		return -1;
	}
	if (fstat(memfd, &st) < 0 || (uint64_t)st.st_size < PST_HEADER_SIZE) {
		snprintf(err, errlen, "table memfd too small");
		return -1;
	}
	map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, memfd, 0);
	if (map == MAP_FAILED) {
		snprintf(err, errlen, "mmap: %s", strerror(errno));
		return -1;
	}
	h = (const struct pst_header *)map;
	if (memcmp(h->magic, PST_MAGIC, 8) || h->version != PST_VERSION ||
	    h->header_size != PST_HEADER_SIZE || h->block_size != 4096 ||
	    h->buckets_offset != PST_HEADER_SIZE || h->bucket_bits < 4 || h->bucket_bits > 40 ||
	    h->bucket_count != (1ull << h->bucket_bits) ||
	    h->entry_count * 2 > h->bucket_count ||
	    (uint64_t)st.st_size < PST_HEADER_SIZE + 16 * h->bucket_count) {
		snprintf(err, errlen, "bad table header");
		munmap(map, (size_t)st.st_size);
		return -1;
	}
	t->map = map;
	t->map_len = (size_t)st.st_size;
	t->h = h;
	t->b = (const struct pst_bucket *)((const char *)map + PST_HEADER_SIZE);
	t->mask = h->bucket_count - 1;
	t->shift = 64 - h->bucket_bits;
	if (pst_check_buckets(t, err, errlen) < 0) {
		munmap(map, (size_t)st.st_size);
		memset(t, 0, sizeof(*t));
		return -1;
	}
	return 0;
}

/**
 * pst_lookup - server address of a 4 KiB block.
 * @t:     an open table
 * @block: byte offset in the virtual disk >> 12 (sector / 8)
 *
 * Return: the address to pass as merge_page_vec.src, or 0 if not listed.
 * Reads at most max_probe + 1 buckets, whatever the table holds.
 */
static inline uint64_t pst_lookup(const struct pst_table *t, uint64_t block)
{
	const uint64_t key = block + 1;
	uint64_t i = (key * PST_HASH_MULT) >> t->shift;

	if (key == 0)                  /* 0 marks an empty bucket, never a block */
		return 0;
	for (uint64_t n = 0; n <= t->max_probe; n++) {
		const struct pst_bucket *b = &t->b[i];

		if (b->key == key)
			return b->addr;
		if (b->key == 0)
			return 0;
		i = (i + 1) & t->mask;
	}
	return 0;
}

static inline void pst_close(struct pst_table *t)
{
	if (t->map)
		munmap((void *)t->map, t->map_len);
	memset(t, 0, sizeof(*t));
}

#endif /* PAGESHARE_TABLE_H */
