// SPDX-License-Identifier: GPL-2.0-only
/*
 * check_table - what pageshare_table.h makes of a table a server could send.
 *
 *   check_table SEED...
 *
 * Each SEED is a TABLE message followed by its table, as
 * qemu-patches/fuzz/make_seeds.py writes them.  The table is put in a
 * sealed memfd as the server would; pst_open() judges it, and for a table
 * it accepts every block of the image is looked up and compared with a
 * plain scan of the buckets.  Prints "SEED: VERDICT" per seed.  A lookup
 * that does not terminate is killed by alarm(): that is the bug the
 * bounded lookup fixes (every bucket taken, fewer entries claimed).
 */
#include "pageshare_table.h"

#include <stdlib.h>

#define MSG_SIZE 136

static int check(const char *path)
{
	char err[128];
	struct pst_table t;
	FILE *f = fopen(path, "rb");
	static unsigned char buf[1 << 24];
	size_t n;
	int fd;

	if (!f) {
		perror(path);
		return 2;
	}
	n = fread(buf, 1, sizeof(buf), f);
	fclose(f);
	if (n < MSG_SIZE) {
		fprintf(stderr, "%s: shorter than a TABLE message\n", path);
		return 2;
	}
	fd = memfd_create("pst-check", MFD_ALLOW_SEALING);
	if (fd < 0 || write(fd, buf + MSG_SIZE, n - MSG_SIZE) != (ssize_t)(n - MSG_SIZE) ||
	    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) < 0) {
		perror("memfd");
		return 2;
	}
	if (pst_open(&t, fd, err, sizeof(err)) < 0) {
		printf("%s: %s\n", path, err);
		close(fd);
		return 0;
	}
	for (uint64_t b = 0; b < t.h->image_virtual_size / 4096; b++) {
		uint64_t want = 0;

		for (uint64_t i = 0; i < t.h->bucket_count; i++)
			if (t.b[i].key == b + 1)
				want = t.b[i].addr;
		if (pst_lookup(&t, b) != want) {
			printf("%s: lookup of block %llu gave %#llx, the buckets hold %#llx\n", path,
			       (unsigned long long)b, (unsigned long long)pst_lookup(&t, b),
			       (unsigned long long)want);
			return 1;
		}
	}
	/* block UINT64_MAX is key 0, the empty-bucket marker: never listed */
	if (pst_lookup(&t, UINT64_MAX) != 0) {
		printf("%s: block 2^64-1 found\n", path);
		return 1;
	}
	printf("%s: accepted\n", path);
	pst_close(&t);
	close(fd);
	return 0;
}

int main(int argc, char **argv)
{
	int rc = 0;

	alarm(30);
	for (int i = 1; i < argc; i++)
		rc |= check(argv[i]);
	return rc;
}
