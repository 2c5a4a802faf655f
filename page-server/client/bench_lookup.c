// SPDX-License-Identifier: GPL-2.0-only
/*
 * bench_lookup - connect to a pageshare-server image socket like QEMU would,
 * receive the TABLE message with its memfd and pidfd, check the table
 * against itself, and time lookups (hits and misses).
 *
 *   cc -O2 -Wall -Wextra -Werror -o bench_lookup bench_lookup.c
 *   ./bench_lookup /run/pageshare/debian12.sock [iterations [IMAGE]]
 *
 * With IMAGE, also checks that it is the file the server verified
 * (pst_msg_check_file(), the proof of identity).
 *
 * Prints one JSON line.
 */
#include "pageshare_table.h"

#include <stdlib.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>

static int recv_table(int s, struct pst_table_msg *msg, int *memfd, int *pidfd)
{
	char cbuf[CMSG_SPACE(2 * sizeof(int))];
	uint32_t hdr[2];
	struct iovec iov = { hdr, sizeof(hdr) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1,
			     .msg_control = cbuf, .msg_controllen = sizeof(cbuf) };
	struct cmsghdr *c;
	size_t got = 0;

	if (recvmsg(s, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL) != (ssize_t)sizeof(hdr))
		return -1;
	if (hdr[0] != PST_MSG_TABLE || hdr[1] != sizeof(*msg)) {
		fprintf(stderr, "expected TABLE, got type %u (%u bytes)\n", hdr[0], hdr[1]);
		return -1;
	}
	c = CMSG_FIRSTHDR(&mh);
	if (!c || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(2 * sizeof(int)))
		return -1;
	memcpy(memfd, CMSG_DATA(c), sizeof(int));
	memcpy(pidfd, CMSG_DATA(c) + sizeof(int), sizeof(int));
	while (got < sizeof(*msg)) {
		ssize_t n = recv(s, (char *)msg + got, sizeof(*msg) - got, 0);

		if (n <= 0)
			return -1;
		got += (size_t)n;
	}
	return 0;
}

#define QN (1u << 20)

static double now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static uint64_t xorshift(uint64_t *s)
{
	*s ^= *s << 13;
	*s ^= *s >> 7;
	*s ^= *s << 17;
	return *s;
}

int main(int argc, char **argv)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	struct pst_table_msg msg;
	struct pst_table t;
	uint64_t iters = argc > 2 ? strtoull(argv[2], NULL, 10) : 20000000;
	uint64_t *keys, *q, n = 0, i, seed = 88172645463325252ull, sum = 0, blocks, found = 0;
	int s, memfd, pidfd;
	char err[128];
	double t0, hit_ns, miss_ns;

	if (argc < 2 || strlen(argv[1]) >= sizeof(sa.sun_path)) {
		fprintf(stderr, "usage: %s SOCKET [iterations [IMAGE]]\n", argv[0]);
		return 2;
	}
	strcpy(sa.sun_path, argv[1]);
	s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (s < 0 || connect(s, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
		perror("connect");
		return 1;
	}
	if (recv_table(s, &msg, &memfd, &pidfd) < 0) {
		fprintf(stderr, "no table received\n");
		return 1;
	}
	if (msg.version != PST_TABLE_MSG_VERSION) {
		fprintf(stderr, "TABLE message version %u\n", msg.version);
		return 1;
	}
	if (argc > 3) {
		/* The proof of identity, checked like the QEMU filter does. */
		int img = open(argv[3], O_RDONLY | O_CLOEXEC);

		if (img < 0 || pst_msg_check_file(&msg, img, err, sizeof(err)) < 0) {
			fprintf(stderr, "%s: %s\n", argv[3], img < 0 ? strerror(errno) : err);
			return 1;
		}
		close(img);
	}
	if (pst_open(&t, memfd, err, sizeof(err)) < 0) {
		fprintf(stderr, "%s\n", err);
		return 1;
	}
	if (t.h->generation != msg.generation || t.h->entry_count != msg.entry_count) {
		fprintf(stderr, "message and table disagree\n");
		return 1;
	}
	/* Every bucket's entry must be found at its address. */
	keys = malloc(sizeof(*keys) * (t.h->entry_count + 1));
	if (!keys)
		return 1;
	for (i = 0; i < t.h->bucket_count; i++) {
		if (!t.b[i].key)
			continue;
		if (pst_lookup(&t, t.b[i].key - 1) != t.b[i].addr) {
			fprintf(stderr, "lookup of block %llu is wrong\n",
				(unsigned long long)(t.b[i].key - 1));
			return 1;
		}
		keys[n++] = t.b[i].key - 1;
	}
	if (n != t.h->entry_count || n == 0) {
		fprintf(stderr, "table has %llu entries, header says %llu\n",
			(unsigned long long)n, (unsigned long long)t.h->entry_count);
		return 1;
	}
	/* Query blocks are drawn before timing: only the lookups are timed. */
	q = malloc(sizeof(*q) * QN);
	if (!q)
		return 1;
	/* Hits: random listed blocks. */
	for (i = 0; i < QN; i++)
		q[i] = keys[xorshift(&seed) % n];
	t0 = now_ns();
	for (i = 0; i < iters; i++)
		sum += pst_lookup(&t, q[i & (QN - 1)]);
	hit_ns = (now_ns() - t0) / iters;
	/* Random blocks of the whole image: mostly misses, as in QEMU. */
	blocks = t.h->image_virtual_size / 4096;
	for (i = 0; i < QN; i++)
		q[i] = xorshift(&seed) % blocks;
	t0 = now_ns();
	for (i = 0; i < iters; i++) {
		uint64_t a = pst_lookup(&t, q[i & (QN - 1)]);

		found += a != 0;
		sum += a;
	}
	miss_ns = (now_ns() - t0) / iters;
	free(q);
	printf("{\"entries\": %llu, \"buckets\": %llu, \"table_bytes\": %zu, \"generation\": %llu, "
	       "\"server_pid\": %u, \"degraded\": %s, \"iterations\": %llu, \"hit_ns\": %.2f, "
	       "\"random_block_ns\": %.2f, \"random_found\": %llu, \"checksum\": %llu, "
	       "\"image_format\": %u, \"file_ino\": %llu, \"file_ctime_ns\": %lld}\n",
	       (unsigned long long)n, (unsigned long long)t.h->bucket_count, t.map_len,
	       (unsigned long long)t.h->generation, t.h->server_pid,
	       (t.h->flags & PST_FLAG_DEGRADED) ? "true" : "false", (unsigned long long)iters,
	       hit_ns, miss_ns, (unsigned long long)found, (unsigned long long)(sum & 0xffff),
	       msg.image_format, (unsigned long long)msg.file_ino, (long long)msg.file_ctime_ns);
	pst_close(&t);
	close(pidfd);
	close(memfd);
	close(s);
	free(keys);
	return 0;
}
