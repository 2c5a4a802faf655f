// SPDX-License-Identifier: GPL-2.0-only
/*
 * merge_page_stress: a randomized, time-bounded mix of merge_pages() and
 * everything that can happen around it, with an exact content oracle.
 *
 *   merge_page_stress [-t seconds] [-s seed]
 *
 * A controller (this process) runs NSERVERS page servers and NCLIENTS
 * clients.  Each client keeps a shadow of what each of its pages must
 * contain (zero, its own byte, or version v of page i of server s) and
 * checks it all the time.  Clients merge random batches (uses the pid-based
 * wrapper from lib/merge_page.c), write, MADV_DONTNEED, MADV_PAGEOUT,
 * move_pages() to the other NUMA node, fork children that check and
 * write, and merge into THP areas with and without MERGE_PAGE_NOSPLIT.
 * Meanwhile the controller has servers replace their pages (clients keep the
 * old content), toggles MADV_DISALLOWMERGED, restarts servers, retunes
 * ksmd, and switches ksmd to run=2 and back.
 *
 * Output is TAP; exit status 0 if every client's oracle held.  Kernel
 * reports (WARN, lockdep, KASAN...) are caught by the test runner's log scan.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
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

#define PS		4096UL
#define NSERVERS	2
#define NCLIENTS	3
#define SPAGES		128		/* pages per server */
#define CPAGES		256		/* normal pages per client */
#define THP_SIZE	(2UL << 20)
#define MPOL_MF_MOVE_ALL (1 << 2)

/* Shared between controller and clients (MAP_SHARED). */
struct shared {
	volatile int stop;
	struct {
		volatile unsigned int gen;	/* odd while being changed */
		volatile pid_t pid;
		volatile uintptr_t base;
		volatile unsigned int id;	/* content identity */
		volatile unsigned int lo[SPAGES], hi[SPAGES];	/* version window */
	} srv[NSERVERS];
	volatile unsigned long merges, merge_calls, errors_ok;
};

static struct shared *sh;
static int verbose;

static void fill(char *p, unsigned int id, unsigned int i, unsigned int v)
{
	uint64_t *w = (uint64_t *)p;

	for (size_t k = 0; k < PS / 8; k++)
		w[k] = ((uint64_t)id << 48) ^ ((uint64_t)i << 32) ^ ((uint64_t)v << 16) ^ k;
}

static bool matches(const char *p, unsigned int id, unsigned int i, unsigned int v)
{
	const uint64_t *w = (const uint64_t *)p;

	for (size_t k = 0; k < PS / 8; k++)
		if (w[k] != (((uint64_t)id << 48) ^ ((uint64_t)i << 32) ^ ((uint64_t)v << 16) ^ k))
			return false;
	return true;
}

/* ------------------------------------------------------------------ */
/* servers: commands over a pipe; 'w' i = write page i, 'd'/'a' = dis/allow */

struct server {
	pid_t pid;
	int cmd, ack;
	unsigned int id;
};

static void server_main(int cmd, int ack, unsigned int id, int slot)
{
	char *base, c[8];

	prctl(PR_SET_PDEATHSIG, SIGKILL);
	base = mmap(NULL, SPAGES * PS, PROT_READ | PROT_WRITE,
		    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (base == MAP_FAILED)
		_exit(1);
	madvise(base, SPAGES * PS, MADV_NOHUGEPAGE);
	for (int i = 0; i < SPAGES; i++)
		fill(base + i * PS, id, i, 0);
	if (madvise(base, SPAGES * PS, MADV_ALLOWMERGED))
		_exit(2);
	sh->srv[slot].base = (uintptr_t)base;
	if (write(ack, "r", 1) != 1)
		_exit(3);
	while (read(cmd, c, 8) == 8) {
		int i = *(int *)(c + 4);

		if (c[0] == 'w') {
			/*
			 * Replace page i atomically with respect to merges (they
			 * hold our mmap_lock for reading, mremap() takes it for
			 * writing), so a merge sees version v or v + 1, never a
			 * torn page: fill a new page, publish it, move it over.
			 */
			char *np = mmap(NULL, PS, PROT_READ | PROT_WRITE,
					MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);

			if (np == MAP_FAILED)
				_exit(5);
			fill(np, id, i, sh->srv[slot].hi[i]);
			if (madvise(np, PS, MADV_ALLOWMERGED) ||
			    mremap(np, PS, PS, MREMAP_MAYMOVE | MREMAP_FIXED,
				   base + i * PS) == MAP_FAILED)
				_exit(6);
		} else if (c[0] == 'd')
			madvise(base, SPAGES * PS, MADV_DISALLOWMERGED);
		else if (c[0] == 'a')
			madvise(base, SPAGES * PS, MADV_ALLOWMERGED);
		if (write(ack, "k", 1) != 1)
			_exit(4);
	}
	_exit(0);
}

static void server_start(struct server *s, int slot, unsigned int id)
{
	int cmd[2], ack[2];
	char r;

	if (pipe(cmd) || pipe(ack))
		exit(2);
	sh->srv[slot].gen++;		/* odd: clients do not use it */
	__sync_synchronize();
	for (int i = 0; i < SPAGES; i++)
		sh->srv[slot].lo[i] = sh->srv[slot].hi[i] = 0;
	sh->srv[slot].id = id;
	s->id = id;
	s->pid = fork();
	if (!s->pid) {
		close(cmd[1]);
		close(ack[0]);
		server_main(cmd[0], ack[1], id, slot);
	}
	close(cmd[0]);
	close(ack[1]);
	s->cmd = cmd[1];
	s->ack = ack[0];
	if (read(s->ack, &r, 1) != 1)
		exit(2);
	sh->srv[slot].pid = s->pid;
	__sync_synchronize();
	sh->srv[slot].gen++;		/* even: ready */
}

static void server_cmd(struct server *s, char op, int i)
{
	char c[8] = { op };
	char r;

	*(int *)(c + 4) = i;
	if (write(s->cmd, c, 8) != 8 || read(s->ack, &r, 1) != 1)
		fprintf(stderr, "server %d: command failed\n", s->pid);
}

static void server_kill(struct server *s)
{
	kill(s->pid, SIGKILL);
	waitpid(s->pid, NULL, 0);
	close(s->cmd);
	close(s->ack);
}

/* ------------------------------------------------------------------ */
/* clients */

enum { S_ZERO, S_OWN, S_SRV };
struct shadow {
	unsigned char kind;
	unsigned char own;
	unsigned int id, i, vlo, vhi;
	char hist[64];		/* last operations on this page, newest last */
};

static void note(struct shadow *s, char op)
{
	size_t n = strlen(s->hist);

	if (n >= sizeof(s->hist) - 1) {
		memmove(s->hist, s->hist + 16, n - 16 + 1);
		n -= 16;
	}
	s->hist[n] = op;
	s->hist[n + 1] = 0;
}

static int pagemap_fd = -1, kpageflags_fd = -1;

static void describe(const char *p)
{
	uint64_t ent = 0, fl = 0;

	if (pagemap_fd < 0)
		pagemap_fd = open("/proc/self/pagemap", O_RDONLY);
	if (kpageflags_fd < 0)
		kpageflags_fd = open("/proc/kpageflags", O_RDONLY);
	if (pread(pagemap_fd, &ent, 8, (uintptr_t)p / PS * 8) != 8)
		ent = 0;
	if ((ent >> 63) && pread(kpageflags_fd, &fl, 8, (ent & ((1ULL << 55) - 1)) * 8) != 8)
		fl = 0;
	fprintf(stderr, "#   pagemap %016llx kpageflags %016llx first words %016llx %016llx\n",
		(unsigned long long)ent, (unsigned long long)fl,
		(unsigned long long)((const uint64_t *)p)[0],
		(unsigned long long)((const uint64_t *)p)[1]);
}

struct client {
	char *area;		/* CPAGES normal pages */
	char *thp;		/* THP_SIZE, aligned, MADV_HUGEPAGE */
	struct shadow sh[CPAGES + THP_SIZE / PS];
	int npages;
	int failures;
};

static char *cpage(struct client *c, int j)
{
	return j < CPAGES ? c->area + (size_t)j * PS : c->thp + (size_t)(j - CPAGES) * PS;
}

static bool check_page(struct client *c, int j, const char *who)
{
	struct shadow *s = &c->sh[j];
	const char *p = cpage(c, j);
	bool ok = false;

	switch (s->kind) {
	case S_ZERO:
	case S_OWN:
		ok = true;
		for (size_t k = 0; k < PS; k++)
			if ((unsigned char)p[k] != (s->kind == S_ZERO ? 0 : s->own)) {
				ok = false;
				break;
			}
		break;
	case S_SRV:
		for (unsigned int v = s->vlo; v <= s->vhi && !ok; v++)
			ok = matches(p, s->id, s->i, v);
		break;
	}
	if (!ok) {
		uint64_t w = ((const uint64_t *)p)[0];

		fprintf(stderr, "# %s: page %d: oracle kind %d id %u i %u v %u..%u violated; history %s\n",
			who, j, s->kind, s->id, s->i, s->vlo, s->vhi, s->hist);
		/* fill(): word 0 is id << 48 ^ i << 32 ^ v << 16 */
		fprintf(stderr, "#   content looks like id %llu i %llu v %llu\n",
			(unsigned long long)(w >> 48), (unsigned long long)((w >> 32) & 0xffff),
			(unsigned long long)((w >> 16) & 0xffff));
		describe(p);
		c->failures++;
	}
	return ok;
}

static void check_all(struct client *c, const char *who)
{
	for (int j = 0; j < c->npages; j++)
		check_page(c, j, who);
}

static void client_merge(struct client *c)
{
	struct merge_page_vec vec[64];
	unsigned int lo[64], hi[64], id;
	int slot = rand() % NSERVERS, n = 1 + rand() % 64, idx[64];
	unsigned int flags = 0, gen;
	uintptr_t base;
	pid_t pid;
	long ret;

	gen = sh->srv[slot].gen;
	__sync_synchronize();
	pid = sh->srv[slot].pid;
	base = sh->srv[slot].base;
	id = sh->srv[slot].id;
	__sync_synchronize();
	if ((gen & 1) || gen != sh->srv[slot].gen)
		return;
	if (rand() % 4 == 0)
		flags |= MERGE_PAGE_NOWAIT;
	if (rand() % 2)
		flags |= MERGE_PAGE_NOSPLIT;
	for (int k = 0; k < n; k++) {
		int i = rand() % SPAGES;

		/* distinct destinations within one call */
		do {
			idx[k] = rand() % c->npages;
			for (int m = 0; m < k; m++)
				if (idx[m] == idx[k])
					idx[k] = -1;
		} while (idx[k] < 0);
		vec[k].src = base + (uintptr_t)i * PS;
		vec[k].dst = (uintptr_t)cpage(c, idx[k]);
		lo[k] = sh->srv[slot].lo[i];
	}
	__sync_synchronize();
	ret = merge_pages(pid, vec, n, flags);
	__sync_synchronize();
	__sync_fetch_and_add(&sh->merge_calls, 1);
	if (ret < 0) {
		ret = 0;
		switch (errno) {
		case ESRCH:		/* server restarted (or being reaped) */
		case EPERM:		/* DISALLOWMERGED for now */
		case EAGAIN:		/* NOWAIT, or busy */
		case EOPNOTSUPP:	/* run=2 for now */
		case EBUSY:		/* NOSPLIT on a THP */
		case EFAULT:		/* server gone between pid and mm */
			__sync_fetch_and_add(&sh->errors_ok, 1);
			break;
		default:
			/* Which entry failed, and what the oracle knows of it. */
			fprintf(stderr, "# merge_pages: unexpected %s\n", strerror(errno));
			fprintf(stderr, "#   n %d flags %#x server %d pid %d gen %u (now %u, pid %d); "
				"entry 0: src page %lu, dst page %d kind %d history %s\n",
				n, flags, slot, pid, gen, sh->srv[slot].gen, sh->srv[slot].pid,
				(unsigned long)((vec[0].src - base) / PS), idx[0],
				c->sh[idx[0]].kind, c->sh[idx[0]].hist);
			describe((const char *)(uintptr_t)vec[0].dst);
			c->failures++;
		}
	}
	/*
	 * Read the version windows' upper ends, then check that no restart
	 * began since we read gen: lo and hi must both be of this server.
	 */
	for (int k = 0; k < ret; k++)
		hi[k] = sh->srv[slot].hi[(vec[k].src - base) / PS];
	__sync_synchronize();
	if (gen != sh->srv[slot].gen)
		ret = -1;
	for (int k = 0; k < ret; k++) {
		int i = (vec[k].src - base) / PS;
		struct shadow *s = &c->sh[idx[k]];

		note(s, flags & MERGE_PAGE_NOSPLIT ? 'M' : 'm');
		s->kind = S_SRV;
		s->id = id;
		s->i = i;
		s->vlo = lo[k];
		s->vhi = hi[k];
		check_page(c, idx[k], "after merge");
	}
	if (ret > 0)
		__sync_fetch_and_add(&sh->merges, ret);
	if (ret < 0) {
		/* Unknown which server: trust nothing about those pages. */
		for (int k = 0; k < n; k++)
			madvise((void *)vec[k].dst, PS, MADV_DONTNEED);
		for (int k = 0; k < n; k++)
			c->sh[idx[k]].kind = S_ZERO;
	}
}

static void client_main(int no, unsigned int seed)
{
	struct client *c = calloc(1, sizeof(*c));
	char *raw;

	prctl(PR_SET_PDEATHSIG, SIGKILL);
	srand(seed);
	c->area = mmap(NULL, CPAGES * PS, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	raw = mmap(NULL, 2 * THP_SIZE, PROT_READ | PROT_WRITE,
		   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (c->area == MAP_FAILED || raw == MAP_FAILED)
		_exit(2);
	c->thp = (char *)(((uintptr_t)raw + THP_SIZE - 1) & ~(THP_SIZE - 1));
	madvise(c->area, CPAGES * PS, MADV_NOHUGEPAGE);
	madvise(c->area, CPAGES * PS, MADV_MERGEABLE);
	madvise(c->thp, THP_SIZE, MADV_HUGEPAGE);
	madvise(c->thp, THP_SIZE, MADV_MERGEABLE);
	c->npages = CPAGES + THP_SIZE / PS;
	memset(c->thp, 0x10 + no, THP_SIZE);
	for (int j = CPAGES; j < c->npages; j++) {
		c->sh[j].kind = S_OWN;
		c->sh[j].own = 0x10 + no;
	}

	while (!sh->stop && !c->failures) {
		int op = rand() % 100, j = rand() % c->npages;

		if (op < 55) {
			client_merge(c);
		} else if (op < 70) {
			unsigned char v = rand();

			memset(cpage(c, j), v, PS);
			c->sh[j].kind = S_OWN;
			c->sh[j].own = v;
			note(&c->sh[j], 'w');
		} else if (op < 75) {
			int n = 1 + rand() % 8;

			if (j + n > c->npages)
				n = c->npages - j;
			/* stay inside one area */
			if (j < CPAGES && j + n > CPAGES)
				n = CPAGES - j;
			madvise(cpage(c, j), n * PS, MADV_DONTNEED);
			for (int k = 0; k < n; k++) {
				c->sh[j + k].kind = S_ZERO;
				note(&c->sh[j + k], 'd');
			}
		} else if (op < 80) {
			madvise(cpage(c, j), PS, MADV_PAGEOUT);
			note(&c->sh[j], 'p');
		} else if (op < 84) {
			void *pages[8];
			int nodes[8], status[8];

			for (int k = 0; k < 8; k++) {
				int m = rand() % c->npages;

				pages[k] = cpage(c, m);
				nodes[k] = rand() % 2;
				note(&c->sh[m], 'g');
			}
			syscall(__NR_move_pages, 0, 8, pages, nodes, status, MPOL_MF_MOVE_ALL);
		} else if (op < 86) {
			pid_t pid;

			for (int k = 0; k < c->npages; k++)
				note(&c->sh[k], 'f');
			pid = fork();
			if (!pid) {
				check_all(c, "forked child");
				for (int k = 0; k < 16; k++)
					memset(cpage(c, rand() % c->npages), 0xee, PS);
				_exit(c->failures ? 1 : 0);
			}
			if (pid > 0) {
				int st;

				waitpid(pid, &st, 0);
				if (!WIFEXITED(st) || WEXITSTATUS(st)) {
					fprintf(stderr, "# forked child failed: %x\n", st);
					c->failures++;
				}
			}
		} else if (op < 90) {
			check_all(c, "client");
		} else {
			check_page(c, j, "client");
		}
	}
	check_all(c, "final");
	_exit(c->failures ? 1 : 0);
}

/* ------------------------------------------------------------------ */
/*
 * The pid wrapper on a pid that names no process.  The stress's servers are
 * killed and reaped while clients still merge from their pid: in the few
 * microseconds between release_task() detaching the server from its pid and
 * freeing the pid, pidfd_open() finds the pid but no process and fails with
 * EINVAL (ESRCH only from Linux 6.16).  A process group leader that was
 * reaped while a member of its group lives leaves its pid in that state for
 * as long as we like: merge_pages() must say ESRCH, as for any server that
 * is gone.  The id of a thread other than the leader is not a process: that
 * stays EINVAL.
 */
static int wrapper_vec(struct merge_page_vec *vec)
{
	static char *page;

	if (!page)
		page = mmap(NULL, PS, PROT_READ | PROT_WRITE,
			    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (page == MAP_FAILED)
		return -1;
	madvise(page, PS, MADV_MERGEABLE);
	vec->src = (uintptr_t)page;
	vec->dst = (uintptr_t)page;
	return 0;
}

static bool check_reaped_pid(int no)
{
	struct merge_page_vec vec;
	pid_t leader, member = 0;
	int p[2], fd, open_errno = 0;
	long ret;
	bool ok = false;

	if (wrapper_vec(&vec) || pipe(p))
		goto out;
	/* The member is reparented to us when the leader exits. */
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	leader = fork();
	if (!leader) {
		setpgid(0, 0);
		member = fork();
		if (!member) {
			pause();
			_exit(0);
		}
		_exit(write(p[1], &member, sizeof(member)) == sizeof(member) ? 0 : 1);
	}
	if (leader < 0 || read(p[0], &member, sizeof(member)) != sizeof(member))
		goto out;
	waitpid(leader, NULL, 0);
	fd = syscall(SYS_pidfd_open, leader, 0);
	if (fd >= 0)
		close(fd);
	else
		open_errno = errno;
	errno = 0;
	ret = merge_pages(leader, &vec, 1, 0);
	ok = ret == -1 && errno == ESRCH;
	printf("# reaped group leader %d: pidfd_open() %s, merge_pages() %ld %s\n", leader,
	       fd >= 0 ? "succeeded" : strerror(open_errno), ret, strerror(errno));
out:
	if (member > 0) {
		kill(member, SIGKILL);
		waitpid(member, NULL, 0);
	}
	prctl(PR_SET_CHILD_SUBREAPER, 0);
	printf("%s %d wrapper: pid of a reaped process gives ESRCH\n", ok ? "ok" : "not ok", no);
	fflush(stdout);
	return ok;
}

static pid_t thread_tid;
static pthread_mutex_t thread_done = PTHREAD_MUTEX_INITIALIZER;

static void *thread_main(void *arg)
{
	thread_tid = gettid();
	pthread_mutex_lock(&thread_done);	/* held by main until checked */
	pthread_mutex_unlock(&thread_done);
	return arg;
}

static bool check_thread_id(int no)
{
	struct merge_page_vec vec;
	pthread_t t;
	long ret = 0;
	bool ok = false;

	pthread_mutex_lock(&thread_done);
	if (wrapper_vec(&vec) == 0 && pthread_create(&t, NULL, thread_main, NULL) == 0) {
		while (!__atomic_load_n(&thread_tid, __ATOMIC_ACQUIRE))
			usleep(1000);
		errno = 0;
		ret = merge_pages(thread_tid, &vec, 1, 0);
		ok = ret == -1 && errno == EINVAL;
		printf("# thread %d: merge_pages() %ld %s\n", thread_tid, ret, strerror(errno));
		pthread_mutex_unlock(&thread_done);
		pthread_join(t, NULL);
	} else {
		pthread_mutex_unlock(&thread_done);
	}
	printf("%s %d wrapper: id of a thread other than the leader gives EINVAL\n",
	       ok ? "ok" : "not ok", no);
	fflush(stdout);
	return ok;
}

int main(int argc, char **argv)
{
	struct server srv[NSERVERS];
	pid_t clients[NCLIENTS];
	unsigned int seed = time(NULL), next_id = 1;
	int secs = 60, opt, failed = 0, wrapper_failed, status;
	time_t end;
	long ops = 0, restarts = 0, unmerges = 0, writes = 0;
	long saved_run, saved_scan, saved_sleep;

	while ((opt = getopt(argc, argv, "t:s:v")) != -1) {
		if (opt == 't')
			secs = atoi(optarg);
		else if (opt == 's')
			seed = strtoul(optarg, NULL, 0);
		else
			verbose = 1;
	}
	printf("TAP version 13\n1..3\n# seed %u, %d s\n", seed, secs);
	fflush(stdout);
	wrapper_failed = !check_reaped_pid(1) + !check_thread_id(2);
	srand(seed);
	saved_run = ksm_sysfs_get("run");
	saved_scan = ksm_sysfs_get("pages_to_scan");
	saved_sleep = ksm_sysfs_get("sleep_millisecs");
	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED || ksm_sysfs_set("run", 1) || ksm_sysfs_set("pages_to_scan", 100) ||
	    ksm_sysfs_set("sleep_millisecs", 5)) {
		printf("not ok 3 stress # setup failed: %s\n", strerror(errno));
		return 1;
	}
	memset(sh, 0, sizeof(*sh));
	for (int s = 0; s < NSERVERS; s++)
		server_start(&srv[s], s, next_id++);
	for (int c = 0; c < NCLIENTS; c++) {
		clients[c] = fork();
		if (!clients[c])
			client_main(c, seed * 31 + c);
	}

	end = time(NULL) + secs;
	while (time(NULL) < end) {
		int op = rand() % 100, s = rand() % NSERVERS;

		ops++;
		if (op < 50) {
			int i = rand() % SPAGES;

			/* Clients may see version hi or anything since lo. */
			sh->srv[s].hi[i]++;
			__sync_synchronize();
			server_cmd(&srv[s], 'w', i);
			__sync_synchronize();
			sh->srv[s].lo[i] = sh->srv[s].hi[i];
			writes++;
		} else if (op < 60) {
			server_cmd(&srv[s], 'd', 0);
			usleep(2000);
			server_cmd(&srv[s], 'a', 0);
		} else if (op < 65) {
			server_kill(&srv[s]);
			server_start(&srv[s], s, next_id++);
			restarts++;
		} else if (op < 80) {
			ksm_sysfs_set("pages_to_scan", rand() % 3 ? rand() % 5000 : 0);
			/* Never 0: with pages_to_scan 0 ksmd would spin. */
			ksm_sysfs_set("sleep_millisecs", 1 + rand() % 20);
		} else if (op < 82) {
			ksm_sysfs_set("run", 2);
			unmerges++;
			usleep(5000);
			ksm_sysfs_set("run", 1);
		} else if (op < 84) {
			int fd = open("/proc/sys/vm/compact_memory", O_WRONLY);

			if (fd >= 0) {
				if (write(fd, "1", 1) != 1)
					perror("compact_memory");
				close(fd);
			}
		}
		usleep(1000 + rand() % 5000);
		for (int c = 0; c < NCLIENTS; c++) {
			if (clients[c] && waitpid(clients[c], &status, WNOHANG) == clients[c]) {
				printf("# client %d ended early: status %x\n", c, status);
				failed++;
				clients[c] = 0;
			}
		}
		if (failed)
			break;
	}
	sh->stop = 1;
	for (int c = 0; c < NCLIENTS; c++) {
		if (!clients[c])
			continue;
		waitpid(clients[c], &status, 0);
		if (!WIFEXITED(status) || WEXITSTATUS(status)) {
			printf("# client %d: status %x\n", c, status);
			failed++;
		}
	}
	for (int s = 0; s < NSERVERS; s++)
		server_kill(&srv[s]);
	/* Back to the settings we found (ksmd must be in merge mode first). */
	ksm_sysfs_set("run", 1);
	ksm_sysfs_set("sleep_millisecs", saved_sleep);
	ksm_sysfs_set("pages_to_scan", saved_scan);
	ksm_sysfs_set("run", saved_run);
	printf("# %ld controller ops (%ld server writes, %ld server restarts, %ld run=2), "
	       "%lu merge_pages calls, %lu pages merged, %lu expected errors\n",
	       ops, writes, restarts, unmerges, sh->merge_calls, sh->merges, sh->errors_ok);
	printf("%s 3 stress: content oracle held in %d clients\n", failed ? "not ok" : "ok",
	       NCLIENTS);
	return failed || wrapper_failed ? 1 : 0;
}
