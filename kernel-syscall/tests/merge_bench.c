// SPDX-License-Identifier: GPL-2.0-only
/*
 * merge_bench: the talk's first evaluation, "read 4 KiB vs merge_page",
 * plus merge_pages() per page at several batch sizes.
 *
 * Runs as root inside the test VM (plain kernel config).  Every call is
 * timed on its own with CLOCK_MONOTONIC; the table reports mean, median and
 * p99 over REPS calls, and the ratio of each mean to pread's.  The cost of
 * reading the clock is measured and reported, not subtracted.
 *
 * - pread: 4 KiB from a warm page-cache file (tmpfs) into a pre-faulted
 *   buffer, at a different offset each call.
 * - merge_page, dst anon: into pre-faulted private anon pages, each used
 *   once; the source pages are KSM pages already (steady state).
 * - merge_page, dst none: the same into pages never touched.
 * - merge_page, first time: the source page becomes a KSM page in the call.
 * - merge_pages, batch B: B pages per call (dst anon, sources already KSM),
 *   time per page; at least 1000 pages and 200 calls per batch size.
 * - merge_page of a source page that is already mapped 150-199 times.
 * - taking 64 pages away: munmap() of anon or of merged pages, and a write
 *   (CoW) to merged pages, per page.
 *
 * The server is a child process on another CPU; ksmd runs with
 * pages_to_scan=0 (merge_page needs it running, but it scans nothing).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ksm_sysfs.h"
#include "merge_page.h"

#define REPS	1000
#define PS	4096UL

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

static inline uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000ULL + ts.tv_nsec;
}

struct stat_row {
	const char *name;
	double mean, median, p99;	/* microseconds */
	int n;
};

static struct stat_row summarize(const char *name, double *us, int n)
{
	struct stat_row r = { .name = name, .n = n };
	double sum = 0;

	for (int i = 0; i < n; i++)
		sum += us[i];
	qsort(us, n, sizeof(*us), cmp_double);
	r.mean = sum / n;
	r.median = us[n / 2];
	r.p99 = us[(int)(n * 0.99) < n ? (int)(n * 0.99) : n - 1];
	return r;
}

static void pin_cpu(int cpu)
{
	cpu_set_t set;

	CPU_ZERO(&set);
	CPU_SET(cpu, &set);
	sched_setaffinity(0, sizeof(set), &set);
}

/* A server child: npages published pages, each with distinct content. */
static pid_t start_server(size_t npages, char **base_out)
{
	int p[2];
	pid_t pid;

	if (pipe(p))
		return -1;
	pid = fork();
	if (!pid) {
		char *base;

		prctl(PR_SET_PDEATHSIG, SIGKILL);
		pin_cpu(1);
		base = mmap(NULL, npages * PS, PROT_READ | PROT_WRITE,
			    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (base == MAP_FAILED)
			_exit(1);
		madvise(base, npages * PS, MADV_NOHUGEPAGE);
		for (size_t i = 0; i < npages; i++)
			for (size_t k = 0; k < PS / 8; k++)
				((uint64_t *)(base + i * PS))[k] = (i << 32) ^ k ^ 0xabcdef;
		if (madvise(base, npages * PS, MADV_ALLOWMERGED))
			_exit(2);
		if (write(p[1], &base, sizeof(base)) != sizeof(base))
			_exit(3);
		pause();
		_exit(0);
	}
	close(p[1]);
	if (read(p[0], base_out, sizeof(*base_out)) != sizeof(*base_out))
		return -1;
	close(p[0]);
	return pid;
}

static char *client_area(size_t npages, int touch)
{
	char *p = mmap(NULL, npages * PS, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

	if (p == MAP_FAILED)
		return NULL;
	madvise(p, npages * PS, MADV_NOHUGEPAGE);
	madvise(p, npages * PS, MADV_MERGEABLE);
	if (touch)
		for (size_t i = 0; i < npages; i++)
			p[i * PS] = 1;
	return p;
}

static void die(const char *what)
{
	fprintf(stderr, "merge_bench: %s: %s\n", what, strerror(errno));
	exit(1);
}

/*
 * REPS single merge_page() calls from the server's pages into a fresh
 * client area (its pages touched or not), each timed on its own.
 */
static struct stat_row time_merge_page(int pidfd, char *srv, size_t npages,
				       int touch, double *us, const char *what)
{
	char *dst = client_area(npages, touch);
	uint64_t t0, t1;

	if (!dst)
		die("mmap");
	for (int i = 0; i < REPS; i++) {
		t0 = now_ns();
		if (merge_page_fd(pidfd, srv + i * PS, dst + i * PS, 0))
			die(what);
		t1 = now_ns();
		us[i] = (t1 - t0) / 1000.0;
	}
	munmap(dst, npages * PS);
	return summarize(what, us, REPS);
}

int main(void)
{
	static double us[REPS * 64];
	struct stat_row rows[16];
	int nrows = 0, fd, pidfd;
	char *srv, *dst, buf_store[2 * PS], *buf;
	size_t npages = REPS;
	uint64_t t0, t1, clock_ns;
	pid_t server;

	pin_cpu(0);
	/* ksmd must run for merge_page(), but scans nothing (and sleeps). */
	if (ksm_sysfs_set("sleep_millisecs", 20) || ksm_sysfs_set("pages_to_scan", 0) ||
	    ksm_sysfs_set("run", 1))
		die("ksm sysfs");

	/* Clock overhead, for the reader. */
	t0 = now_ns();
	for (int i = 0; i < REPS; i++)
		t1 = now_ns();
	clock_ns = (t1 - t0) / REPS;

	/* pread from a warm tmpfs file. */
	fd = open("/tmp/merge_bench.dat", O_RDWR | O_CREAT | O_TRUNC, 0600);
	if (fd < 0)
		die("open");
	buf = (char *)(((uintptr_t)buf_store + PS - 1) & ~(PS - 1));
	memset(buf, 0x5a, PS);
	for (size_t i = 0; i < npages; i++)
		if (pwrite(fd, buf, PS, i * PS) != (ssize_t)PS)
			die("pwrite");
	for (size_t i = 0; i < npages; i++)
		if (pread(fd, buf, PS, i * PS) != (ssize_t)PS)
			die("pread warm");
	for (int i = 0; i < REPS; i++) {
		t0 = now_ns();
		if (pread(fd, buf, PS, (i % npages) * PS) != (ssize_t)PS)
			die("pread");
		t1 = now_ns();
		us[i] = (t1 - t0) / 1000.0;
	}
	rows[nrows++] = summarize("pread 4 KiB (page cache)", us, REPS);

	server = start_server(npages, &srv);
	if (server < 0)
		die("server");
	pidfd = syscall(__NR_pidfd_open, server, 0);
	if (pidfd < 0)
		die("pidfd_open");

	/*
	 * First time: each call also turns the server page into a KSM page.
	 * Then the steady state, into touched and into untouched pages.
	 */
	rows[nrows++] = time_merge_page(pidfd, srv, npages, 1, us,
					"merge_page, source made KSM in the call");
	rows[nrows++] = time_merge_page(pidfd, srv, npages, 1, us,
					"merge_page, dst anon page");
	rows[nrows++] = time_merge_page(pidfd, srv, npages, 0, us,
					"merge_page, dst not faulted");

	/* merge_pages at batch sizes 1, 8, 32, 64: per page, dst anon. */
	{
		static const unsigned int batches[] = { 1, 8, 32, 64 };
		static char names[4][64];
		struct merge_page_vec vec[64];

		for (int b = 0; b < 4; b++) {
			unsigned int bs = batches[b];
			/* At least REPS pages and 200 calls per batch size. */
			int calls = REPS / bs + (REPS % bs ? 1 : 0);
			size_t n;

			if (calls < 200)
				calls = 200;
			n = (size_t)calls * bs;
			dst = client_area(n, 1);
			if (!dst)
				die("mmap");
			for (int c = 0; c < calls; c++) {
				for (unsigned int k = 0; k < bs; k++) {
					size_t j = (size_t)c * bs + k;

					vec[k].src = (uintptr_t)(srv + (j % npages) * PS);
					vec[k].dst = (uintptr_t)(dst + j * PS);
				}
				t0 = now_ns();
				if (merge_pages_fd(pidfd, vec, bs, 0) != (long)bs)
					die("merge_pages");
				t1 = now_ns();
				us[c] = (t1 - t0) / 1000.0 / bs;
			}
			snprintf(names[b], sizeof(names[b]), "merge_pages, batch %u, per page", bs);
			rows[nrows++] = summarize(names[b], us, calls);
			munmap(dst, n * PS);
		}
	}

	/*
	 * merge_pages at batch 32 with each destination in a page table of
	 * its own (2 MiB apart): the kernel maps destinations that share a
	 * page table as one run (one PTL hold, one TLB flush), so the rows
	 * above are its best case and this one its worst.  The same 32 pages
	 * every call, made anon again (CoW) between calls, untimed.
	 */
	{
		enum { BS = 32, CALLS = 200, STRIDE = 512 };
		struct merge_page_vec vec[BS];

		dst = client_area((size_t)BS * STRIDE, 0);
		if (!dst)
			die("mmap");
		for (int c = 0; c < CALLS; c++) {
			for (int k = 0; k < BS; k++) {
				size_t j = (size_t)c * BS + k;

				vec[k].src = (uintptr_t)(srv + (j % npages) * PS);
				vec[k].dst = (uintptr_t)(dst + (size_t)k * STRIDE * PS);
				dst[(size_t)k * STRIDE * PS] ^= 1;
			}
			t0 = now_ns();
			if (merge_pages_fd(pidfd, vec, BS, 0) != BS)
				die("merge_pages (2 MiB apart)");
			t1 = now_ns();
			us[c] = (t1 - t0) / 1000.0 / BS;
		}
		rows[nrows++] = summarize("merge_pages, batch 32, dst 2 MiB apart, per page",
					  us, CALLS);
		munmap(dst, (size_t)BS * STRIDE * PS);
	}

	/*
	 * A page mapped many times: merges of one server page into fresh
	 * pages while it is mapped 150 to 199 times, each timed on its own.
	 * Below max_page_sharing (256) even with the stale mappings the rows
	 * above left on it, which a kernel that does not prune them counts.
	 */
	{
		enum { SHARERS = 150, SAMPLES = 50 };

		dst = client_area(SHARERS + SAMPLES, 1);
		if (!dst)
			die("mmap");
		for (int i = 0; i < SHARERS; i++)
			if (merge_page_fd(pidfd, srv + 7 * PS, dst + i * PS, 0))
				die("merge_page (sharers)");
		for (int i = 0; i < SAMPLES; i++) {
			t0 = now_ns();
			if (merge_page_fd(pidfd, srv + 7 * PS, dst + (SHARERS + i) * PS, 0))
				die("merge_page (shared page)");
			t1 = now_ns();
			us[i] = (t1 - t0) / 1000.0;
		}
		rows[nrows++] = summarize("merge_page, dst anon, source mapped 150+ times",
					  us, SAMPLES);
		munmap(dst, (SHARERS + SAMPLES) * PS);
	}

	/*
	 * Taking merged pages away: munmap() of 64 pages (anon, or just
	 * merged) and a write to each of 64 just-merged pages (CoW), per
	 * page.  Since patch 7 the unmap of a merged page counts for the
	 * prune work, which runs later in a kworker (not timed here).
	 */
	{
		enum { BATCH = 64, CALLS = 200 };
		static const char * const names[] = {
			"munmap, anon pages, per page",
			"munmap, merged pages, per page",
			"write (CoW) to merged pages, per page",
		};
		struct merge_page_vec vec[BATCH];

		for (int kind = 0; kind < 3; kind++) {
			for (int c = 0; c < CALLS; c++) {
				dst = client_area(BATCH, 1);
				if (!dst)
					die("mmap");
				for (int k = 0; kind && k < BATCH; k++) {
					vec[k].src = (uintptr_t)(srv + ((size_t)(c * BATCH + k) % npages) * PS);
					vec[k].dst = (uintptr_t)(dst + k * PS);
				}
				if (kind && merge_pages_fd(pidfd, vec, BATCH, 0) != BATCH)
					die("merge_pages (unmap rows)");
				t0 = now_ns();
				if (kind < 2) {
					munmap(dst, BATCH * PS);
				} else {
					for (int k = 0; k < BATCH; k++)
						dst[k * PS] ^= 1;
				}
				t1 = now_ns();
				us[c] = (t1 - t0) / 1000.0 / BATCH;
				if (kind == 2)
					munmap(dst, BATCH * PS);
			}
			rows[nrows++] = summarize(names[kind], us, CALLS);
		}
	}

	/* Print the table. */
	printf("BENCH-TABLE-BEGIN\n");
	printf("| operation | calls | mean (us) | median (us) | p99 (us) | mean / pread mean |\n");
	printf("|---|---:|---:|---:|---:|---:|\n");
	for (int i = 0; i < nrows; i++)
		printf("| %s | %d | %.2f | %.2f | %.2f | %.3f |\n", rows[i].name, rows[i].n,
		       rows[i].mean, rows[i].median, rows[i].p99, rows[i].mean / rows[0].mean);
	printf("\nClock read overhead included in every sample: %.2f us per call.\n",
	       clock_ns / 1000.0);
	printf("BENCH-TABLE-END\n");

	kill(server, SIGKILL);
	waitpid(server, NULL, 0);
	close(fd);
	unlink("/tmp/merge_bench.dat");
	return 0;
}
