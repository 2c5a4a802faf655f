// SPDX-License-Identifier: GPL-2.0
/*
 * e2e_sampler: what the end-to-end benchmark (bench/e2e_vs_ksm.py) records
 * in the pageshare host VM, once per interval, from outside the guests.
 *
 *   e2e_sampler CONFIG HASHFILE INTERVAL_MS SERVER_PID GUEST_MIB \
 *               PID:QMP_SOCKET[:TRACE_LOG]|PID:- ...
 *
 * TRACE_LOG: the guest's QEMU's log with its pageshare_merge trace events
 * (-trace pageshare_merge), read as it grows: which guest addresses the
 * filter merged, and when.
 *
 *   e2e_sampler --hash FILE   prints page_hash() of each 4 KiB page of FILE
 *                             (the benchmark's test compares it with Python's)
 *   e2e_sampler --hmp QMP_SOCKET COMMAND
 *                             runs a monitor command (human-monitor-command)
 *                             and prints its output: the driver's look at a
 *                             guest that does not boot ("info registers")
 *   e2e_sampler --qmp QMP_SOCKET JSON
 *                             sends one QMP command and prints its reply line
 *                             (exit status 1 on an error reply): the driver's
 *                             migration phase (migrate, query-migrate ...)
 *
 * Runs until SIGTERM.  Every line it prints starts with E2E-H (the host)
 * or E2E-G (one guest):
 *
 *   E2E-H cfg t memavail_kb ksmd_cpu_ms server_cpu_ms server_rss_kb
 *         server_pss_kb pages_shared pages_sharing ksm_zero_pages
 *         merge_page_merged full_scans distinct_listed distinct_zero
 *         distinct_other sample_ms khugepaged_collapsed khugepaged_full_scans
 *         distinct_stale kworker_cpu_ms busy_cpu_ms sampler_cpu_ms mem_pages
 *         distinct_pages server_unused swap_used_kb
 *   E2E-G cfg t guest qemu_cpu_ms rss_kb pss_kb present ksm listed
 *         listed_shared zero zero_shared other_shared requests merged
 *         merge_ns merge_failed not_listed full on_server stale stale_shared
 *         unshared_server unshared_replaced unshared_thp unshared_never
 *         anon_huge_kb
 *   E2E-U cfg t guest offset pfn kpageflags was_pfn
 *         (the first MAX_TRACE listed pages per guest found replaced: see
 *         below)
 *   E2E-F cfg t guest partial unaligned no_table not_ram merge_failed
 *         unsupported unproven merges_traced unshared_unmerged
 *         unshared_unseen batch1 batch2 batch4 batch8 batch16 batch32
 *         batch64
 *         (the filter's fallback counters; with a TRACE_LOG, the merges
 *         read from it so far, and of the listed pages not shared, those
 *         at an address the filter never merged and those merged there
 *         that no sample has seen shared since their merge; and the
 *         filter's merge_pages calls by the blocks they carried, its
 *         merge-batches: 1, 2-3, 4-7 ... 64 or more)
 *   E2E-L cfg t guest offset pfn kpageflags block ms_since_merge
 *         (the first MAX_TRACE of the latter per guest)
 *
 * t is CLOCK_BOOTTIME in ms, the clock of /proc/uptime, so the driver's
 * shell can stamp its own events on the same axis.
 *
 * Classes are by content: a guest page is "listed" when its 64-bit hash is
 * one of HASHFILE's (the hashes of the list's blocks, computed by the
 * benchmark from the image), "zero" when it is all zeros or maps the zero
 * page, "stale" when its hash is one of $E2E_STALE_HASHES's (the pages of
 * the stale memory the guests write and free: free pages that still hold
 * identical data), "other" otherwise.  "Shared" means mapped from a KSM page
 * (/proc/kpageflags), which is what both ksmd and merge_pages() produce, or
 * the zero page.  Only present pages are read (a read of a page that is
 * not present would fault it in).  A KSM page's content cannot change while
 * it is one, so its class is cached by PFN.
 *
 * Pages are read through /proc/PID/mem, never process_vm_readv(2): that
 * one pins the pages it reads (FOLL_PIN), and a read-only pin of a KSM page
 * must unshare it first (gup_must_unshare(): a KSM page is never exclusive),
 * so it gave the guest a private copy of every KSM page it read, the very
 * sharing it measures undone until ksmd merged the copy again.  Reads of
 * /proc/PID/mem take a plain reference (FOLL_FORCE, no pin) and leave the
 * page as it is.
 *
 * Reading every present page is slow under TCG (seconds for three guests),
 * so only every FULL_EVERY-th sample (full=1) reads the pages that are not
 * shared, and the first after a new file appears in $E2E_MARKS (the
 * driver's: a guest's mark, such as the end of its reads, is read then); the others count shared pages exactly and carry "listed" and
 * "zero" (all such pages, shared or not) over from the last full sample.
 * on_server counts the listed, shared guest pages whose PFN is one the
 * page server maps: the server's own physical page, as merge_pages makes.
 *
 * Where the listed pages that are not shared come from (full samples only):
 * unshared_server counts those whose PFN is the server's (the server's page
 * itself is no longer a KSM page); unshared_replaced those at a guest
 * address where an earlier sample saw a shared listed page, now another
 * PFN (a private copy took the place of the shared page: a CoW, a
 * collapse...), unshared_thp those of them in a huge page (a collapse made
 * it); unshared_never the rest, where no sample saw a shared listed page
 * (a guest copy, a merge that did not hold until the next sample, or a
 * read that was never merged).  E2E-U lines name the first MAX_TRACE
 * replaced pages of each guest, with the PFN they had when last seen
 * shared.
 *
 * The census (full samples; -1 in the others), for the memory that
 * sharing could still save: mem_pages is the number of distinct physical
 * pages the guests' RAM maps plus the server's pages of listed content,
 * distinct_pages the number of distinct contents among them (all-zero
 * content and the zero page count as one).  mem_pages - distinct_pages is
 * the duplicates not yet shared: 0 when every content is held once.
 * server_unused counts the server's pages of listed content that no guest
 * maps: preloaded memory that backs nothing (yet).  The server's pages are
 * read once per PFN through its /proc/PID/mem (it never writes them).
 *
 * CPU beyond ksmd's and the server's: kworker_cpu_ms sums the CPU of every
 * kworker thread seen since the start (one that exits keeps its last
 * reading: merge_pages' prune work runs there, among all else kworkers
 * do); busy_cpu_ms is the whole machine's non-idle time (/proc/stat:
 * user, nice, system, irq, softirq, steal); sampler_cpu_ms the sampler's
 * own, to take out of it.
 *
 * khugepaged_collapsed and khugepaged_full_scans are khugepaged's own
 * counters (sysfs; the host kernel has no VM event counters): khugepaged
 * collapsing a 2 MiB range of guest RAM into a huge page copies the KSM
 * pages in it, which unshares them.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "ksm_sysfs.h"
#include "page_hash.h"

#define PS 4096UL
#define PM_PRESENT (1ULL << 63)
#define PM_PFN_MASK ((1ULL << 55) - 1)
#define KPF_KSM 21
#define KPF_ZERO_PAGE 24
#define BATCH 256
#define MAX_GUESTS 16
#define FULL_EVERY 5
#define MAX_TRACE 64
#define KPF_COMPOUND_HEAD 15
#define KPF_COMPOUND_TAIL 16
#define KPF_THP 22

enum cls { C_UNKNOWN, C_LISTED, C_ZERO, C_OTHER, C_STALE, NCLS };

struct guest {
	pid_t pid;
	const char *qmp_path;
	int qmp;		/* -1: no filter, or not connected */
	uint64_t ram, ram_len;	/* QEMU's mapping of guest RAM */
	int pagemap;
	int mem;		/* /proc/PID/mem */
	long last_listed, last_zero, last_stale;	/* of the last full sample */
	uint64_t *shared_pfn;	/* per guest page: PFN last seen shared and listed, or 0 */
	uint64_t *merged_at;	/* per guest page: t of the last merge traced there, or 0 */
	uint64_t *shared_at;	/* per guest page: t it was last seen shared and listed */
	uint32_t *merged_block;	/* per guest page: the block of that merge */
	FILE *trace;		/* the QEMU log with pageshare_merge events, or NULL */
	char tline[512];	/* a trace line read in part */
	size_t tlen;
	long merges_traced;
	int lost_traced;	/* E2E-L lines printed */
	int traced;		/* E2E-U lines printed */
	int index;
	char qbuf[1 << 16];
	size_t qlen;
};

static volatile sig_atomic_t stop;
struct hashset {
	uint64_t *h;
	size_t n;
};
static struct hashset listed_set, stale_set;
static uint8_t *pfn_class;	/* per PFN: enum cls of a KSM page, cached */
static uint64_t *pfn_hash;	/* per PFN: its content's census hash, with pfn_class */
static uint8_t *seen[NCLS];	/* per PFN bitmaps, per class: distinct shared PFNs */
static uint8_t *server_pfns;	/* per PFN bitmap: mapped by the page server */
static uint64_t *kflags;
static size_t nkflags, kflags_cap;

static void die(const char *fmt, const char *arg)
{
	fprintf(stderr, "e2e_sampler: ");
	fprintf(stderr, fmt, arg);
	fprintf(stderr, "\n");
	exit(1);
}

static void on_term(int sig)
{
	(void)sig;
	stop = 1;
}

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_BOOTTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static bool in_set(const struct hashset *set, uint64_t h)
{
	size_t lo = 0, hi = set->n;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;

		if (set->h[mid] == h)
			return true;
		if (set->h[mid] < h)
			lo = mid + 1;
		else
			hi = mid;
	}
	return false;
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

static void load_hashes(struct hashset *set, const char *path)
{
	FILE *f = fopen(path, "rb");
	long sz;

	if (!f)
		die("cannot open the hash file %s", path);
	fseek(f, 0, SEEK_END);
	sz = ftell(f);
	rewind(f);
	set->n = (size_t)sz / 8;
	set->h = malloc(set->n * 8 + 8);
	if (!set->h || fread(set->h, 8, set->n, f) != set->n)
		die("cannot read %s", path);
	fclose(f);
	qsort(set->h, set->n, 8, cmp_u64);
}

/* All of /proc/kpageflags, once per sample (one sequential read). */
static void read_kpageflags(void)
{
	int fd = open("/proc/kpageflags", O_RDONLY);
	ssize_t r;

	if (fd < 0)
		die("/proc/kpageflags: %s", strerror(errno));
	nkflags = 0;
	for (;;) {
		if (nkflags + 65536 > kflags_cap) {
			kflags_cap = (kflags_cap ? kflags_cap * 2 : 1 << 20);
			kflags = realloc(kflags, kflags_cap * 8);
			if (!kflags)
				die("out of memory for %s", "kpageflags");
		}
		r = read(fd, kflags + nkflags, 65536 * 8);
		if (r <= 0)
			break;
		nkflags += (size_t)r / 8;
	}
	close(fd);
	if (!pfn_class) {
		pfn_class = calloc(nkflags + 1, 1);
		for (int c = 0; c < NCLS; c++)
			seen[c] = calloc(nkflags / 8 + 1, 1);
		server_pfns = calloc(nkflags / 8 + 1, 1);
		pfn_hash = calloc(nkflags + 1, sizeof(*pfn_hash));
		if (!pfn_class || !seen[C_OTHER] || !seen[C_STALE] || !server_pfns || !pfn_hash)
			die("out of memory for %s", "PFN maps");
	}
}

static uint64_t kflag(uint64_t pfn)
{
	return pfn < nkflags ? kflags[pfn] : 0;
}

/*
 * @pfn's flags now, not at the start of the sample: the one snapshot of
 * /proc/kpageflags is up to a pass old by the time a page is looked at,
 * and a server page that merge_pages() made a KSM page since (its first
 * merge) is not one in it.  0 if it cannot be read.
 */
static uint64_t kflag_now(uint64_t pfn)
{
	static int fd = -1;
	uint64_t f;

	if (fd < 0)
		fd = open("/proc/kpageflags", O_RDONLY | O_CLOEXEC);
	if (fd < 0 || pread(fd, &f, sizeof(f), (off_t)(pfn * 8)) != sizeof(f))
		return 0;
	return f;
}

/*
 * "Rss:", "Pss:" and "AnonHugePages:" (the process's anonymous memory in
 * transparent huge pages: guest RAM that merges have not split) of
 * /proc/PID/smaps_rollup, in kB; @thp may be NULL.
 */
static void rss_pss(pid_t pid, long *rss, long *pss, long *thp)
{
	char path[64], line[256];
	FILE *f;

	*rss = *pss = -1;
	if (thp)
		*thp = -1;
	snprintf(path, sizeof(path), "/proc/%d/smaps_rollup", pid);
	f = fopen(path, "r");
	if (!f)
		return;
	while (fgets(line, sizeof(line), f)) {
		if (!strncmp(line, "Rss:", 4))
			*rss = strtol(line + 4, NULL, 10);
		else if (!strncmp(line, "Pss:", 4))
			*pss = strtol(line + 4, NULL, 10);
		else if (thp && !strncmp(line, "AnonHugePages:", 14))
			*thp = strtol(line + 14, NULL, 10);
	}
	fclose(f);
}

/* utime + stime of a process in ms (fields 14 and 15 of /proc/PID/stat). */
static long cpu_ms(pid_t pid)
{
	char path[64], buf[1024], *p;
	unsigned long ut, st;
	FILE *f;

	if (pid <= 0)
		return 0;
	snprintf(path, sizeof(path), "/proc/%d/stat", pid);
	f = fopen(path, "r");
	if (!f)
		return -1;
	p = fgets(buf, sizeof(buf), f);
	fclose(f);
	if (!p || !(p = strrchr(buf, ')')))
		return -1;
	if (sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu",
		   &ut, &st) != 2)
		return -1;
	return (long)((ut + st) * 1000 / (unsigned long)sysconf(_SC_CLK_TCK));
}

static pid_t find_ksmd(void)
{
	DIR *d = opendir("/proc");
	struct dirent *e;
	pid_t found = 0;

	while (d && (e = readdir(d))) {
		char path[300], comm[64] = "";
		FILE *f;

		if (e->d_name[0] < '0' || e->d_name[0] > '9')
			continue;
		snprintf(path, sizeof(path), "/proc/%s/comm", e->d_name);
		f = fopen(path, "r");
		if (!f)
			continue;
		if (fgets(comm, sizeof(comm), f) && !strcmp(comm, "ksmd\n"))
			found = atoi(e->d_name);
		fclose(f);
		if (found)
			break;
	}
	if (d)
		closedir(d);
	return found;
}

static long khugepaged_stat(const char *name)
{
	char path[128], buf[64];
	FILE *f;
	long v = -1;

	snprintf(path, sizeof(path), "/sys/kernel/mm/transparent_hugepage/khugepaged/%s", name);
	f = fopen(path, "r");
	if (f && fgets(buf, sizeof(buf), f))
		v = strtol(buf, NULL, 10);
	if (f)
		fclose(f);
	return v;
}

/* A /proc/meminfo value in kB, or -1. */
static long meminfo_kb(const char *key)
{
	size_t n = strlen(key);
	char line[256];
	FILE *f = fopen("/proc/meminfo", "r");
	long v = -1;

	while (f && fgets(line, sizeof(line), f))
		if (!strncmp(line, key, n) && line[n] == ':')
			v = strtol(line + n + 1, NULL, 10);
	if (f)
		fclose(f);
	return v;
}

/*
 * Guest RAM is QEMU's smallest private anonymous read-write mapping that is
 * at least the guest's memory size (-m); pc.ram is one block.
 */
static void find_ram(struct guest *g, uint64_t min_len)
{
	char path[64], line[512];
	FILE *maps;

	snprintf(path, sizeof(path), "/proc/%d/maps", g->pid);
	/* QEMU answers on QMP before it has allocated guest RAM: wait a minute */
	for (int tries = 0; tries < 600; tries++) {
		g->ram_len = 0;
		maps = fopen(path, "r");
		if (!maps)
			die("cannot open %s", path);
		while (fgets(line, sizeof(line), maps)) {
			uint64_t start, end, ino;
			char perms[8];
			int pathoff = 0;

			if (sscanf(line, "%" SCNx64 "-%" SCNx64 " %7s %*s %*s %" SCNu64 " %n",
				   &start, &end, perms, &ino, &pathoff) < 4)
				continue;
			if (strcmp(perms, "rw-p") || ino != 0 || line[pathoff] == '/')
				continue;
			if (end - start >= min_len &&
			    (!g->ram_len || end - start < g->ram_len)) {
				g->ram = start;
				g->ram_len = end - start;
			}
		}
		fclose(maps);
		if (g->ram_len)
			break;
		usleep(100000);
	}
	if (!g->ram_len)
		die("no guest RAM mapping in %s after 60 s", path);
	snprintf(path, sizeof(path), "/proc/%d/pagemap", g->pid);
	g->pagemap = open(path, O_RDONLY);
	if (g->pagemap < 0)
		die("cannot open %s", path);
	snprintf(path, sizeof(path), "/proc/%d/mem", g->pid);
	g->mem = open(path, O_RDONLY);
	if (g->mem < 0)
		die("cannot open %s", path);
}

/*
 * Read the @nr pages at @remote into @local from @g's /proc/PID/mem, a run
 * of consecutive addresses per pread.  Returns the bytes read (whole pages
 * from the first on), short where a read failed (QEMU exited).
 */
static ssize_t read_guest_pages(struct guest *g, const struct iovec *local,
				const struct iovec *remote, size_t nr)
{
	size_t done = 0;

	while (done < nr) {
		size_t run = 1;
		ssize_t got;

		while (done + run < nr &&
		       (char *)remote[done + run].iov_base ==
		       (char *)remote[done].iov_base + run * PS &&
		       (char *)local[done + run].iov_base ==
		       (char *)local[done].iov_base + run * PS)
			run++;
		got = pread(g->mem, local[done].iov_base, run * PS,
			    (off_t)(uintptr_t)remote[done].iov_base);
		if (got < 0)
			break;
		done += (size_t)got / PS;
		if ((size_t)got != run * PS)
			break;
	}
	return (ssize_t)(done * PS);
}

/* --------------------------------------------------------------- QMP */

static int qmp_line(struct guest *g, char *out, size_t cap)
{
	for (;;) {
		char *nl = memchr(g->qbuf, '\n', g->qlen);
		struct pollfd p = { .fd = g->qmp, .events = POLLIN };
		ssize_t r;

		if (nl) {
			size_t n = (size_t)(nl - g->qbuf) + 1;
			size_t c = n < cap ? n : cap - 1;

			memcpy(out, g->qbuf, c);
			out[c] = 0;
			memmove(g->qbuf, g->qbuf + n, g->qlen - n);
			g->qlen -= n;
			return 0;
		}
		if (g->qlen == sizeof(g->qbuf))
			g->qlen = 0;	/* a line longer than the buffer: drop it */
		if (poll(&p, 1, 10000) <= 0)
			return -1;
		r = read(g->qmp, g->qbuf + g->qlen, sizeof(g->qbuf) - g->qlen);
		if (r <= 0)
			return -1;
		g->qlen += (size_t)r;
	}
}

static char reply[1 << 16];

static const char *qmp(struct guest *g, const char *cmd)
{
	size_t n = strlen(cmd);

	if (write(g->qmp, cmd, n) != (ssize_t)n)
		return NULL;
	for (;;) {
		if (qmp_line(g, reply, sizeof(reply)))
			return NULL;
		if (strstr(reply, "\"return\"") || strstr(reply, "\"error\""))
			return reply;
	}
}

static void qmp_connect(struct guest *g)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };

	g->qmp = -1;
	if (!strcmp(g->qmp_path, "-"))
		return;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", g->qmp_path);
	g->qmp = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (connect(g->qmp, (struct sockaddr *)&sa, sizeof(sa)) ||
	    qmp_line(g, reply, sizeof(reply)) ||
	    !qmp(g, "{\"execute\": \"qmp_capabilities\"}\n")) {
		close(g->qmp);
		g->qmp = -1;
		die("no QMP on %s", g->qmp_path);
	}
}

static long num(const char *obj, const char *key)
{
	char pat[64];
	const char *p;

	snprintf(pat, sizeof(pat), "\"%s\": ", key);
	p = strstr(obj, pat);
	return p ? strtol(p + strlen(pat), NULL, 10) : -1;
}

/*
 * A monitor command's output, as --hmp prints it: the "return" string with
 * its JSON escapes undone (enough for "info registers").
 */
static int hmp(const char *sock, const char *cmdline)
{
	static char cmd[1024];
	struct guest g = { .qmp_path = sock };
	const char *r, *p;

	qmp_connect(&g);
	snprintf(cmd, sizeof(cmd), "{\"execute\": \"human-monitor-command\", "
		 "\"arguments\": {\"command-line\": \"%s\"}}\n", cmdline);
	r = qmp(&g, cmd);
	if (!r || !(p = strstr(r, "\"return\": \"")))
		die("no answer to %s", cmdline);
	for (p += strlen("\"return\": \""); *p && *p != '"'; p++) {
		if (*p != '\\') {
			putchar(*p);
			continue;
		}
		p++;
		if (*p == 'n')
			putchar('\n');
		else if (*p && *p != 'r')
			putchar(*p);
		if (!*p)
			break;
	}
	return 0;
}

/*
 * One QMP command's reply, as --qmp prints it: the whole line ("return" or
 * "error"), for the driver's migration phase to pick fields from.
 */
static int qmp_passthrough(const char *sock, const char *json)
{
	static char cmd[4096];
	struct guest g = { .qmp_path = sock };
	const char *r;

	qmp_connect(&g);
	snprintf(cmd, sizeof(cmd), "%s\n", json);
	r = qmp(&g, cmd);
	if (!r)
		die("no answer to %s", json);
	fputs(r, stdout);
	close(g.qmp);
	return strstr(r, "\"error\"") ? 1 : 0;
}

/* The pageshare node's counters, or -1s without a filter. */
#define NSTATS 12
#define NBATCHES 7
static void filter_stats(struct guest *g, long out[NSTATS], long batches[NBATCHES])
{
	static const char *const keys[NSTATS] = {
		"requests", "merged", "merge-ns", "fallback-merge-failed",
		"fallback-not-listed",
		/* E2E-F */
		"fallback-partial", "fallback-unaligned", "fallback-no-table",
		"fallback-not-guest-ram", "fallback-merge-failed", "fallback-unsupported",
		"fallback-unproven" };
	const char *r, *d, *p;
	char obj[4096];
	const char *e;

	for (int i = 0; i < NSTATS; i++)
		out[i] = -1;
	for (int i = 0; i < NBATCHES; i++)
		batches[i] = -1;
	if (g->qmp < 0)
		return;
	r = qmp(g, "{\"execute\": \"query-blockstats\", "
		"\"arguments\": {\"query-nodes\": true}}\n");
	if (!r || !(d = strstr(r, "\"driver\": \"pageshare\"")))
		return;
	for (p = d; p > r && *p != '{'; p--)
		;
	e = strchr(d, '}');
	if (!e || e - p >= (long)sizeof(obj))
		return;
	memcpy(obj, p, (size_t)(e - p));
	obj[e - p] = 0;
	for (int i = 0; i < NSTATS; i++)
		out[i] = num(obj, keys[i]);
	p = strstr(obj, "\"merge-batches\": [");
	for (int i = 0; p && i < NBATCHES; i++) {
		char *end;

		p += i ? 1 : strlen("\"merge-batches\": [");
		batches[i] = strtol(p, &end, 10);
		p = end == p ? NULL : strpbrk(end, ",]");
		if (p && *p == ']' && i + 1 < NBATCHES)
			p = NULL;
	}
}

/* ------------------------------------------------------- guest memory */

struct counts {
	long present, ksm, listed, listed_shared, zero, zero_shared, other_shared;
	long stale, stale_shared;	/* freed stale memory ($E2E_STALE_HASHES) */
	long on_server;		/* listed and shared: the server's own page */
	/* listed, not shared (full samples): see the comment at the top */
	long unshared_server, unshared_replaced, unshared_thp, unshared_never;
	long unshared_unmerged, unshared_unseen;	/* with a trace log */
};

static bool is_server_pfn(uint64_t pfn)
{
	return pfn < nkflags && (server_pfns[pfn / 8] & (1u << (pfn % 8)));
}

/*
 * The PFNs of every present page the server maps (its arena among them),
 * so that a guest page can be shown to be the server's physical page.
 */
static void read_server_pfns(pid_t pid)
{
	char path[64], line[512];
	FILE *maps;
	int pm;

	memset(server_pfns, 0, nkflags / 8 + 1);
	if (pid <= 0)
		return;
	snprintf(path, sizeof(path), "/proc/%d/maps", pid);
	maps = fopen(path, "r");
	snprintf(path, sizeof(path), "/proc/%d/pagemap", pid);
	pm = open(path, O_RDONLY);
	while (maps && pm >= 0 && fgets(line, sizeof(line), maps)) {
		uint64_t start, end, e[512];

		if (sscanf(line, "%" SCNx64 "-%" SCNx64, &start, &end) != 2)
			continue;
		for (uint64_t a = start; a < end; a += 512 * PS) {
			size_t n = (end - a) / PS < 512 ? (end - a) / PS : 512;

			if (pread(pm, e, n * 8, a / PS * 8) != (ssize_t)(n * 8))
				break;
			for (size_t i = 0; i < n; i++) {
				uint64_t pfn = e[i] & PM_PFN_MASK;

				if ((e[i] & PM_PRESENT) && pfn < nkflags)
					server_pfns[pfn / 8] |= (uint8_t)(1u << (pfn % 8));
			}
		}
	}
	if (maps)
		fclose(maps);
	if (pm >= 0)
		close(pm);
}

static void mark(int c, uint64_t pfn)
{
	if (pfn < nkflags)
		seen[c][pfn / 8] |= (uint8_t)(1u << (pfn % 8));
}

/* A page's class, and its census hash in *@hash (0: all zeros). */
static enum cls classify(const uint64_t *w, uint64_t *hash)
{
	bool zero = true;
	uint64_t h;

	for (size_t i = 0; i < PS / 8 && zero; i++)
		zero = !w[i];
	*hash = 0;
	if (zero)
		return C_ZERO;
	h = page_hash(w);
	*hash = h;
	if (in_set(&listed_set, h))
		return C_LISTED;
	return in_set(&stale_set, h) ? C_STALE : C_OTHER;
}

static void account(struct counts *c, enum cls k, bool shared, uint64_t pfn)
{
	if (k == C_LISTED) {
		c->listed++;
		c->listed_shared += shared;
		c->on_server += shared && is_server_pfn(pfn);
	} else if (k == C_ZERO) {
		c->zero++;
		c->zero_shared += shared;
	} else if (k == C_STALE) {
		c->stale++;
		c->stale_shared += shared;
	} else {
		c->other_shared += shared;
	}
	if (shared)
		mark(k, pfn);
}

/* ------------------------------------------------------------ census */

static uint8_t *census_pfns;	/* per PFN bitmap: counted in this census */
static uint64_t *census_hashes;	/* one hash per counted PFN */
static size_t census_n, census_cap;

static void census_reset(void)
{
	if (!census_pfns && !(census_pfns = calloc(nkflags / 8 + 1, 1)))
		die("out of memory for %s", "the census");
	memset(census_pfns, 0, nkflags / 8 + 1);
	census_n = 0;
}

static bool census_has(uint64_t pfn)
{
	return pfn < nkflags && (census_pfns[pfn / 8] & (1u << (pfn % 8)));
}

/* Physical page @pfn holds content @hash: counted once per PFN. */
static void census_add(uint64_t pfn, uint64_t hash)
{
	if (pfn >= nkflags || census_has(pfn))
		return;
	census_pfns[pfn / 8] |= (uint8_t)(1u << (pfn % 8));
	if (census_n == census_cap) {
		census_cap = census_cap ? census_cap * 2 : 1 << 18;
		census_hashes = realloc(census_hashes, census_cap * sizeof(*census_hashes));
		if (!census_hashes)
			die("out of memory for %s", "the census");
	}
	census_hashes[census_n++] = hash;
}

/* The census's distinct contents (sorts the hashes). */
static long census_distinct(void)
{
	long d = 0;

	qsort(census_hashes, census_n, sizeof(*census_hashes), cmp_u64);
	for (size_t i = 0; i < census_n; i++)
		d += !i || census_hashes[i] != census_hashes[i - 1];
	return d;
}

/*
 * The server's pages of listed content into the census, after the guests'
 * (so that those no guest maps can be counted): its present pages, each
 * read once per PFN through /proc/PID/mem and its class kept (the server
 * never writes them; a new server process starts a new cache).  Returns
 * how many no guest maps, or -1 if the server cannot be read.
 */
static long census_server(pid_t pid)
{
	static pid_t cached_pid;
	static int mem = -1;
	static uint8_t *scls;		/* per PFN: 0 unknown, 1 listed, 2 other */
	static uint64_t *shash;
	char path[64], line[512];
	uint64_t page[PS / 8];
	long unused = 0;
	FILE *maps;
	int pm;

	if (pid <= 0)
		return 0;
	if (!scls) {
		scls = calloc(nkflags + 1, 1);
		shash = calloc(nkflags + 1, sizeof(*shash));
		if (!scls || !shash)
			die("out of memory for %s", "the server's census");
	}
	if (pid != cached_pid) {
		memset(scls, 0, nkflags + 1);
		if (mem >= 0)
			close(mem);
		snprintf(path, sizeof(path), "/proc/%d/mem", pid);
		mem = open(path, O_RDONLY | O_CLOEXEC);
		cached_pid = pid;
	}
	snprintf(path, sizeof(path), "/proc/%d/maps", pid);
	maps = fopen(path, "r");
	snprintf(path, sizeof(path), "/proc/%d/pagemap", pid);
	pm = open(path, O_RDONLY | O_CLOEXEC);
	if (!maps || pm < 0 || mem < 0) {
		if (maps)
			fclose(maps);
		if (pm >= 0)
			close(pm);
		return -1;
	}
	while (fgets(line, sizeof(line), maps)) {
		uint64_t start, end, e[512];

		if (sscanf(line, "%" SCNx64 "-%" SCNx64, &start, &end) != 2)
			continue;
		for (uint64_t a = start; a < end; a += 512 * PS) {
			size_t n = (end - a) / PS < 512 ? (end - a) / PS : 512;

			if (pread(pm, e, n * 8, a / PS * 8) != (ssize_t)(n * 8))
				break;
			for (size_t i = 0; i < n; i++) {
				uint64_t pfn = e[i] & PM_PFN_MASK;

				if (!(e[i] & PM_PRESENT) || pfn >= nkflags)
					continue;
				if (!scls[pfn]) {
					if (pread(mem, page, PS, (off_t)(a + i * PS)) != (ssize_t)PS)
						continue;
					scls[pfn] = classify(page, &shash[pfn]) == C_LISTED ? 1 : 2;
				}
				if (scls[pfn] != 1)
					continue;
				unused += !census_has(pfn);
				census_add(pfn, shash[pfn]);
			}
		}
	}
	fclose(maps);
	close(pm);
	return unused;
}

/* ------------------------------------------------------- CPU, beyond */

/*
 * The CPU of every kworker seen so far, ms: the live ones' readings plus
 * the last readings of those gone (a reading that drops is a new thread
 * of a reused pid; the old one's last reading is kept).
 */
static long kworker_cpu_ms(void)
{
	static struct kw_cpu { pid_t pid; long ms; } kw[8192];
	static size_t nkw;
	static long gone;
	DIR *d = opendir("/proc");
	struct dirent *e;
	long total;

	while (d && (e = readdir(d))) {
		char path[300], comm[64] = "";
		pid_t pid;
		size_t i;
		FILE *f;
		long ms;

		if (e->d_name[0] < '0' || e->d_name[0] > '9')
			continue;
		snprintf(path, sizeof(path), "/proc/%s/comm", e->d_name);
		f = fopen(path, "r");
		if (!f)
			continue;
		if (!fgets(comm, sizeof(comm), f))
			comm[0] = 0;
		fclose(f);
		if (strncmp(comm, "kworker/", 8))
			continue;
		pid = atoi(e->d_name);
		ms = cpu_ms(pid);
		if (ms < 0)
			continue;
		for (i = 0; i < nkw && kw[i].pid != pid; i++)
			;
		if (i == nkw) {
			if (nkw == sizeof(kw) / sizeof(kw[0]))
				continue;
			kw[nkw++] = (struct kw_cpu){ pid, 0 };
		}
		if (ms < kw[i].ms)
			gone += kw[i].ms;
		kw[i].ms = ms;
	}
	if (d)
		closedir(d);
	total = gone;
	for (size_t i = 0; i < nkw; i++)
		total += kw[i].ms;
	return total;
}

/* The machine's non-idle CPU time, ms (the "cpu" line of /proc/stat). */
static long busy_cpu_ms(void)
{
	unsigned long long v[8] = { 0 };
	FILE *f = fopen("/proc/stat", "r");
	int n = 0;

	if (f) {
		n = fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1],
			   &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]);
		fclose(f);
	}
	if (n < 8)
		return -1;
	/* user nice system [idle iowait] irq softirq steal; guest is in user */
	return (long)((v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) * 1000 /
		      (unsigned long long)sysconf(_SC_CLK_TCK));
}

/*
 * Read what the guest's QEMU logged since the last sample: each
 * "pageshare_merge bs B offset O host H" line records a merge at host
 * address H (guest page (H - ram) / PS) of the block at byte offset O, at
 * about @t (the log is read once per sample).
 */
static void read_merge_trace(struct guest *g, uint64_t t)
{
	int ch;

	if (!g->trace)
		return;
	clearerr(g->trace);
	while ((ch = getc(g->trace)) != EOF) {
		const char *m;
		unsigned long long off, host;

		if (ch != '\n') {
			if (g->tlen < sizeof(g->tline) - 1)
				g->tline[g->tlen++] = (char)ch;
			continue;
		}
		g->tline[g->tlen] = 0;
		g->tlen = 0;
		m = strstr(g->tline, "pageshare_merge ");
		if (!m || !(m = strstr(m, " offset ")) ||
		    sscanf(m, " offset %llu host %llx", &off, &host) != 2)
			continue;
		if (host < g->ram || host >= g->ram + g->ram_len)
			continue;
		g->merged_at[(host - g->ram) / PS] = t;
		g->merged_block[(host - g->ram) / PS] = (uint32_t)(off / PS);
		g->merges_traced++;
	}
}

/* Follow guest page @idx, listed, at @pfn: shared or not (see the top). */
static void follow_listed(struct guest *g, struct counts *c, uint64_t idx, uint64_t pfn,
			  bool shared, const char *cfg, uint64_t t)
{
	uint64_t f;

	if (shared) {
		g->shared_pfn[idx] = pfn;
		g->shared_at[idx] = t;
		return;
	}
	if (g->trace) {
		if (!g->merged_at[idx]) {
			c->unshared_unmerged++;
		} else if (g->shared_at[idx] < g->merged_at[idx]) {
			c->unshared_unseen++;
			if (g->lost_traced < MAX_TRACE) {
				g->lost_traced++;
				printf("E2E-L %s %" PRIu64 " %d %#" PRIx64 " %#" PRIx64 " %#" PRIx64
				       " %" PRIu32 " %" PRIu64 "\n", cfg, t, g->index, idx * PS, pfn,
				       kflag(pfn), g->merged_block[idx], t - g->merged_at[idx]);
			}
		}
	}
	if (is_server_pfn(pfn)) {
		c->unshared_server++;
		return;
	}
	if (!g->shared_pfn[idx]) {
		c->unshared_never++;
		return;
	}
	c->unshared_replaced++;
	f = kflag(pfn);
	if (f & ((1ULL << KPF_THP) | (1ULL << KPF_COMPOUND_HEAD) | (1ULL << KPF_COMPOUND_TAIL)))
		c->unshared_thp++;
	if (g->traced < MAX_TRACE) {
		g->traced++;
		printf("E2E-U %s %" PRIu64 " %d %#" PRIx64 " %#" PRIx64 " %#" PRIx64 " %#" PRIx64 "\n",
		       cfg, t, g->index, idx * PS, pfn, f, g->shared_pfn[idx]);
	}
	g->shared_pfn[idx] = 0;
}

static void scan_guest(struct guest *g, struct counts *c, bool full, const char *cfg,
		       uint64_t t)
{
	static uint64_t pm[BATCH];
	static uint64_t buf[BATCH][PS / 8];
	static struct iovec local[BATCH], remote[BATCH];
	static uint64_t pfns[BATCH];
	static bool ksm[BATCH];
	static uint64_t idxs[BATCH];

	memset(c, 0, sizeof(*c));
	for (uint64_t off = 0; off < g->ram_len; off += BATCH * PS) {
		size_t n = (g->ram_len - off) / PS < BATCH ? (g->ram_len - off) / PS : BATCH;
		size_t nr = 0;
		ssize_t got;

		if (pread(g->pagemap, pm, n * 8, (g->ram + off) / PS * 8) != (ssize_t)(n * 8))
			return;	/* QEMU exited */
		for (size_t i = 0; i < n; i++) {
			uint64_t pfn = pm[i] & PM_PFN_MASK, f;

			if (!(pm[i] & PM_PRESENT))
				continue;
			c->present++;
			f = kflag(pfn);
			if (f & (1ULL << KPF_ZERO_PAGE)) {
				account(c, C_ZERO, true, pfn);
				if (full)
					census_add(pfn, 0);
				continue;
			}
			if (f & (1ULL << KPF_KSM)) {
				c->ksm++;
				if (pfn < nkflags && pfn_class[pfn] != C_UNKNOWN) {
					account(c, pfn_class[pfn], true, pfn);
					if (full)
						census_add(pfn, pfn_hash[pfn]);
					if (pfn_class[pfn] == C_LISTED) {
						g->shared_pfn[off / PS + i] = pfn;
						g->shared_at[off / PS + i] = t;
					}
					continue;
				}
			} else {
				if (pfn < nkflags)
					pfn_class[pfn] = C_UNKNOWN;
				if (!full)
					continue;
			}
			local[nr].iov_base = buf[nr];
			local[nr].iov_len = PS;
			remote[nr].iov_base = (void *)(uintptr_t)(g->ram + off + i * PS);
			remote[nr].iov_len = PS;
			pfns[nr] = pfn;
			idxs[nr] = (off / PS) + i;
			ksm[nr] = f & (1ULL << KPF_KSM);
			nr++;
		}
		if (!nr)
			continue;
		got = read_guest_pages(g, local, remote, nr);
		if (got <= 0)
			return;
		for (size_t i = 0; i < (size_t)got / PS; i++) {
			uint64_t h;
			enum cls k = classify(buf[i], &h);

			/* not shared in the snapshot: maybe merged since (see kflag_now()) */
			if (k == C_LISTED && !ksm[i] && (kflag_now(pfns[i]) & (1ULL << KPF_KSM))) {
				ksm[i] = true;
				c->ksm++;
			}

			if (ksm[i] && pfns[i] < nkflags) {
				pfn_class[pfns[i]] = (uint8_t)k;
				pfn_hash[pfns[i]] = h;
			}
			account(c, k, ksm[i], pfns[i]);
			if (full)
				census_add(pfns[i], h);
			if (k == C_LISTED && full)
				follow_listed(g, c, idxs[i], pfns[i], ksm[i], cfg, t);
		}
	}
	if (full) {
		g->last_listed = c->listed;
		g->last_zero = c->zero;
		g->last_stale = c->stale;
	} else {
		c->listed = g->last_listed > c->listed ? g->last_listed : c->listed;
		c->zero = g->last_zero > c->zero ? g->last_zero : c->zero;
		c->stale = g->last_stale > c->stale ? g->last_stale : c->stale;
	}
}

/* Entries in directory @dir (0 without one): new ones ask for a full pass. */
static long count_marks(const char *dir)
{
	DIR *d = dir ? opendir(dir) : NULL;
	struct dirent *e;
	long n = 0;

	while (d && (e = readdir(d)))
		n += e->d_name[0] != '.';
	if (d)
		closedir(d);
	return n;
}

static long popcount_map(const uint8_t *m)
{
	long n = 0;

	for (size_t i = 0; i < nkflags / 8 + 1; i++)
		n += __builtin_popcount(m[i]);
	return n;
}

int main(int argc, char **argv)
{
	struct guest g[MAX_GUESTS];
	const char *cfg;
	long interval, guest_mib;
	pid_t server, ksmd;
	int ng = 0;

	if (argc == 3 && !strcmp(argv[1], "--hash")) {
		static uint64_t page[PS / 8];
		FILE *f = fopen(argv[2], "rb");

		if (!f)
			die("cannot open %s", argv[2]);
		while (fread(page, 1, PS, f) == PS)
			printf("%016" PRIx64 "\n", page_hash(page));
		fclose(f);
		return 0;
	}
	if (argc == 4 && !strcmp(argv[1], "--hmp"))
		return hmp(argv[2], argv[3]);
	if (argc == 4 && !strcmp(argv[1], "--qmp"))
		return qmp_passthrough(argv[2], argv[3]);
	if (argc < 7 || argc - 6 > MAX_GUESTS) {
		fprintf(stderr, "usage: e2e_sampler CONFIG HASHFILE INTERVAL_MS SERVER_PID "
			"GUEST_MIB PID:QMP|PID:- ...\n");
		return 2;
	}
	cfg = argv[1];
	load_hashes(&listed_set, argv[2]);
	if (getenv("E2E_STALE_HASHES") && *getenv("E2E_STALE_HASHES"))
		load_hashes(&stale_set, getenv("E2E_STALE_HASHES"));
	interval = atol(argv[3]);
	server = atoi(argv[4]);
	guest_mib = atol(argv[5]);
	ksmd = find_ksmd();
	signal(SIGTERM, on_term);
	signal(SIGINT, on_term);
	signal(SIGPIPE, SIG_IGN);
	for (int i = 6; i < argc; i++, ng++) {
		char *colon = strchr(argv[i], ':');

		if (!colon)
			die("bad guest argument %s (PID:QMP_SOCKET or PID:-)", argv[i]);
		*colon = 0;
		memset(&g[ng], 0, sizeof(g[ng]));
		g[ng].pid = atoi(argv[i]);
		g[ng].qmp_path = colon + 1;
		colon = strchr(colon + 1, ':');
		if (colon) {
			*colon = 0;
			g[ng].trace = fopen(colon + 1, "r");
			if (!g[ng].trace)
				die("cannot open the trace log %s", colon + 1);
		}
		find_ram(&g[ng], (uint64_t)guest_mib << 20);
		g[ng].index = ng;
		g[ng].shared_pfn = calloc(g[ng].ram_len / PS, sizeof(uint64_t));
		g[ng].shared_at = calloc(g[ng].ram_len / PS, sizeof(uint64_t));
		g[ng].merged_at = calloc(g[ng].ram_len / PS, sizeof(uint64_t));
		g[ng].merged_block = calloc(g[ng].ram_len / PS, sizeof(uint32_t));
		if (!g[ng].shared_pfn || !g[ng].shared_at || !g[ng].merged_at ||
		    !g[ng].merged_block)
			die("out of memory for %s", "shared_pfn");
		qmp_connect(&g[ng]);
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	for (long n = 0, marks = 0, m; !stop; n++) {
		uint64_t t0 = now_ms(), t1;
		bool full = n % FULL_EVERY == 0;

		m = count_marks(getenv("E2E_MARKS"));
		full = full || m > marks;
		marks = m;
		long srss, spss, mem_pages = -1, distinct = -1, unused = -1;

		read_kpageflags();
		if (full)
			census_reset();
		for (int c = 0; c < NCLS; c++)
			memset(seen[c], 0, nkflags / 8 + 1);
		read_server_pfns(server);
		for (int i = 0; i < ng; i++) {
			struct counts c;
			long rss, pss, thp, fs[NSTATS], fb[NBATCHES];

			read_merge_trace(&g[i], t0);
			scan_guest(&g[i], &c, full, cfg, t0);
			rss_pss(g[i].pid, &rss, &pss, &thp);
			filter_stats(&g[i], fs, fb);
			printf("E2E-G %s %" PRIu64 " %d %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld "
			       "%ld %ld %ld %ld %ld %d %ld %ld %ld %ld %ld %ld %ld %ld\n", cfg, t0, i,
			       cpu_ms(g[i].pid),
			       rss, pss, c.present, c.ksm, c.listed, c.listed_shared, c.zero,
			       c.zero_shared, c.other_shared, fs[0], fs[1], fs[2], fs[3], fs[4],
			       full, c.on_server, c.stale, c.stale_shared, c.unshared_server,
			       c.unshared_replaced, c.unshared_thp, c.unshared_never, thp);
			if (full && g[i].qmp >= 0)
				printf("E2E-F %s %" PRIu64 " %d %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld"
				       " %ld %ld %ld %ld %ld %ld %ld\n",
				       cfg, t0, i, fs[5], fs[6], fs[7], fs[8], fs[9], fs[10], fs[11],
				       g[i].merges_traced, c.unshared_unmerged, c.unshared_unseen,
				       fb[0], fb[1], fb[2], fb[3], fb[4], fb[5], fb[6]);
		}
		if (full) {
			unused = census_server(server);
			mem_pages = (long)census_n;
			distinct = census_distinct();
		}
		rss_pss(server, &srss, &spss, NULL);
		t1 = now_ms();
		printf("E2E-H %s %" PRIu64 " %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld "
		       "%ld %" PRIu64 " %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld\n", cfg, t0,
		       meminfo_kb("MemAvailable"), cpu_ms(ksmd),
		       cpu_ms(server), server > 0 ? srss : 0, server > 0 ? spss : 0,
		       ksm_sysfs_get("pages_shared"), ksm_sysfs_get("pages_sharing"),
		       ksm_sysfs_get("ksm_zero_pages"), ksm_sysfs_get("merge_page_merged"),
		       ksm_sysfs_get("full_scans"), popcount_map(seen[C_LISTED]),
		       popcount_map(seen[C_ZERO]), popcount_map(seen[C_OTHER]), t1 - t0,
		       khugepaged_stat("pages_collapsed"), khugepaged_stat("full_scans"),
		       popcount_map(seen[C_STALE]), kworker_cpu_ms(), busy_cpu_ms(),
		       cpu_ms(getpid()), mem_pages, distinct, unused,
		       meminfo_kb("SwapTotal") - meminfo_kb("SwapFree"));
		if ((long)(t1 - t0) < interval)
			usleep((useconds_t)(interval - (long)(t1 - t0)) * 1000);
	}
	return 0;
}
