// SPDX-License-Identifier: GPL-2.0
/*
 * pageshare_filter_test - the pageshare QEMU filter against the real
 * merge_pages(2) kernel, in the ktest VM.
 *
 * Starts pageshare-server (config, image and list from the payload that
 * ktest.py packs under /pageshare), then the patched qemu-system-x86_64
 * under the qtest accelerator with the -blockdev graph of
 * qemu-patches/README.md (raw base -> pageshare filter, mode=merge ->
 * qcow2 overlay) on the PIIX IDE of -M pc.  No guest code runs: this
 * program drives the IDE controller through the qtest socket (PCI config
 * space, a PRD table in guest RAM, ATA READ DMA / WRITE DMA), so the
 * device DMA-reads base blocks straight into guest RAM, the one path where
 * the filter sees guest RAM and calls merge_pages().
 *
 * Then it checks, from outside QEMU: the bytes of every guest page read
 * (/proc/<qemu>/mem), that a listed block's guest page is the server's
 * physical page (pagemap PFN) and a KSM page (kpageflags), that an
 * unlisted one is not, the KSM counters of /sys/kernel/mm/ksm and the
 * filter's query-blockstats counters; copy-on-write after a guest write
 * (new PFN for the guest, the server's page unchanged, later readers still
 * merge the original); an IDE write through the overlay reads back as
 * written, unmerged.  Last, a timing phase: merge-ns per merged 4 KiB
 * block in merge mode and per copied block in copy mode.
 *
 * Output: TAP.  QEMU and the server are killed on every exit path.
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ksm_sysfs.h"
#include "page_hash.h"
#include "pageshare_table.h"

#define PS 4096UL
#define KPF_KSM 21
#define PM_PRESENT (1ULL << 63)
#define PM_PFN_MASK ((1ULL << 55) - 1)

/* Layout of the payload (ktest.py build_filter_payload()). */
static const char *payload = "/pageshare";
/* the block the booted guest overwrites (ktest.py GUEST_WRITE_BLOCK) */
#define GUEST_WRITE_BLOCK_C 5
#define WORK "/tmp/pageshare"

/* ----------------------------------------------------------------- TAP */

static int tap_n, tap_failed;

static void ok(bool cond, const char *fmt, ...)
{
	va_list ap;

	tap_n++;
	if (!cond)
		tap_failed++;
	printf("%sok %d ", cond ? "" : "not ", tap_n);
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
}

static void diag(const char *fmt, ...)
{
	va_list ap;

	printf("# ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
}

/* ------------------------------------------------------------ children */

static pid_t server_pid = -1;
/*
 * Every QEMU: the qtest ones (0, 1), the booted guest (0) and the QEMUs it
 * is migrated to (1, and 2 for the one that must refuse it).
 */
static pid_t qemu_pids[3] = { -1, -1, -1 };
static pid_t stall_pids[2] = { -1, -1 };	/* the stalled-client case's server, proxy */
static pid_t sampler_pid = -1;		/* bench/e2e_vs_ksm.py's sampler, run on the guest */

static void kill_child(pid_t *pid)
{
	if (*pid > 0) {
		kill(*pid, SIGKILL);
		waitpid(*pid, NULL, 0);
		*pid = -1;
	}
}

static void khugepaged_restore(void);

static void cleanup(void)
{
	khugepaged_restore();
	for (size_t i = 0; i < sizeof(qemu_pids) / sizeof(qemu_pids[0]); i++)
		kill_child(&qemu_pids[i]);
	kill_child(&server_pid);
	kill_child(&stall_pids[0]);
	kill_child(&stall_pids[1]);
	kill_child(&sampler_pid);
}

static void on_signal(int sig)
{
	cleanup();
	signal(sig, SIG_DFL);
	raise(sig);
}

static void show_log(const char *path)
{
	char line[512];
	FILE *f = fopen(path, "r");

	if (!f)
		return;
	diag("--- %s", path);
	while (fgets(line, sizeof(line), f)) {
		line[strcspn(line, "\n")] = 0;
		diag("  %s", line);
	}
	fclose(f);
}

static void bail(const char *fmt, ...)
{
	va_list ap;

	printf("Bail out! ");
	va_start(ap, fmt);
	vprintf(fmt, ap);
	va_end(ap);
	printf("\n");
	fflush(stdout);
	show_log(WORK "/server.log");
	show_log(WORK "/qemu0.log");
	show_log(WORK "/qemu1.log");
	show_log(WORK "/guest-qemu.log");
	show_log(WORK "/guest-dst-qemu.log");
	show_log(WORK "/guest-refused-qemu.log");
	cleanup();
	exit(1);
}

static pid_t spawn(char *const argv[], const char *logpath)
{
	pid_t pid = fork();

	if (pid < 0)
		bail("fork: %s", strerror(errno));
	if (pid == 0) {
		int fd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);

		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (fd >= 0) {
			dup2(fd, 1);
			dup2(fd, 2);
		}
		execv(argv[0], argv);
		fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
		_exit(127);
	}
	return pid;
}

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static bool alive(pid_t pid)
{
	return waitpid(pid, NULL, WNOHANG) == 0;
}

/* ---------------------------------------------------------------- files */

static uint8_t *image;
static size_t image_size;

static void load_image(const char *path)
{
	struct stat st;
	int fd = open(path, O_RDONLY);

	if (fd < 0 || fstat(fd, &st))
		bail("%s: %s", path, strerror(errno));
	image_size = st.st_size;
	image = malloc(image_size);
	if (!image || pread(fd, image, image_size, 0) != (ssize_t)image_size)
		bail("read %s", path);
	close(fd);
}

/* The list's header value for @key (static buffer). */
static const char *list_header(const char *path, const char *key)
{
	static char val[256];
	char line[512];
	FILE *f = fopen(path, "r");
	size_t kl = strlen(key);

	if (!f)
		bail("%s: %s", path, strerror(errno));
	while (fgets(line, sizeof(line), f)) {
		if (!strcmp(line, "---\n"))
			break;
		if (!strncmp(line, key, kl) && line[kl] == ':') {
			snprintf(val, sizeof(val), "%s", line + kl + 2);
			val[strcspn(val, "\n")] = 0;
			fclose(f);
			return val;
		}
	}
	fclose(f);
	bail("%s: no header %s", path, key);
	return NULL;
}

static void ksm_set(const char *name, long val)
{
	if (ksm_sysfs_set(name, val))
		diag("/sys/kernel/mm/ksm/%s = %ld: %s", name, val, strerror(errno));
}

static bool file_contains(const char *path, const char *needle)
{
	char line[1024];
	bool found = false;
	FILE *f = fopen(path, "r");

	if (!f)
		return false;
	while (!found && fgets(line, sizeof(line), f))
		found = strstr(line, needle) != NULL;
	fclose(f);
	return found;
}

/* ------------------------------------------------------------ processes */

struct proc {
	pid_t pid;
	int mem, pagemap;
};

static int kpageflags_fd = -1;

static void proc_open(struct proc *p, pid_t pid)
{
	char path[64];

	p->pid = pid;
	snprintf(path, sizeof(path), "/proc/%d/mem", pid);
	p->mem = open(path, O_RDONLY);
	snprintf(path, sizeof(path), "/proc/%d/pagemap", pid);
	p->pagemap = open(path, O_RDONLY);
	if (p->mem < 0 || p->pagemap < 0)
		bail("open /proc/%d/{mem,pagemap}: %s", pid, strerror(errno));
}

static void proc_close(struct proc *p)
{
	close(p->mem);
	close(p->pagemap);
}

static uint64_t pagemap_entry(const struct proc *p, uint64_t addr)
{
	uint64_t e = 0;

	if (pread(p->pagemap, &e, 8, addr / PS * 8) != 8)
		bail("pagemap of %d at %#" PRIx64 ": %s", p->pid, addr, strerror(errno));
	return e;
}

/* PFN of the page at addr, 0 if not present. */
static uint64_t pfn_of(const struct proc *p, uint64_t addr)
{
	uint64_t e = pagemap_entry(p, addr);

	return (e & PM_PRESENT) ? (e & PM_PFN_MASK) : 0;
}

static uint64_t kpageflags_of(uint64_t pfn)
{
	uint64_t fl = 0;

	if (kpageflags_fd < 0)
		kpageflags_fd = open("/proc/kpageflags", O_RDONLY);
	if (kpageflags_fd < 0 || pread(kpageflags_fd, &fl, 8, pfn * 8) != 8)
		bail("/proc/kpageflags: %s", strerror(errno));
	return fl;
}

static bool pfn_is_ksm(uint64_t pfn)
{
	return kpageflags_of(pfn) & (1ULL << KPF_KSM);
}

static void proc_read(const struct proc *p, uint64_t addr, void *buf, size_t len)
{
	if (pread(p->mem, buf, len, addr) != (ssize_t)len)
		bail("read /proc/%d/mem at %#" PRIx64 ": %s", p->pid, addr, strerror(errno));
}

/* ---------------------------------------------------------------- qtest */

struct qemu {
	int idx;
	pid_t pid;
	int qtest;		/* qtest socket */
	int qmp;		/* QMP socket */
	char rbuf[1 << 16];	/* qtest input */
	size_t rlen;
	char qbuf[1 << 16];	/* QMP input */
	size_t qlen;
	uint64_t ram_hva;	/* host address of guest physical 0 */
	struct proc proc;
	uint16_t bmdma;		/* BMDMA I/O base */
};

static void sun_path(struct sockaddr_un *sa, const char *path)
{
	size_t l = strlen(path);

	if (l >= sizeof(sa->sun_path))
		bail("socket path too long: %s", path);
	memcpy(sa->sun_path, path, l + 1);
}

static int unix_listen(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	unlink(path);
	sun_path(&sa, path);
	if (s < 0 || bind(s, (struct sockaddr *)&sa, sizeof(sa)) || listen(s, 1))
		bail("listen on %s: %s", path, strerror(errno));
	return s;
}

static int unix_connect(const char *path)
{
	struct sockaddr_un sa = { .sun_family = AF_UNIX };
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	sun_path(&sa, path);
	if (s < 0)
		bail("socket: %s", strerror(errno));
	if (connect(s, (struct sockaddr *)&sa, sizeof(sa))) {
		close(s);
		return -1;
	}
	return s;
}

/* One line from fd into line (buffered in q); bails on EOF or timeout. */
static void read_line(struct qemu *q, int fd, char *buf, size_t *len,
		      size_t cap, char *line, size_t linecap, int timeout_s)
{
	double deadline = now() + timeout_s;

	for (;;) {
		char *nl = memchr(buf, '\n', *len);
		struct pollfd pfd = { .fd = fd, .events = POLLIN };
		ssize_t n;

		if (nl) {
			size_t l = nl - buf;

			if (l >= linecap)
				bail("qemu %d: line of %zu bytes", q->idx, l);
			memcpy(line, buf, l);
			line[l] = 0;
			memmove(buf, nl + 1, *len - l - 1);
			*len -= l + 1;
			return;
		}
		if (*len == cap)
			bail("qemu %d: line too long", q->idx);
		if (poll(&pfd, 1, 1000) == 0) {
			if (now() > deadline)
				bail("qemu %d: no answer in %d s", q->idx, timeout_s);
			if (!alive(q->pid))
				bail("qemu %d exited", q->idx);
			continue;
		}
		n = read(fd, buf + *len, cap - *len);
		if (n <= 0)
			bail("qemu %d: connection closed (%s)", q->idx,
			     n < 0 ? strerror(errno) : "EOF");
		*len += n;
	}
}

static void write_all(int fd, const char *s, size_t len)
{
	while (len) {
		ssize_t n = write(fd, s, len);

		if (n <= 0)
			bail("write: %s", strerror(errno));
		s += n;
		len -= n;
	}
}

/* Send a qtest command; return the answer after "OK" (static buffer). */
static const char *qt(struct qemu *q, const char *fmt, ...)
{
	static char line[3 * 65536];
	static char cmd[3 * 65536];
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(cmd, sizeof(cmd) - 1, fmt, ap);
	va_end(ap);
	if (n < 0 || n >= (int)sizeof(cmd) - 1)
		bail("qtest command too long");
	cmd[n++] = '\n';
	write_all(q->qtest, cmd, n);
	for (;;) {
		read_line(q, q->qtest, q->rbuf, &q->rlen, sizeof(q->rbuf),
			  line, sizeof(line), 120);
		if (!strncmp(line, "IRQ", 3))
			continue;
		break;
	}
	if (strncmp(line, "OK", 2))
		bail("qtest: %.60s -> %s", cmd, line);
	return line[2] == ' ' ? line + 3 : line + 2;
}

static void outb(struct qemu *q, uint16_t port, uint8_t v)
{
	qt(q, "outb 0x%x 0x%x", port, v);
}

static void outl(struct qemu *q, uint16_t port, uint32_t v)
{
	qt(q, "outl 0x%x 0x%x", port, v);
}

static uint32_t in(struct qemu *q, const char *op, uint16_t port)
{
	return strtoul(qt(q, "%s 0x%x", op, port), NULL, 0);
}

static void gwrite(struct qemu *q, uint64_t gpa, const void *data, size_t len)
{
	static char hex[2 * 65536 + 1];
	const uint8_t *d = data;

	for (size_t off = 0; off < len; off += 32768) {
		size_t n = len - off < 32768 ? len - off : 32768;

		for (size_t i = 0; i < n; i++)
			sprintf(hex + 2 * i, "%02x", d[off + i]);
		qt(q, "write 0x%" PRIx64 " 0x%zx 0x%s", gpa + off, n, hex);
	}
}

static void gread(struct qemu *q, uint64_t gpa, void *data, size_t len)
{
	const char *r = qt(q, "read 0x%" PRIx64 " 0x%zx", gpa, len);
	uint8_t *d = data;

	if (strncmp(r, "0x", 2) || strlen(r) != 2 + 2 * len)
		bail("qtest read: bad answer");
	for (size_t i = 0; i < len; i++) {
		unsigned int v;

		sscanf(r + 2 + 2 * i, "%2x", &v);
		d[i] = v;
	}
}

/* ------------------------------------------------------------------ QMP */

static char qmp_reply[1 << 20];

static const char *qmp(struct qemu *q, const char *cmd)
{
	write_all(q->qmp, cmd, strlen(cmd));
	write_all(q->qmp, "\n", 1);
	for (;;) {
		read_line(q, q->qmp, q->qbuf, &q->qlen, sizeof(q->qbuf), qmp_reply,
			  sizeof(qmp_reply), 60);
		if (strstr(qmp_reply, "\"return\"") || strstr(qmp_reply, "\"error\""))
			break;
	}
	if (strstr(qmp_reply, "\"error\""))
		bail("QMP %s: %s", cmd, qmp_reply);
	return qmp_reply;
}

static void qmp_open(struct qemu *q, const char *path)
{
	double deadline = now() + 120;

	while ((q->qmp = unix_connect(path)) < 0) {
		if (now() > deadline || !alive(q->pid))
			bail("qemu %d: no QMP socket %s", q->idx, path);
		usleep(100000);
	}
	read_line(q, q->qmp, q->qbuf, &q->qlen, sizeof(q->qbuf), qmp_reply,
		  sizeof(qmp_reply), 60);
	qmp(q, "{\"execute\": \"qmp_capabilities\"}");
}

struct fstats {
	long requests, merged, merge_calls, merge_ns, not_listed, not_ram,
	     failed, unsupported, no_table, unproven, last_errno, generation;
	long refs_sent, refs_refused, refs_merged, refs_copied, refs_read, refs_failed;
	bool connected, base_changed;
};

static long json_num(const char *obj, const char *key)
{
	char pat[64];
	const char *p;

	snprintf(pat, sizeof(pat), "\"%s\":", key);
	p = strstr(obj, pat);
	if (!p)
		bail("QMP reply: no %s in %.300s", key, obj);
	return strtol(p + strlen(pat), NULL, 10);
}

static struct fstats filter_stats(struct qemu *q)
{
	const char *r = qmp(q, "{\"execute\": \"query-blockstats\", "
			    "\"arguments\": {\"query-nodes\": true}}");
	const char *d = strstr(r, "\"driver\": \"pageshare\"");
	static char obj[4096];
	const char *p, *e;
	struct fstats s;

	if (!d)
		bail("query-blockstats: no pageshare node: %.500s", r);
	/* its driver-specific object (flat, keys in any order) */
	for (p = d; p > r && *p != '{'; p--)
		;
	e = strchr(d, '}');
	if (!e || e - p >= (long)sizeof(obj))
		bail("query-blockstats: bad driver-specific object");
	memcpy(obj, p, e - p);
	obj[e - p] = 0;
	p = obj;
	s.requests = json_num(p, "requests");
	s.merged = json_num(p, "merged");
	s.merge_calls = json_num(p, "merge-calls");
	s.merge_ns = json_num(p, "merge-ns");
	s.not_listed = json_num(p, "fallback-not-listed");
	s.not_ram = json_num(p, "fallback-not-guest-ram");
	s.failed = json_num(p, "fallback-merge-failed");
	s.unsupported = json_num(p, "fallback-unsupported");
	s.no_table = json_num(p, "fallback-no-table");
	s.unproven = json_num(p, "fallback-unproven");
	s.base_changed = strstr(p, "\"base-changed\": true") != NULL;
	s.last_errno = json_num(p, "last-merge-errno");
	s.connected = strstr(p, "\"connected\": true") != NULL;
	/* migration by block reference: source, destination */
	s.refs_sent = json_num(p, "migration-refs-sent");
	s.refs_refused = json_num(p, "migration-refs-refused");
	s.refs_merged = json_num(p, "migration-refs-merged");
	s.refs_copied = json_num(p, "migration-refs-copied");
	s.refs_read = json_num(p, "migration-refs-read");
	s.refs_failed = json_num(p, "migration-refs-failed");
	/* only while a table is held */
	s.generation = strstr(p, "\"generation\":") ? json_num(p, "generation") : -1;
	return s;
}

/* ------------------------------------------------------------ the server */

static struct pst_table table;
static struct pst_table_msg table_msg;
static struct proc server;

static int recv_msg(int s, uint32_t *type, void *payload, size_t cap,
		    int fds[2], int timeout_s)
{
	uint32_t hdr[2];
	char cbuf[CMSG_SPACE(2 * sizeof(int))];
	struct iovec iov = { hdr, sizeof(hdr) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1,
			     .msg_control = cbuf, .msg_controllen = sizeof(cbuf) };
	struct pollfd pfd = { .fd = s, .events = POLLIN };
	struct cmsghdr *c;
	size_t got = 0;

	fds[0] = fds[1] = -1;
	if (poll(&pfd, 1, timeout_s * 1000) != 1)
		return -1;
	if (recvmsg(s, &mh, MSG_CMSG_CLOEXEC | MSG_WAITALL) != sizeof(hdr))
		return -1;
	for (c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
			size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);

			memcpy(fds, CMSG_DATA(c), (n > 2 ? 2 : n) * sizeof(int));
		}
	}
	*type = hdr[0];
	if (hdr[1] > cap)
		return -1;
	while (got < hdr[1]) {
		ssize_t n = recv(s, (char *)payload + got, hdr[1] - got, 0);

		if (n <= 0)
			return -1;
		got += n;
	}
	return hdr[1];
}

static int server_sock = -1;

static void start_server(void)
{
	char cfg[256], sock[256], err[160];
	char *argv[] = { NULL, "run", "--config", cfg, NULL };
	char bin[256];
	double t0 = now(), deadline = t0 + 300;

	snprintf(bin, sizeof(bin), "%s/bin/pageshare-server", payload);
	snprintf(cfg, sizeof(cfg), "%s/server.toml", payload);
	snprintf(sock, sizeof(sock), WORK "/run/base.sock");
	argv[0] = bin;
	server_pid = spawn(argv, WORK "/server.log");
	while ((server_sock = unix_connect(sock)) < 0) {
		if (now() > deadline || !alive(server_pid))
			bail("pageshare-server: no socket %s", sock);
		usleep(100000);
	}
	for (;;) {
		uint8_t buf[4096];
		uint32_t type;
		int fds[2];
		int n = recv_msg(server_sock, &type, buf, sizeof(buf), fds, 300);

		if (n < 0)
			bail("pageshare-server: no TABLE message");
		if (type == PST_MSG_NO_TABLE) {
			diag("server: NO_TABLE (%.*s); waiting", n > 8 ? n - 8 : 0, buf + 8);
			continue;
		}
		if (type != PST_MSG_TABLE || n != sizeof(table_msg) || fds[1] < 0)
			bail("pageshare-server: unexpected message %u", type);
		memcpy(&table_msg, buf, sizeof(table_msg));
		if (pst_open(&table, fds[0], err, sizeof(err)))
			bail("table: %s", err);
		close(fds[0]);
		close(fds[1]);
		break;
	}
	diag("server: table generation %" PRIu64 ", %" PRIu64 " entries, flags %#x, in %.1f s",
	     table_msg.generation, table_msg.entry_count, table_msg.flags, now() - t0);
	proc_open(&server, server_pid);
}

/* The server's address of block b, 0 if unlisted. */
static uint64_t srv_addr(uint64_t block)
{
	return pst_lookup(&table, block);
}

/* ------------------------------------------------------------------ QEMU */

static const char *image_sha;
/* the filter's server socket; NULL: the server's, WORK/run/base.sock */
static const char *qemu_server;
/* the base image QEMU opens; NULL: the server's, payload/base.raw */
static const char *qemu_base;

static void start_qemu(struct qemu *q, int idx, const char *mode)
{
	char qtest_path[128], qmp_path[128], ovl[128], log[128];
	char qtest_arg[160], qmp_arg[160], bin[256], img[256], share[256];
	char bd_base[512], bd_ps[512], bd_ovlf[512];
	char *argv[64];
	int argc = 0, ls, r;

	memset(q, 0, sizeof(*q));
	q->idx = idx;
	snprintf(qtest_path, sizeof(qtest_path), WORK "/qtest%d.sock", idx);
	snprintf(qmp_path, sizeof(qmp_path), WORK "/qmp%d.sock", idx);
	snprintf(ovl, sizeof(ovl), WORK "/ovl%d.qcow2", idx);
	snprintf(log, sizeof(log), WORK "/qemu%d.log", idx);
	if (qemu_base)
		snprintf(img, sizeof(img), "%s", qemu_base);
	else
		snprintf(img, sizeof(img), "%s/base.raw", payload);
	snprintf(share, sizeof(share), "%s/share/qemu", payload);

	/* The overlay, made by the patched qemu-img. */
	{
		char qimg[256], size[32], backing[300];
		char *iargv[] = { qimg, "create", "-q", "-f", "qcow2", "-F", "raw",
				  "-b", backing, ovl, size, NULL };
		pid_t p;
		int st;

		snprintf(qimg, sizeof(qimg), "%s/bin/qemu-img", payload);
		snprintf(backing, sizeof(backing), "%s", img);
		snprintf(size, sizeof(size), "%zu", image_size);
		unlink(ovl);
		p = spawn(iargv, WORK "/qemu-img.log");
		if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st)) {
			show_log(WORK "/qemu-img.log");
			bail("qemu-img create failed");
		}
	}

	ls = unix_listen(qtest_path);
	snprintf(bin, sizeof(bin), "%s/bin/qemu-system-x86_64", payload);
	snprintf(qtest_arg, sizeof(qtest_arg), "unix:%s", qtest_path);
	snprintf(qmp_arg, sizeof(qmp_arg), "unix:%s,server=on,wait=off", qmp_path);
	snprintf(bd_base, sizeof(bd_base),
		 "{\"driver\":\"file\",\"node-name\":\"base\",\"filename\":\"%s\",\"read-only\":true}",
		 img);
	r = snprintf(bd_ps, sizeof(bd_ps),
		     "{\"driver\":\"pageshare\",\"node-name\":\"ps\",\"file\":\"base\","
		     "\"read-only\":true,\"server\":\"%s\","
		     "\"mode\":\"%s\",\"image-sha256\":\"%s\"}",
		     qemu_server ? qemu_server : WORK "/run/base.sock", mode, image_sha);
	if (r >= (int)sizeof(bd_ps))
		bail("blockdev too long");
	snprintf(bd_ovlf, sizeof(bd_ovlf),
		 "{\"driver\":\"file\",\"node-name\":\"ovl-file\",\"filename\":\"%s\"}", ovl);
#define A(x) (argv[argc++] = (char *)(x))
	A(bin); A("-M"); A("pc"); A("-accel"); A("qtest");
	A("-qtest"); A(qtest_arg); A("-qtest-log"); A("none");
	A("-L"); A(share); A("-m"); A("64M"); A("-nodefaults");
	A("-display"); A("none"); A("-qmp"); A(qmp_arg);
	A("-blockdev"); A(bd_base); A("-blockdev"); A(bd_ps);
	A("-blockdev"); A(bd_ovlf);
	A("-blockdev");
	A("{\"driver\":\"qcow2\",\"node-name\":\"ovl\",\"file\":\"ovl-file\",\"backing\":\"ps\"}");
	A("-device"); A("ide-hd,drive=ovl,bus=ide.0,unit=0");
	A(NULL);
#undef A
	q->pid = spawn(argv, log);
	qemu_pids[idx] = q->pid;
	{
		struct pollfd pfd = { .fd = ls, .events = POLLIN };
		double deadline = now() + 180;

		while (poll(&pfd, 1, 1000) == 0) {
			if (now() > deadline || !alive(q->pid))
				bail("qemu %d did not connect to the qtest socket", idx);
		}
		q->qtest = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
		if (q->qtest < 0)
			bail("accept: %s", strerror(errno));
		close(ls);
	}
	qmp_open(q, qmp_path);
	proc_open(&q->proc, q->pid);
}

static void stop_qemu(struct qemu *q)
{
	close(q->qtest);
	close(q->qmp);
	proc_close(&q->proc);
	kill_child(&qemu_pids[q->idx]);
}

/*
 * Find the host address of guest RAM: write markers at two guest physical
 * addresses and look for them in qemu's present anonymous pages.
 */
static void find_ram(struct qemu *q)
{
	const uint64_t gpa[2] = { 0x200000, 0x2800000 };
	uint8_t marker[2][64];
	char path[64], line[512];
	FILE *maps;
	uint64_t found = 0;

	srand(getpid() ^ (unsigned int)time(NULL));
	for (int m = 0; m < 2; m++) {
		for (int i = 0; i < 64; i++)
			marker[m][i] = rand() & 0xff;
		memcpy(marker[m], "PAGESHARE-MARKER", 16);
		marker[m][16] = '0' + m;
		gwrite(q, gpa[m], marker[m], sizeof(marker[m]));
	}
	snprintf(path, sizeof(path), "/proc/%d/maps", q->pid);
	maps = fopen(path, "r");
	if (!maps)
		bail("%s: %s", path, strerror(errno));
	while (!found && fgets(line, sizeof(line), maps)) {
		uint64_t start, end, ino;
		char perms[8];
		int pathoff = 0;

		if (sscanf(line, "%" SCNx64 "-%" SCNx64 " %7s %*s %*s %" SCNu64 " %n",
			   &start, &end, perms, &ino, &pathoff) < 4)
			continue;
		if (strcmp(perms, "rw-p") || ino != 0 || line[pathoff] == '/')
			continue;
		for (uint64_t a = start; a < end && !found; a += 512 * PS) {
			uint64_t pm[512];
			size_t n = (end - a) / PS < 512 ? (end - a) / PS : 512;

			if (pread(q->proc.pagemap, pm, n * 8, a / PS * 8) != (ssize_t)(n * 8))
				bail("pagemap of qemu: %s", strerror(errno));
			for (size_t i = 0; i < n && !found; i++) {
				uint8_t buf[64];

				if (!(pm[i] & PM_PRESENT))
					continue;
				proc_read(&q->proc, a + i * PS, buf, sizeof(buf));
				if (!memcmp(buf, marker[0], 64))
					found = a + i * PS - gpa[0];
			}
		}
	}
	fclose(maps);
	if (!found)
		bail("qemu %d: guest RAM marker not found", q->idx);
	{
		uint8_t buf[64];

		proc_read(&q->proc, found + gpa[1], buf, sizeof(buf));
		if (memcmp(buf, marker[1], 64))
			bail("qemu %d: second marker not at the same offset", q->idx);
	}
	q->ram_hva = found;
	diag("qemu %d: guest RAM at %#" PRIx64, q->idx, found);
}

/* --------------------------------------------------------------- IDE */

#define IDE_BASE 0x1f0
#define IDE_CTRL 0x3f6
#define REG_NSECT 2
#define REG_LBA_LOW 3
#define REG_LBA_MID 4
#define REG_LBA_HIGH 5
#define REG_DEVICE 6
#define REG_CMD 7		/* write: command, read: status */
#define LBA 0x40
#define BSY 0x80
#define DRDY 0x40
#define DRQ 0x08
#define ERR 0x01
#define CMD_READ_DMA 0xc8
#define CMD_WRITE_DMA 0xca
#define BM_CMD 0
#define BM_STATUS 2
#define BM_PRDT 4
#define BM_CMD_START 0x1
#define BM_CMD_WRITE 0x8	/* the device writes to memory */
#define BM_STS_ACTIVE 0x1
#define BM_STS_ERROR 0x2
#define BM_STS_INTR 0x4
#define PRDT_EOT 0x80000000u
#define PRDT_GPA 0x300000
#define BMDMA_PORT 0xc000

static uint32_t pci_cfg_addr(int dev, int fn, int reg)
{
	return 0x80000000u | (dev << 11) | (fn << 8) | (reg & 0xfc);
}

static uint32_t pci_read(struct qemu *q, int dev, int fn, int reg)
{
	outl(q, 0xcf8, pci_cfg_addr(dev, fn, reg));
	return in(q, "inl", 0xcfc);
}

static void pci_write(struct qemu *q, int dev, int fn, int reg, uint32_t v)
{
	outl(q, 0xcf8, pci_cfg_addr(dev, fn, reg));
	outl(q, 0xcfc, v);
}

/* PIIX3 IDE is 00:01.1 on -M pc: BMDMA BAR4, I/O and bus master on. */
static void ide_init(struct qemu *q)
{
	uint32_t id = pci_read(q, 1, 1, 0);

	if (id != 0x70108086)
		bail("00:01.1 is %08x, not the PIIX3 IDE (8086:7010)", id);
	pci_write(q, 1, 1, 0x20, BMDMA_PORT | 1);
	pci_write(q, 1, 1, 0x04, (pci_read(q, 1, 1, 0x04) & 0xffff) | 0x1 | 0x4);
	q->bmdma = BMDMA_PORT;
	if ((pci_read(q, 1, 1, 0x20) & 0xfff0) != BMDMA_PORT)
		bail("BMDMA BAR did not stick");
}

struct prd {
	uint32_t addr;
	uint32_t size;		/* bytes; bit 31: end of table */
};

/*
 * One ATA DMA command: @nsect sectors at @lba, to/from the guest pages of
 * @prd (n entries).  Returns the IDE status; bails if it does not end.
 */
static uint8_t ide_dma(struct qemu *q, uint8_t cmd, uint64_t lba, unsigned int nsect,
		       struct prd *prd, int n)
{
	double deadline = now() + 120;
	uint8_t st, bm;

	prd[n - 1].size |= PRDT_EOT;
	outb(q, q->bmdma + BM_CMD, 0);
	outb(q, q->bmdma + BM_STATUS, BM_STS_INTR | BM_STS_ERROR);
	gwrite(q, PRDT_GPA, prd, n * sizeof(*prd));
	outl(q, q->bmdma + BM_PRDT, PRDT_GPA);
	outb(q, IDE_BASE + REG_DEVICE, LBA);
	outb(q, IDE_BASE + REG_NSECT, nsect & 0xff);	/* 0 = 256 */
	outb(q, IDE_BASE + REG_LBA_LOW, lba & 0xff);
	outb(q, IDE_BASE + REG_LBA_MID, (lba >> 8) & 0xff);
	outb(q, IDE_BASE + REG_LBA_HIGH, (lba >> 16) & 0xff);
	outb(q, IDE_BASE + REG_DEVICE, LBA | ((lba >> 24) & 0xf));
	outb(q, IDE_BASE + REG_CMD, cmd);
	outb(q, q->bmdma + BM_CMD,
	     BM_CMD_START | (cmd == CMD_READ_DMA ? BM_CMD_WRITE : 0));
	do {
		if (now() > deadline)
			bail("qemu %d: DMA did not finish", q->idx);
		bm = in(q, "inb", q->bmdma + BM_STATUS);
	} while ((bm & (BM_STS_ACTIVE | BM_STS_INTR)) == BM_STS_ACTIVE);
	outb(q, q->bmdma + BM_CMD, 0);
	st = in(q, "inb", IDE_BASE + REG_CMD);
	if ((st & (BSY | DRQ | ERR)) || !(st & DRDY) || (bm & BM_STS_ERROR))
		diag("qemu %d: IDE status %#x, BM status %#x", q->idx, st, bm);
	return st;
}

static bool ide_ok(uint8_t st)
{
	return !(st & (BSY | DRQ | ERR)) && (st & DRDY);
}

/* Read blocks [first, first + n) into guest pages gpa[0..n). */
static bool read_blocks(struct qemu *q, uint64_t first, unsigned int n, const uint64_t *gpa)
{
	struct prd prd[64];

	for (unsigned int i = 0; i < n; i++)
		prd[i] = (struct prd){ (uint32_t)gpa[i], PS };
	return ide_ok(ide_dma(q, CMD_READ_DMA, first * 8, n * 8, prd, n));
}

/* ------------------------------------------------------------- checks */

struct page_state {
	bool bytes_ok, merged, ksm;
	uint64_t pfn, srv_pfn;
};

static struct page_state check_page(struct qemu *q, uint64_t gpa, uint64_t block,
				    const uint8_t *expect)
{
	struct page_state s = { 0 };
	uint8_t buf[PS];
	uint64_t hva = q->ram_hva + gpa;

	proc_read(&q->proc, hva, buf, PS);
	s.bytes_ok = !memcmp(buf, expect ? expect : image + block * PS, PS);
	s.pfn = pfn_of(&q->proc, hva);
	s.ksm = s.pfn && pfn_is_ksm(s.pfn);
	if (srv_addr(block))
		s.srv_pfn = pfn_of(&server, srv_addr(block));
	s.merged = s.pfn && s.pfn == s.srv_pfn;
	return s;
}

struct counters {
	long merged, sources, failed, shared, sharing;
};

static struct counters ksm_counters(void)
{
	return (struct counters){ ksm_sysfs_get("merge_page_merged"), ksm_sysfs_get("merge_page_sources"),
				  ksm_sysfs_get("merge_page_failed"), ksm_sysfs_get("pages_shared"),
				  ksm_sysfs_get("pages_sharing") };
}

/*
 * Read blocks [first, first + n) into gpa[] and check each page.  Returns
 * the number of listed blocks; *merged_ok says whether every listed block
 * is the server's page (KSM) and every unlisted one is not, with the right
 * bytes everywhere.
 */
static unsigned int read_and_check(struct qemu *q, const char *what, uint64_t first,
				   unsigned int n, const uint64_t *gpa, bool expect_merge)
{
	unsigned int listed = 0, bad_bytes = 0, bad_merge = 0;

	ok(read_blocks(q, first, n, gpa), "%s: READ DMA of blocks %" PRIu64 "-%" PRIu64
	   " completes", what, first, first + n - 1);
	for (unsigned int i = 0; i < n; i++) {
		uint64_t b = first + i;
		bool is_listed = srv_addr(b) != 0;
		struct page_state s = check_page(q, gpa[i], b, NULL);
		bool want = is_listed && expect_merge;

		listed += is_listed;
		if (!s.bytes_ok) {
			bad_bytes++;
			diag("%s: block %" PRIu64 " at gpa %#" PRIx64 ": wrong bytes", what, b, gpa[i]);
		}
		if (s.merged != want || s.ksm != want) {
			bad_merge++;
			diag("%s: block %" PRIu64 " (%s): pfn %#" PRIx64 " server pfn %#" PRIx64
			     " ksm %d, expected %s", what, b, is_listed ? "listed" : "unlisted",
			     s.pfn, s.srv_pfn, s.ksm, want ? "merged" : "not merged");
		}
	}
	ok(bad_bytes == 0, "%s: all %u pages hold the image's bytes", what, n);
	ok(bad_merge == 0, "%s: %s", what, expect_merge ?
	   "listed blocks are the server's page (same PFN, KPF_KSM), unlisted ones are not" :
	   "no page is the server's page or a KSM page");
	return listed;
}

static void gpas(uint64_t *out, unsigned int n, uint64_t base, uint64_t stride)
{
	for (unsigned int i = 0; i < n; i++)
		out[i] = base + i * stride;
}

/*
 * Every block the list can name (blocks below 1024: ktest.py lists all but
 * each eighth of them), 32 at a time (one ATA command's 256 sectors) into
 * the same guest pages, each checked right after its read: the image's
 * bytes everywhere, and (unless EXPECT_ANY: another server's pages) a
 * listed block the server's page exactly when EXPECT_MERGED.  One TAP line
 * for the bytes, one for the pages.  Returns the listed blocks.
 */
enum merge_expect { EXPECT_MERGED, EXPECT_NOT_MERGED, EXPECT_ANY };

static unsigned int check_every_listed_block(struct qemu *q, const char *what,
					     enum merge_expect expect)
{
	const bool expect_merge = expect == EXPECT_MERGED;
	const uint64_t end = image_size / PS < 1024 ? image_size / PS : 1024;
	unsigned int listed = 0, bad_bytes = 0, bad_merge = 0, reads_failed = 0;
	uint64_t gpa[32];

	gpas(gpa, 32, 0x600000, PS);
	for (uint64_t first = 0; first < end; first += 32) {
		unsigned int n = end - first < 32 ? (unsigned int)(end - first) : 32;

		if (!read_blocks(q, first, n, gpa)) {
			reads_failed++;
			continue;
		}
		for (unsigned int i = 0; i < n; i++) {
			uint64_t b = first + i;
			bool is_listed = srv_addr(b) != 0;
			struct page_state st = check_page(q, gpa[i], b, NULL);
			bool want = is_listed && expect_merge;

			listed += is_listed;
			if (!st.bytes_ok && bad_bytes++ < 5)
				diag("%s: block %" PRIu64 ": wrong bytes", what, b);
			if (expect != EXPECT_ANY && (st.merged != want || st.ksm != want) &&
			    bad_merge++ < 5)
				diag("%s: block %" PRIu64 " (%s): pfn %#" PRIx64 " ksm %d, expected %s",
				     what, b, is_listed ? "listed" : "unlisted", st.pfn, st.ksm,
				     want ? "merged" : "not merged");
		}
	}
	ok(reads_failed == 0 && bad_bytes == 0,
	   "%s: every block 0-%" PRIu64 " (%u listed) holds this chain's bytes "
	   "(%u wrong, %u reads failed)", what, end - 1, listed, bad_bytes, reads_failed);
	if (expect != EXPECT_ANY)
		ok(bad_merge == 0, "%s: %s (%u not)", what, expect_merge ?
		   "every listed block is the server's page, no unlisted one is" :
		   "no block is the server's page or a KSM page", bad_merge);
	return listed;
}

/* ------------------------------------------------------ a booted guest */

/*
 * A small guest kernel (the 6.12 source with config/guest.config, built by
 * ktest.py and packed into the payload as guest/vmlinuz; not Debian's)
 * boots under TCG inside this VM from a qcow2 overlay of base.raw through
 * the filter in merge mode, virtio-blk, and reads the listed blocks into
 * its page cache (the init script is ktest.py's GUEST_INIT).  From
 * outside: the guest pages that hold listed blocks are the server's
 * physical pages, with the image's bytes, every one of them, also after
 * khugepaged scanned guest RAM (census_soak()); the guest's own checksum of what
 * it read is the image's; the server is SIGKILLed and restarted between
 * two phases of reading and the guest goes on (and merges again); it is
 * live-migrated to a second QEMU with block-refs and its merged pages
 * arrive as the server's pages (migrate_guest()); a guest write gets its
 * own page.
 */

struct pfn_at {
	uint64_t pfn, hva;
};

static int pfn_cmp(const void *a, const void *b)
{
	const struct pfn_at *x = a, *y = b;

	return x->pfn < y->pfn ? -1 : x->pfn > y->pfn;
}

/* qemu's guest RAM: its largest anonymous mapping, [*lo, *hi). */
static void guest_ram(struct qemu *q, uint64_t *lo, uint64_t *hi)
{
	char path[64], line[512];
	FILE *maps;

	*lo = *hi = 0;
	snprintf(path, sizeof(path), "/proc/%d/maps", q->pid);
	maps = fopen(path, "r");
	if (!maps)
		bail("%s: %s", path, strerror(errno));
	while (fgets(line, sizeof(line), maps)) {
		uint64_t l, h;
		char perms[8];
		int name = 0;

		if (sscanf(line, "%" SCNx64 "-%" SCNx64 " %7s %*s %*s %*s %n", &l, &h, perms,
			   &name) < 3 || strncmp(perms, "rw-p", 4))
			continue;
		if (line[name] != '\n' && line[name] != '\0')
			continue;               /* not anonymous */
		if (h - l > *hi - *lo) {
			*lo = l;
			*hi = h;
		}
	}
	fclose(maps);
}

/* Every present page of qemu's guest RAM. */
static struct pfn_at *guest_pfns(struct qemu *q, size_t *n)
{
	uint64_t best_lo, best_hi;
	struct pfn_at *out;

	guest_ram(q, &best_lo, &best_hi);
	out = calloc((best_hi - best_lo) / PS + 1, sizeof(*out));
	*n = 0;
	for (uint64_t a = best_lo; a < best_hi; a += PS) {
		uint64_t pfn = pfn_of(&q->proc, a);

		if (pfn)
			out[(*n)++] = (struct pfn_at){ pfn, a };
	}
	qsort(out, *n, sizeof(*out), pfn_cmp);
	return out;
}

static const struct pfn_at *find_pfn(const struct pfn_at *v, size_t n, uint64_t pfn)
{
	struct pfn_at key = { pfn, 0 };

	return bsearch(&key, v, n, sizeof(*v), pfn_cmp);
}

/*
 * The server's PFN of each of the guest's blocks before the server was
 * restarted: blocks the guest read ahead then are the old server's pages.
 */
static uint64_t old_server_pfn[1024];

/*
 * Listed blocks of [first, end) whose server page (the running server's,
 * or the one before a restart) the guest maps; *bad counts those whose
 * bytes differ from the image or that are not KSM.  *whva gets the
 * guest-RAM address of block @wblock if mapped.
 */
static unsigned int guest_merged(struct qemu *q, uint64_t first, uint64_t end,
				 unsigned int *listed, unsigned int *bad, uint64_t wblock,
				 uint64_t *whva)
{
	size_t n;
	struct pfn_at *v = guest_pfns(q, &n);
	unsigned int found = 0;

	*listed = *bad = 0;
	for (uint64_t b = first; b < end; b++) {
		const struct pfn_at *hit;
		uint64_t spfn;
		uint8_t buf[PS];

		if (!srv_addr(b))
			continue;
		(*listed)++;
		spfn = pfn_of(&server, srv_addr(b));
		hit = spfn ? find_pfn(v, n, spfn) : NULL;
		if (!hit && b < 1024 && old_server_pfn[b]) {
			spfn = old_server_pfn[b];
			hit = find_pfn(v, n, spfn);
		}
		if (!hit)
			continue;
		found++;
		proc_read(&q->proc, hit->hva, buf, PS);
		if (memcmp(buf, image + b * PS, PS) || !pfn_is_ksm(spfn))
			(*bad)++;
		if (b == wblock && whva)
			*whva = hit->hva;
	}
	free(v);
	return found;
}

static void guest_expect(struct qemu *q, int con, const char *marker, char *line,
			 size_t cap, int timeout_s)
{
	for (;;) {
		read_line(q, con, q->rbuf, &q->rlen, sizeof(q->rbuf), line, cap, timeout_s);
		if (strstr(line, "GUEST-ERROR"))
			bail("guest: %s", line);
		if (strstr(line, marker))
			return;
	}
}

/*
 * Every guest page that holds a listed block's bytes, by content, and what
 * backs it: the server's page (what merge_pages() makes), another KSM page
 * (ksmd's), or a private page, and of those how many are THP subpages (what
 * a khugepaged collapse leaves).  The guest's own copies of block data are
 * not page-aligned here (dd's buffer is malloc'd), so a private page with a
 * listed block's bytes is a merged page the host replaced, or a read the
 * filter did not merge.
 */
struct census {
	unsigned int held, on_server, other_ksm, private, private_thp;
	uint64_t first_private_hva;
};

#define KPF_THP 22

static struct census guest_census(struct qemu *q, uint64_t first, uint64_t end)
{
	struct census c = { 0 };
	size_t n;
	struct pfn_at *v = guest_pfns(q, &n);
	uint8_t buf[PS];

	for (size_t i = 0; i < n; i++) {
		uint64_t b, fl;

		proc_read(&q->proc, v[i].hva, buf, PS);
		for (b = first; b < end; b++) {
			/* the first 8 bytes pick candidates; memcmp decides */
			if (srv_addr(b) && !memcmp(buf, image + b * PS, 8) &&
			    !memcmp(buf, image + b * PS, PS))
				break;
		}
		if (b == end)
			continue;
		c.held++;
		fl = kpageflags_of(v[i].pfn);
		if (v[i].pfn == pfn_of(&server, srv_addr(b)) ||
		    (b < 1024 && v[i].pfn == old_server_pfn[b])) {
			c.on_server++;
		} else if (fl & (1ULL << KPF_KSM)) {
			c.other_ksm++;
		} else {
			if (!c.private)
				c.first_private_hva = v[i].hva;
			c.private++;
			if (fl & (1ULL << KPF_THP))
				c.private_thp++;
		}
	}
	free(v);
	return c;
}

#define KHUGEPAGED "/sys/kernel/mm/transparent_hugepage/khugepaged/"

static long khugepaged_get(const char *name)
{
	char path[128];
	long val = -1;
	FILE *f;

	snprintf(path, sizeof(path), KHUGEPAGED "%s", name);
	f = fopen(path, "r");
	if (!f || fscanf(f, "%ld", &val) != 1)
		bail("%s: %s", path, f ? "no number" : strerror(errno));
	fclose(f);
	return val;
}

/* 0, or -1 with errno set */
static int khugepaged_write(const char *name, long val)
{
	char path[128];
	FILE *f;

	snprintf(path, sizeof(path), KHUGEPAGED "%s", name);
	f = fopen(path, "w");
	if (!f)
		return -1;
	if (fprintf(f, "%ld\n", val) < 0) {
		fclose(f);
		return -1;
	}
	return fclose(f) ? -1 : 0;
}

static void khugepaged_set(const char *name, long val)
{
	if (khugepaged_write(name, val))
		bail("write " KHUGEPAGED "%s: %s", name, strerror(errno));
}

static void restart_server(void)
{
	close(server_sock);
	proc_close(&server);
	kill_child(&server_pid);
	unlink(WORK "/run/base.sock");
	unlink(WORK "/run/control.sock");
	start_server();
}

/*
 * Read-time sharing must hold for every page: each guest page that holds a
 * listed block's bytes is the server's page right after the reads, and
 * stays so while khugepaged scans guest RAM (QEMU asks for THP there) at
 * many times its default rate.  With khugepaged's default max_ptes_shared
 * (256) it does not: khugepaged collapses a 2 MiB range of guest RAM that
 * holds up to 256 shared pages into a new huge page, copying the server's
 * pages (here 2 collapses unshared 65 of 448; in the end-to-end benchmark
 * the drops in sharing after the reads came with collapses).  A pageshare
 * host runs with max_ptes_shared = 0 (`pageshare host check` says so), as
 * this whole test does; the knobs are restored on every way out.
 */
static long khp_saved_sleep = -1, khp_saved_pages = -1, khp_saved_shared = -1;

/* Also from cleanup(), so it reports a failure rather than bail again. */
static void khugepaged_restore(void)
{
	long sleep_ms = khp_saved_sleep, pages = khp_saved_pages, shared = khp_saved_shared;

	khp_saved_sleep = -1;
	khp_saved_pages = -1;
	khp_saved_shared = -1;
	if (sleep_ms >= 0 && khugepaged_write("scan_sleep_millisecs", sleep_ms))
		diag("could not restore khugepaged's scan_sleep_millisecs to %ld", sleep_ms);
	if (pages >= 0 && khugepaged_write("pages_to_scan", pages))
		diag("could not restore khugepaged's pages_to_scan to %ld", pages);
	if (shared >= 0 && khugepaged_write("max_ptes_shared", shared))
		diag("could not restore khugepaged's max_ptes_shared to %ld", shared);
}

/*
 * What a pageshare host sets: khugepaged never collapses a shared page.
 * For the whole test: at the default, a collapse at khugepaged's own pace
 * can unshare a merged page any earlier check looks at again.
 */
static void khugepaged_as_on_a_pageshare_host(void)
{
	if (khp_saved_shared < 0)
		khp_saved_shared = khugepaged_get("max_ptes_shared");
	khugepaged_set("max_ptes_shared", 0);
}

/*
 * What measures sharing must not undo it.  The end-to-end benchmark's
 * sampler (e2e_sampler, built with these tests) reads guest pages from
 * outside to classify them by content; run here on the booted guest for
 * at least two full passes, it must leave every listed page the server's.
 * When it read them with process_vm_readv(2) it did not: that call pins
 * what it reads, and a read-only pin of a KSM page must unshare it first
 * (gup_must_unshare()), so each KSM page it read, the guest got a private
 * copy of.  The end-to-end runs counted those as listed pages unshared
 * right after their merge (up to 38 % of a guest's, for minutes, until
 * ksmd merged the copies again).  The sampler reads /proc/PID/mem now.
 */
static void sampler_keeps_sharing(struct qemu *q, const struct census *before)
{
	char hashes[] = WORK "/listed.hashes", spid[16], gpid[32], line[512];
	char *argv[] = { "/tests/e2e_sampler", "census", hashes, "100", spid, "128", gpid,
			 NULL };
	long samples = 0, full = 0, listed = -1, shared = -1;
	struct census c;
	double deadline;
	FILE *f;

	f = fopen(hashes, "wb");
	if (!f)
		bail("%s: %s", hashes, strerror(errno));
	for (uint64_t b = 0; b < image_size / PS; b++) {
		uint64_t h;

		if (!srv_addr(b))
			continue;
		h = page_hash((const uint64_t *)(image + b * PS));
		if (fwrite(&h, sizeof(h), 1, f) != 1)
			bail("%s: %s", hashes, strerror(errno));
	}
	if (fclose(f))
		bail("%s: %s", hashes, strerror(errno));
	snprintf(spid, sizeof(spid), "%d", (int)server_pid);
	snprintf(gpid, sizeof(gpid), "%d:-", (int)q->pid);
	sampler_pid = spawn(argv, WORK "/sampler.log");
	/* the sampler's lines: "E2E-G cfg t guest ... listed listed_shared ... full ..." */
	deadline = now() + 180;
	while (full < 3 && now() < deadline && alive(sampler_pid)) {
		usleep(500000);
		samples = full = 0;
		f = fopen(WORK "/sampler.log", "r");
		while (f && fgets(line, sizeof(line), f)) {
			long v[20];

			if (strncmp(line, "E2E-G ", 6))
				continue;
			samples++;
			/* after "E2E-G cfg": t guest cpu rss pss present ksm listed shared ... full */
			if (sscanf(line, "E2E-G %*s %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld %ld "
				   "%ld %ld %ld %ld %ld", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5],
				   &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13],
				   &v[14], &v[15], &v[16], &v[17]) == 18 && v[17] == 1) {
				full++;
				listed = v[7];
				shared = v[8];
			}
		}
		if (f)
			fclose(f);
	}
	kill(sampler_pid, SIGTERM);
	waitpid(sampler_pid, NULL, 0);
	sampler_pid = -1;
	c = guest_census(q, 0, 512);
	ok(full >= 3 && listed > 0 && c.held == before->held && c.private == 0 &&
	   c.other_ksm == 0,
	   "booted guest: after the end-to-end sampler read its pages (%ld samples, %ld full, "
	   "the last full one: %ld listed, %ld shared), all %u are still the server's pages "
	   "(%u private; %u before)", samples, full, listed, shared, c.held, c.private,
	   before->held);
	if (full < 3)
		show_log(WORK "/sampler.log");
}

static void census_soak(struct qemu *q)
{
	struct census c = guest_census(q, 0, 512);
	long scans0, collapsed0;
	double deadline;

	ok(c.held > 0 && c.private == 0 && c.other_ksm == 0,
	   "booted guest: all %u guest pages with a listed block's bytes are the server's "
	   "pages after the reads (%u private, %u of them THP subpages, first at %#" PRIx64
	   "; %u other KSM pages)", c.held, c.private, c.private_thp, c.first_private_hva,
	   c.other_ksm);
	sampler_keeps_sharing(q, &c);

	khp_saved_sleep = khugepaged_get("scan_sleep_millisecs");
	khp_saved_pages = khugepaged_get("pages_to_scan");
	scans0 = khugepaged_get("full_scans");
	collapsed0 = khugepaged_get("pages_collapsed");
	khugepaged_set("scan_sleep_millisecs", 100);
	khugepaged_set("pages_to_scan", 1 << 16);
	deadline = now() + 120;
	while (khugepaged_get("full_scans") < scans0 + 3 && now() < deadline)
		usleep(200000);
	diag("khugepaged: %ld full scans, %ld pages collapsed, max_ptes_shared %ld",
	     khugepaged_get("full_scans") - scans0, khugepaged_get("pages_collapsed") - collapsed0,
	     khugepaged_get("max_ptes_shared"));
	khugepaged_set("scan_sleep_millisecs", khp_saved_sleep);
	khugepaged_set("pages_to_scan", khp_saved_pages);
	c = guest_census(q, 0, 512);
	ok(c.held > 0 && c.private == 0 && c.other_ksm == 0,
	   "booted guest: after khugepaged scanned guest RAM 3 times, still all %u are the "
	   "server's pages (%u private, %u of them THP subpages; %u other KSM pages)",
	   c.held, c.private, c.private_thp, c.other_ksm);
}

/*
 * The booted guest's QEMU, with the same machine and -blockdev graph (the
 * base, the filter in merge mode on the server's socket, the one overlay
 * file: shared storage) for the guest and for the QEMUs it is migrated to,
 * which get -incoming defer.  @name names its console and QMP sockets and
 * its log (WORK/<name>-qemu.log).  Returns the console, connected: QEMU
 * waits for it before it starts.
 */
static int start_guest_qemu(struct qemu *q, int idx, const char *name, bool incoming)
{
	char gk[256], gi[256], share[256], bin[256], img[256], con_path[128], qmp_path[128];
	char con_arg[256], qmp_arg[256], bd_base[512], bd_ps[512], bd_ovlf[512], log[128];
	char *argv[64];
	int argc = 0, con;
	double deadline;

	memset(q, 0, sizeof(*q));
	q->idx = idx;
	q->qtest = -1;			/* none: the guest runs code of its own */
	snprintf(gk, sizeof(gk), "%s/guest/vmlinuz", payload);
	snprintf(gi, sizeof(gi), "%s/guest/initramfs.cpio.gz", payload);
	snprintf(share, sizeof(share), "%s/share/qemu", payload);
	snprintf(bin, sizeof(bin), "%s/bin/qemu-system-x86_64", payload);
	snprintf(img, sizeof(img), "%s/base.raw", payload);
	snprintf(con_path, sizeof(con_path), WORK "/%s-console.sock", name);
	snprintf(qmp_path, sizeof(qmp_path), WORK "/%s-qmp.sock", name);
	snprintf(log, sizeof(log), WORK "/%s-qemu.log", name);
	snprintf(con_arg, sizeof(con_arg), "socket,id=con,path=%s,server=on,wait=on", con_path);
	snprintf(qmp_arg, sizeof(qmp_arg), "unix:%s,server=on,wait=off", qmp_path);
	snprintf(bd_base, sizeof(bd_base), "{\"driver\":\"file\",\"node-name\":\"base\","
		 "\"filename\":\"%s\",\"read-only\":true}", img);
	snprintf(bd_ps, sizeof(bd_ps), "{\"driver\":\"pageshare\",\"node-name\":\"ps\","
		 "\"file\":\"base\",\"read-only\":true,\"server\":\"" WORK "/run/base.sock\","
		 "\"mode\":\"merge\",\"reconnect-delay\":1}");
	snprintf(bd_ovlf, sizeof(bd_ovlf), "{\"driver\":\"file\",\"node-name\":\"ovl-file\","
		 "\"filename\":\"" WORK "/guest-ovl.qcow2\"}");
#define A(x) (argv[argc++] = (char *)(x))
	A(bin); A("-accel"); A("tcg"); A("-m"); A("128M"); A("-nodefaults");
	A("-display"); A("none"); A("-no-reboot"); A("-L"); A(share);
	A("-kernel"); A(gk); A("-initrd"); A(gi);
	A("-append"); A("console=ttyS0 quiet panic=-1");
	A("-chardev"); A(con_arg); A("-serial"); A("chardev:con");
	A("-qmp"); A(qmp_arg);
	A("-blockdev"); A(bd_base); A("-blockdev"); A(bd_ps); A("-blockdev"); A(bd_ovlf);
	A("-blockdev");
	A("{\"driver\":\"qcow2\",\"node-name\":\"ovl\",\"file\":\"ovl-file\",\"backing\":\"ps\"}");
	A("-device"); A("virtio-blk-pci,drive=ovl");
	if (incoming) {
		A("-incoming"); A("defer");
	}
	A(NULL);
#undef A
	q->pid = spawn(argv, log);
	qemu_pids[idx] = q->pid;
	deadline = now() + 120;
	while ((con = unix_connect(con_path)) < 0) {
		if (now() > deadline || !alive(q->pid)) {
			show_log(log);
			bail("%s qemu: no console socket", name);
		}
		usleep(100000);
	}
	qmp_open(q, qmp_path);
	proc_open(&q->proc, q->pid);
	return con;
}

/* ------------------------------------------------ the guest migrates */

/* The string value of @key in a QMP reply (static buffer; "" if none). */
static const char *json_str(const char *obj, const char *key)
{
	static char val[512];
	char pat[64];
	const char *p;
	size_t l;

	snprintf(pat, sizeof(pat), "\"%s\": \"", key);
	p = strstr(obj, pat);
	if (!p)
		return "";
	p += strlen(pat);
	l = strcspn(p, "\"");
	if (l >= sizeof(val))
		l = sizeof(val) - 1;
	memcpy(val, p, l);
	val[l] = 0;
	return val;
}

static const char *run_state(struct qemu *q)
{
	return json_str(qmp(q, "{\"execute\": \"query-status\"}"), "status");
}

static void qmpf(struct qemu *q, const char *fmt, ...)
{
	char cmd[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(cmd, sizeof(cmd), fmt, ap);
	va_end(ap);
	qmp(q, cmd);
}

static void set_block_refs(struct qemu *q)
{
	qmpf(q, "{\"execute\": \"migrate-set-capabilities\", \"arguments\": "
	     "{\"capabilities\": [{\"capability\": \"block-refs\", \"state\": true}]}}");
}

/*
 * query-migrate on the source until the migration ends or @timeout_s
 * passes: its status, with its last reply in qmp_reply.
 */
static const char *migrate_wait(struct qemu *q, int timeout_s)
{
	static char status[64];
	double deadline = now() + timeout_s;

	for (;;) {
		const char *r = qmp(q, "{\"execute\": \"query-migrate\"}");

		snprintf(status, sizeof(status), "%s", json_str(r, "status"));
		if (!strcmp(status, "completed") || !strcmp(status, "failed") ||
		    !strcmp(status, "cancelled") || now() > deadline)
			return status;
		usleep(100000);
	}
}

/* The first line of @path with @needle in it, into @buf ("" if none). */
static void find_line(const char *path, const char *needle, char *buf, size_t cap)
{
	FILE *f = fopen(path, "r");

	buf[0] = 0;
	if (!f)
		return;
	while (fgets(buf, cap, f)) {
		buf[strcspn(buf, "\n")] = 0;
		if (strstr(buf, needle)) {
			fclose(f);
			return;
		}
	}
	buf[0] = 0;
	fclose(f);
}

/* A counter of /proc/vmstat, -1 if absent. */
static long vmstat(const char *name)
{
	char key[64];
	long val, found = -1;
	FILE *f = fopen("/proc/vmstat", "r");

	while (f && found < 0 && fscanf(f, "%63s %ld", key, &val) == 2)
		if (!strcmp(key, name))
			found = val;
	if (f)
		fclose(f);
	return found;
}

/* QEMU's wait status once it exits, or -1 if it still runs after @timeout_s. */
static int wait_exit(pid_t *pid, int timeout_s)
{
	double deadline = now() + timeout_s;
	int st;

	while (now() < deadline) {
		pid_t r = waitpid(*pid, &st, WNOHANG);

		if (r == *pid) {
			*pid = -1;
			return st;
		}
		if (r < 0)
			return -1;
		usleep(100000);
	}
	return -1;
}

/* A guest page that is the server's page of a listed block. */
struct held {
	uint64_t off;		/* in guest RAM */
	uint64_t block;
};

/*
 * The guest pages that were the first server's pages when it was
 * restarted, by guest RAM offset (ascending): see guest_server_pages().
 */
static struct held *first_held;
static size_t nfirst_held;

/*
 * The guest pages of @q that the filter merged and the guest still maps:
 * the running server's page of a listed block, or, with @first_too, a
 * page that was the first server's when it was restarted (first_held)
 * and still holds that block's bytes.  Only the guest maps those now, so
 * the kernel may have moved one (compaction) or copied it into a huge
 * page (khugepaged: a page mapped once is not shared, and a pageshare
 * host's max_ptes_shared = 0 does not hold it back): on a busy host, 67
 * of them went so between the restart and the migration.  The filter
 * sends them as references all the same (their bytes are the block's),
 * and *copied counts those that are not KSM pages any more.  The guest's
 * own copies of blocks (pipe buffers: page-sized, private) the filter
 * never noted, and they are not counted.  *bad counts the running
 * server's pages that are not KSM pages or lack the block's bytes.
 */
static struct held *guest_server_pages(struct qemu *q, bool first_too, size_t *n,
				       unsigned int *bad, unsigned int *copied)
{
	struct pfn_at cur[1024];	/* pfn, block */
	struct held *out;
	size_t ncur = 0;
	uint64_t lo, hi;

	for (uint64_t b = 0; b < 1024; b++) {
		uint64_t pfn = srv_addr(b) ? pfn_of(&server, srv_addr(b)) : 0;

		if (pfn)
			cur[ncur++] = (struct pfn_at){ pfn, b };
	}
	qsort(cur, ncur, sizeof(*cur), pfn_cmp);

	guest_ram(q, &lo, &hi);
	out = calloc((hi - lo) / PS + 1, sizeof(*out));
	*n = 0;
	*bad = 0;
	if (copied)
		*copied = 0;
	for (uint64_t a = lo, f = 0; a < hi; a += PS) {
		uint64_t pfn = pfn_of(&q->proc, a);
		const struct pfn_at *hit = pfn ? find_pfn(cur, ncur, pfn) : NULL;
		const struct held *first = NULL;
		uint8_t buf[PS];

		while (first_too && f < nfirst_held && first_held[f].off < a - lo)
			f++;
		if (first_too && f < nfirst_held && first_held[f].off == a - lo)
			first = &first_held[f];
		if (!pfn || (!hit && !first))
			continue;
		proc_read(&q->proc, a, buf, PS);
		if (hit) {
			out[(*n)++] = (struct held){ a - lo, hit->hva };
			*bad += memcmp(buf, image + hit->hva * PS, PS) || !pfn_is_ksm(pfn);
		} else if (!memcmp(buf, image + first->block * PS, PS)) {
			out[(*n)++] = *first;
			if (copied && !pfn_is_ksm(pfn))
				(*copied)++;
		}
	}
	return out;
}

/*
 * The capability on the source only: the destination must refuse the
 * stream at its configuration section and exit, saying why, and the
 * guest must go on running on the source.
 */
static void migrate_refused(struct qemu *src)
{
	static const char uri[] = "unix:" WORK "/mig-refused.sock";
	static const char log[] = WORK "/guest-refused-qemu.log";
	struct qemu *r = calloc(1, sizeof(*r));
	char why[512], status[64], desc[256], state[64];
	int rcon, st;

	rcon = start_guest_qemu(r, 2, "guest-refused", true);
	qmpf(r, "{\"execute\": \"migrate-incoming\", \"arguments\": {\"uri\": \"%s\"}}", uri);
	set_block_refs(src);
	qmpf(src, "{\"execute\": \"migrate\", \"arguments\": {\"uri\": \"%s\"}}", uri);
	snprintf(status, sizeof(status), "%s", migrate_wait(src, 120));
	snprintf(desc, sizeof(desc), "%s", json_str(qmp_reply, "error-desc"));
	snprintf(state, sizeof(state), "%s", run_state(src));
	ok(!strcmp(status, "failed") && !strcmp(state, "running"),
	   "migration, block-refs on the source only: %s (%s); the guest on the source is %s",
	   status, desc, state);
	st = wait_exit(&qemu_pids[2], 60);
	find_line(log, "block-refs", why, sizeof(why));
	ok(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) != 0 && why[0],
	   "migration, block-refs on the source only: the destination exited (%s %d) saying: %s",
	   st == -1 ? "still running," : WIFEXITED(st) ? "status" : "signal",
	   st == -1 ? 0 : WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st), why);
	if (!why[0])
		show_log(log);
	close(rcon);
	close(r->qmp);
	proc_close(&r->proc);
	kill_child(&qemu_pids[2]);
	free(r);
}

/*
 * Live migration of the booted guest to a second QEMU on this host with
 * block-refs on both sides: each guest page the filter merged (and that
 * still holds its block) crosses as a block number, and the destination's
 * filter merges it from the server, so it arrives shared.  Checked from
 * outside: every guest page that was a server page on the source is the
 * server's page (KSM, the block's bytes) at the same guest address on the
 * destination; the source sent exactly those pages as references; the
 * destination resolved each by merging, none failed.  On success the
 * destination (its console in *con) replaces @src, which is stopped; if
 * the migration fails the guest stays on @src.  *whva, a guest page's
 * host address in @src, is moved to the destination's.
 */
static struct qemu *migrate_guest(struct qemu *src, int *con, uint64_t *whva)
{
	static const char uri[] = "unix:" WORK "/mig.sock";
	struct qemu *d = calloc(1, sizeof(*d));
	struct fstats fs0, fs1, fd;
	struct counters k0, k1;
	long migrated0, stalls0;
	unsigned int bad, arrived = 0, dbad, shown = 0, first = 0, moved = 0, kept = 0;
	unsigned int copied;
	uint64_t *spfn0;
	char status[64], desc[256], state[64];
	long brp = -1, ms = 0, down = 0, bytes = 0;
	uint64_t slo, shi, dlo, dhi;
	size_t nheld, ndst;
	struct held *held, *dheld;
	double t0 = now(), t_refused, t_dst, t_mig, t_check, deadline;
	int dcon;

	migrate_refused(src);
	t_refused = now() - t0;

	dcon = start_guest_qemu(d, 1, "guest-dst", true);
	set_block_refs(d);
	/*
	 * The destination names the source's image by the content its server
	 * vouches for: its filter must hold a table before the stream's image
	 * table arrives, or it could not find the image.
	 */
	deadline = now() + 60;
	do {
		fd = filter_stats(d);
	} while (!(fd.connected && fd.generation >= 0) && now() < deadline &&
		 usleep(200000) == 0);
	if (!(fd.connected && fd.generation >= 0))
		diag("migration: the destination's filter has no table yet");
	qmpf(d, "{\"execute\": \"migrate-incoming\", \"arguments\": {\"uri\": \"%s\"}}", uri);
	t_dst = now() - t0 - t_refused;

	held = guest_server_pages(src, true, &nheld, &bad, &copied);
	guest_ram(src, &slo, &shi);
	for (size_t i = 0; i < nheld; i++) {
		uint64_t b = held[i].block, pfn = pfn_of(&src->proc, slo + held[i].off);

		if (pfn != pfn_of(&server, srv_addr(b))) {
			first++;
			moved += pfn != old_server_pfn[b];
		}
	}
	diag("migration: %zu merged pages on the source, %u of them the first server's "
	     "(%u moved since the restart, %u of those copied out of KSM: khugepaged)",
	     nheld, first, moved, copied);
	/* the server's pages the source will check the references against */
	spfn0 = calloc(nheld ? nheld : 1, sizeof(*spfn0));
	if (!spfn0)
		bail("out of memory");
	for (size_t i = 0; i < nheld; i++)
		spfn0[i] = pfn_of(&server, srv_addr(held[i].block));
	fs0 = filter_stats(src);
	k0 = ksm_counters();
	migrated0 = vmstat("pgmigrate_success");
	stalls0 = vmstat("compact_stall");
	t_mig = now();
	qmpf(src, "{\"execute\": \"migrate\", \"arguments\": {\"uri\": \"%s\"}}", uri);
	snprintf(status, sizeof(status), "%s", migrate_wait(src, 300));
	t_mig = now() - t_mig;
	snprintf(desc, sizeof(desc), "%s", json_str(qmp_reply, "error-desc"));
	/* a destination that refused the stream exits: ask only after a success */
	snprintf(state, sizeof(state), "not asked");
	if (!strcmp(status, "completed")) {
		brp = json_num(qmp_reply, "block-ref-pages");
		ms = json_num(qmp_reply, "total-time");
		down = json_num(qmp_reply, "downtime");
		bytes = json_num(qmp_reply, "transferred");
		deadline = now() + 60;
		do {
			snprintf(state, sizeof(state), "%s", run_state(d));
		} while (strcmp(state, "running") && now() < deadline && usleep(200000) == 0);
	}
	ok(!strcmp(status, "completed") && !strcmp(state, "running"),
	   "migration with block-refs: %s%s%s in %ld ms (downtime %ld ms, %ld bytes); the "
	   "destination is %s", status, desc[0] ? ": " : "", desc, ms, down, bytes, state);
	if (strcmp(status, "completed")) {
		show_log(WORK "/guest-dst-qemu.log");
		close(dcon);
		stop_qemu(d);
		free(d);
		free(held);
		free(spfn0);
		return src;
	}

	t_check = now();
	fs1 = filter_stats(src);
	fd = filter_stats(d);
	k1 = ksm_counters();
	/*
	 * Why a reference was not merged: the destination's last merge_pages()
	 * error, and whether the kernel moved pages meanwhile.  Seen: block 0,
	 * whose server page the source read twice with process_vm_readv() (a
	 * stale note, then the page), so that it sat on a per-cpu LRU batch
	 * with a reference: EAGAIN even when merge_pages() waits.
	 */
	diag("migration: destination filter merge-calls %ld, last-merge-errno %ld; kernel "
	     "merge_page_merged +%ld, merge_page_failed +%ld, pgmigrate_success +%ld, "
	     "compact_stall +%ld", fd.merge_calls, fd.last_errno, k1.merged - k0.merged,
	     k1.failed - k0.failed, vmstat("pgmigrate_success") - migrated0,
	     vmstat("compact_stall") - stalls0);
	guest_ram(d, &dlo, &dhi);
	if (dhi - dlo != shi - slo)
		diag("migration: guest RAM is %" PRIu64 " bytes on the source, %" PRIu64
		     " on the destination", shi - slo, dhi - dlo);
	for (size_t i = 0; i < nheld; i++) {
		uint64_t b = held[i].block, hva = dlo + held[i].off;
		uint64_t pfn = pfn_of(&d->proc, hva), spfn = pfn_of(&server, srv_addr(b));
		uint8_t buf[PS];
		bool same;

		proc_read(&d->proc, hva, buf, PS);
		same = pfn && pfn == spfn && pfn_is_ksm(pfn) && !memcmp(buf, image + b * PS, PS);
		arrived += same;
		/*
		 * The server's page not a KSM page either: merge_pages() failed
		 * making it one (phase S), not at the guest's page (phase D).
		 */
		if (!same && shown++ < 5)
			diag("migration: block %" PRIu64 " at guest RAM offset %#" PRIx64 " (reference "
			     "%zu of %zu): pfn %#" PRIx64 ", ksm %d, bytes %s; the server's pfn %#"
			     PRIx64 ", ksm %d", b, held[i].off, i + 1, nheld, pfn,
			     pfn && pfn_is_ksm(pfn), memcmp(buf, image + b * PS, PS) ? "WRONG" :
			     "right", spfn, spfn && pfn_is_ksm(spfn));
	}
	/*
	 * The source read the server's copy of each block it sent as a
	 * reference, to compare it with the guest's page.  Read so that it
	 * pins (process_vm_readv(2)), a KSM page is unshared first: the server
	 * would now map a private copy of each, and the next merge of that
	 * block make a second KSM page of the same bytes.
	 */
	for (size_t i = 0; i < nheld; i++) {
		uint64_t now_pfn = pfn_of(&server, srv_addr(held[i].block));

		kept += now_pfn && now_pfn == spfn0[i] && pfn_is_ksm(now_pfn);
	}
	ok(kept == nheld, "migration: the source's checks left the server's pages in place: "
	   "%u of the %zu it sent as references are still the same KSM page in the server",
	   kept, nheld);
	free(spfn0);
	dheld = guest_server_pages(d, false, &ndst, &dbad, NULL);
	ok(nheld > 0 && bad == 0 && arrived == nheld && ndst == nheld && dbad == 0,
	   "migration: all %zu guest pages the filter had merged on the source (%u not KSM or "
	   "wrong bytes) are the server's pages at the same guest address on the destination, "
	   "KSM, the block's bytes: %u; the destination maps %zu server pages", nheld, bad,
	   arrived, ndst);
	ok(brp == (long)nheld && fs1.refs_sent - fs0.refs_sent == brp,
	   "migration: block-ref-pages %ld (want the %zu merged pages); filter: refs sent +%ld, "
	   "refused +%ld", brp, nheld, fs1.refs_sent - fs0.refs_sent,
	   fs1.refs_refused - fs0.refs_refused);
	ok(fd.refs_merged > 0 && fd.refs_failed == 0 &&
	   fd.refs_merged + fd.refs_copied + fd.refs_read == brp,
	   "migration: the destination's filter merged %ld references (copied %ld, read %ld, "
	   "failed %ld; want all %ld merged, none failed)", fd.refs_merged, fd.refs_copied,
	   fd.refs_read, fd.refs_failed, brp);
	free(held);
	free(dheld);

	/* the guest, on the destination now, checks what it holds */
	close(*con);
	*con = dcon;
	*whva = *whva ? dlo + (*whva - slo) : 0;
	stop_qemu(src);
	free(src);
	write_all(dcon, "go\n", 3);
	diag("migration: %.1f s: the refused one %.1f s, the destination up %.1f s, the "
	     "migration %.1f s, the checks %.1f s", now() - t0, t_refused, t_dst, t_mig,
	     now() - t_check);
	return d;
}

static void booted_guest(void)
{
	char img[256], ovl[64];
	char line[512], expect_path[256], want_sha[80] = "", want_zero[80] = "";
	int con;
	struct qemu *q = calloc(1, sizeof(*q));
	unsigned int listed, bad, found;
	uint64_t whva = 0, wspfn;
	struct fstats f;
	double t0 = now(), t_boot, t_mig, t_sum;
	FILE *ex;

	snprintf(img, sizeof(img), "%s/base.raw", payload);
	snprintf(expect_path, sizeof(expect_path), "%s/guest/expect", payload);
	ex = fopen(expect_path, "r");
	if (!ex || fscanf(ex, "sha256 %64s zero %64s", want_sha, want_zero) != 2)
		bail("%s: cannot read the expected checksums", expect_path);
	fclose(ex);
	snprintf(ovl, sizeof(ovl), WORK "/guest-ovl.qcow2");
	{
		char qimg[256], size[32];
		char *iargv[] = { qimg, "create", "-q", "-f", "qcow2", "-F", "raw", "-b", img,
				  ovl, size, NULL };
		pid_t p;
		int st;

		snprintf(qimg, sizeof(qimg), "%s/bin/qemu-img", payload);
		snprintf(size, sizeof(size), "%zu", image_size);
		unlink(ovl);
		p = spawn(iargv, WORK "/qemu-img.log");
		if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st))
			bail("qemu-img create failed");
	}
	con = start_guest_qemu(q, 0, "guest", false);

	guest_expect(q, con, "GUEST-BOOTED", line, sizeof(line), 900);
	t_boot = now() - t0;
	diag("booted guest: up after %.0f s (%s)", t_boot, line);
	guest_expect(q, con, "GUEST-PHASE1", line, sizeof(line), 900);
	found = guest_merged(q, 0, 512, &listed, &bad, GUEST_WRITE_BLOCK_C, &whva);
	wspfn = pfn_of(&server, srv_addr(GUEST_WRITE_BLOCK_C));
	f = filter_stats(q);
	ok(found >= listed * 9 / 10 && bad == 0 && f.merged >= found,
	   "booted guest, phase 1: %u of %u listed blocks of 0-511 in its page cache are the "
	   "server's pages (KSM, the image's bytes; %u wrong); filter merged %ld, "
	   "merge-failed %ld (last errno %ld), not-guest-ram %ld", found, listed, bad, f.merged,
	   f.failed, f.last_errno, f.not_ram);
	census_soak(q);

	/* the server goes away and comes back while the guest runs */
	for (uint64_t b = 0; b < 1024; b++)
		old_server_pfn[b] = srv_addr(b) ? pfn_of(&server, srv_addr(b)) : 0;
	{
		unsigned int fbad;

		free(first_held);
		first_held = guest_server_pages(q, false, &nfirst_held, &fbad, NULL);
	}
	restart_server();
	{
		double deadline = now() + 120;

		do {
			usleep(500000);
			f = filter_stats(q);
		} while (!(f.connected && strstr(qmp_reply, "\"generation\"")) && now() < deadline);
	}
	ok(f.connected, "booted guest: the filter reconnected to the restarted server");
	write_all(con, "go\n", 3);
	guest_expect(q, con, "GUEST-SHA256", line, sizeof(line), 900);
	ok(strstr(line, want_sha) != NULL,
	   "booted guest: its sha256 of blocks 0-1023 is the image's (%s)", line);
	guest_expect(q, con, "GUEST-PHASE2", line, sizeof(line), 900);
	found = guest_merged(q, 512, 1024, &listed, &bad, GUEST_WRITE_BLOCK_C, NULL);
	f = filter_stats(q);
	ok(found >= listed * 9 / 10 && bad == 0,
	   "booted guest, phase 2 (restarted server): %u of %u listed blocks of 512-1023 are "
	   "server pages (the new server's, or the old one's for what it read ahead before "
	   "the restart; %u wrong); filter merged %ld", found, listed, bad, f.merged);
	{
		/*
		 * Or, once the first server is gone and the guest alone maps
		 * it, a copy the kernel made (see guest_server_pages()).
		 */
		uint64_t gpfn = whva ? pfn_of(&q->proc, whva) : 0;
		uint8_t buf[PS];

		if (gpfn)
			proc_read(&q->proc, whva, buf, PS);
		ok(gpfn && (gpfn == wspfn ||
			    !memcmp(buf, image + GUEST_WRITE_BLOCK_C * PS, PS)),
		   "booted guest: its page cache page of block %d still holds the block before "
		   "the write (%s)", GUEST_WRITE_BLOCK_C,
		   !gpfn ? "not mapped" : gpfn == wspfn ? "the same page" :
		   pfn_is_ksm(gpfn) ? "moved, KSM" : "copied out of KSM, its bytes");
	}

	/* it moves to another QEMU and checks what it holds there */
	t_mig = now();
	q = migrate_guest(q, &con, &whva);
	t_sum = now();
	if (q->idx != 0) {
		/* on the destination: block 5 is the page merged on arrival */
		wspfn = pfn_of(&server, srv_addr(GUEST_WRITE_BLOCK_C));
	} else {
		write_all(con, "go\n", 3);	/* the migration failed: on the source */
	}
	guest_expect(q, con, "GUEST-MIGRATED", line, sizeof(line), 900);
	ok(strstr(line, want_sha) != NULL,
	   "booted guest, %s: its sha256 of blocks 0-1023 is the image's (%s)",
	   q->idx ? "migrated" : "NOT migrated", line);
	diag("booted guest: its checksum after the migration took %.1f s", now() - t_sum);
	t_mig = now() - t_mig;

	/* the guest overwrites block 5 */
	write_all(con, "go\n", 3);
	guest_expect(q, con, "GUEST-WROTE", line, sizeof(line), 900);
	ok(strstr(line, want_zero) != NULL, "booted guest: block %d reads back as written (%s)",
	   GUEST_WRITE_BLOCK_C, line);
	{
		uint8_t buf[PS];
		uint64_t gpfn = pfn_of(&q->proc, whva);

		proc_read(&server, srv_addr(GUEST_WRITE_BLOCK_C), buf, PS);
		ok(gpfn && gpfn != wspfn && !pfn_is_ksm(gpfn) &&
		   !memcmp(buf, image + GUEST_WRITE_BLOCK_C * PS, PS),
		   "booted guest: its write got its own page (pfn %#" PRIx64 ", was the server's "
		   "%#" PRIx64 "); the server still holds the image's bytes", gpfn, wspfn);
	}
	write_all(con, "go\n", 3);
	guest_expect(q, con, "GUEST-DONE", line, sizeof(line), 300);
	diag("booted guest: %.0f s in all (boot %.0f s, migration case %.0f s)", now() - t0,
	     t_boot, t_mig);
	close(con);
	stop_qemu(q);
	free(q);
}

/* ---------------------------------------------------------------- main */

/*
 * merge-ns per block of the filter (the time in merge_pages() or
 * process_vm_readv(), QMP) for 224 listed blocks of blocks 256-511 read by
 * 8 READ DMA commands of 32 blocks into fresh guest pages; round 0 and
 * round 1 read the same blocks into other pages (in merge mode the first
 * merge of a block also makes the server's page a KSM page).
 */
static void timing(const char *mode, int idx, double ns_per_block[2])
{
	struct qemu q;
	struct fstats a, b;
	uint64_t gpa[64];

	start_qemu(&q, idx, mode);
	find_ram(&q);
	ide_init(&q);
	for (int round = 0; round < 2; round++) {
		unsigned int listed = 0;
		long blocks, calls, ns;

		a = filter_stats(&q);
		for (int c = 0; c < 8; c++) {
			gpas(gpa, 32, 0x1000000 + round * 0x100000 + c * 32 * PS, PS);
			if (!read_blocks(&q, 256 + c * 32, 32, gpa))
				bail("timing (%s): READ DMA failed", mode);
			for (int i = 0; i < 32; i++)
				listed += srv_addr(256 + c * 32 + i) != 0;
		}
		b = filter_stats(&q);
		blocks = b.merged - a.merged;
		calls = b.merge_calls - a.merge_calls;
		ns = b.merge_ns - a.merge_ns;
		ns_per_block[round] = blocks ? (double)ns / blocks : 0;
		ok(blocks == listed, "timing, mode=%s, round %d: %ld of %u listed blocks %s", mode,
		   round, blocks, listed, !strcmp(mode, "copy") ? "copied" : "merged");
		diag("mode=%s round %d: %ld blocks in %ld calls, merge-ns %ld: %.0f ns per block",
		     mode, round, blocks, calls, ns, ns_per_block[round]);
	}
	stop_qemu(&q);
}

/* ------------------------------------------------ a client that stalls */

/*
 * A proxy between one filter and its page server that forwards the bytes
 * and the descriptors sent with them (SCM_RIGHTS) both ways, and holds
 * back everything the server sends while held (SIGUSR1 holds, SIGUSR2
 * releases).  The filter then keeps using the table it has while the
 * server, hearing nothing back, gives up on it and releases that table's
 * blocks: a client that missed the switch, with no race between QEMU's
 * threads (tests/qemu/test_qemu_filter_safety.py's HoldingProxy, in C because
 * this VM has no Python).  It runs in a child process; a connection that
 * ends is followed by the next one (the filter reconnects).
 */
static volatile sig_atomic_t proxy_held;

static void proxy_signal(int sig)
{
	proxy_held = sig == SIGUSR1;
}

/*
 * One recvmsg() from @from, sent whole to @to with its descriptors: 1 if
 * done, 0 if @from ended, -1 if @to refused it (its peer is gone).
 */
static int proxy_forward(int from, int to)
{
	static char buf[1 << 16];
	char cbuf[CMSG_SPACE(sizeof(int) * 8)];
	struct iovec iov = { buf, sizeof(buf) };
	struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1,
			    .msg_control = cbuf, .msg_controllen = sizeof(cbuf) };
	ssize_t n = recvmsg(from, &m, MSG_CMSG_CLOEXEC);
	size_t done = 0;
	int rc = 1;

	if (n <= 0)
		return n < 0 && errno == EINTR ? 1 : 0;
	while (done < (size_t)n) {
		struct iovec out = { buf + done, (size_t)n - done };
		struct msghdr o = { .msg_iov = &out, .msg_iovlen = 1 };
		ssize_t w;

		if (done == 0 && m.msg_controllen) {
			o.msg_control = cbuf;
			o.msg_controllen = m.msg_controllen;
		}
		w = sendmsg(to, &o, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			rc = -1;
			break;
		}
		done += (size_t)w;
	}
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
		if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
			for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++)
				close(((int *)CMSG_DATA(c))[i]);
	return rc;
}

static pid_t start_proxy(const char *listen_path, const char *upstream)
{
	int l = unix_listen(listen_path);
	pid_t pid = fork();

	if (pid < 0)
		bail("fork: %s", strerror(errno));
	if (pid) {
		close(l);
		return pid;
	}
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	{
		struct sigaction sa = { .sa_handler = proxy_signal };	/* no SA_RESTART */

		sigaction(SIGUSR1, &sa, NULL);
		sigaction(SIGUSR2, &sa, NULL);
	}
	for (;;) {
		int c = accept(l, NULL, NULL), u;

		if (c < 0)
			continue;
		u = unix_connect(upstream);
		while (u >= 0) {
			/* Held: not even the server's hangup is looked at. */
			struct pollfd pf[2] = { { .fd = c, .events = POLLIN },
						{ .fd = proxy_held ? -1 : u, .events = POLLIN } };
			int rc;

			if (poll(pf, 2, 100) < 0)
				continue;
			/*
			 * The server closes a client that did not switch in
			 * time, after its BYE.  While held, the filter must not
			 * hear of that (its STATS, every 5 s, would hit the
			 * closed socket): what it sends is dropped, and the BYE
			 * still queued on @u reaches it once released.
			 */
			rc = pf[0].revents ? proxy_forward(c, u) : 1;
			if (rc == 0 || (rc < 0 && !proxy_held))
				break;
			if (!proxy_held && pf[1].revents && proxy_forward(u, c) <= 0)
				break;
		}
		close(c);
		if (u >= 0)
			close(u);
	}
}

static void copy_file(const char *from, const char *to)
{
	char tmp[256], buf[1 << 16];
	int in = open(from, O_RDONLY), out;
	ssize_t n;

	snprintf(tmp, sizeof(tmp), "%s.tmp", to);
	out = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (in < 0 || out < 0)
		bail("copy %s: %s", from, strerror(errno));
	while ((n = read(in, buf, sizeof(buf))) > 0)
		if (write(out, buf, n) != n)
			bail("write %s: %s", tmp, strerror(errno));
	close(in);
	close(out);
	if (rename(tmp, to))	/* one inotify event, the whole new list */
		bail("rename %s: %s", tmp, strerror(errno));
}

/*
 * Issue: a VM stalled past client_switch_timeout_secs while the server
 * reloaded a smaller list read the released blocks as zeros.  Here in
 * merge mode: a second server (payload/server-stall.toml: its own sockets,
 * a list under WORK, a 1 s switch timeout) behind the proxy; the filter
 * merges every listed block, then hears nothing while the server reloads
 * a list of every fourth of them, gives up on it and releases the rest
 * (PROT_NONE, then discarded).  The filter still reads with generation 1:
 * each released block's merge_pages() must fail (EFAULT) and the block
 * come from disk, never as zeros; then, released, it switches and merges
 * the kept blocks from generation 2.
 */
static void stalled_client(void)
{
	static const char list[] = WORK "/stall.pcsl", psock[] = WORK "/proxy.sock";
	char cfg[256], kept_list[256], full_list[256], bin[256];
	char *argv[] = { bin, "run", "--config", cfg, NULL };
	unsigned int listed, released;
	struct fstats f0, f1, f2;
	struct qemu q = { 0 };
	double deadline;
	long other;

	snprintf(bin, sizeof(bin), "%s/bin/pageshare-server", payload);
	snprintf(cfg, sizeof(cfg), "%s/server-stall.toml", payload);
	snprintf(full_list, sizeof(full_list), "%s/base.pcsl", payload);
	snprintf(kept_list, sizeof(kept_list), "%s/base-kept.pcsl", payload);
	copy_file(full_list, list);
	stall_pids[0] = spawn(argv, WORK "/server-stall.log");
	deadline = now() + 300;
	while (!file_contains(WORK "/server-stall.log", "published generation 1")) {
		if (now() > deadline || !alive(stall_pids[0]))
			bail("stall server: generation 1 not published");
		usleep(100000);
	}
	stall_pids[1] = start_proxy(psock, WORK "/run-stall/base.sock");
	qemu_server = psock;
	start_qemu(&q, 0, "merge");
	qemu_server = NULL;
	find_ram(&q);
	ide_init(&q);
	listed = check_every_listed_block(&q, "stalled client, before the stall", EXPECT_ANY);
	f0 = filter_stats(&q);
	ok(f0.generation == 1 && f0.merged == listed,
	   "stalled client: generation %ld, merged %ld (want 1, %u)", f0.generation, f0.merged,
	   listed);

	kill(stall_pids[1], SIGUSR1);		/* the filter hears nothing from now on */
	copy_file(kept_list, list);
	deadline = now() + 60;
	while (!file_contains(WORK "/server-stall.log", "did not acknowledge")) {
		if (now() > deadline)
			bail("stall server: it never gave up on the silent client");
		usleep(100000);
	}
	usleep(1000000);
	f1 = filter_stats(&q);
	ok(f1.connected && f1.generation == 1,
	   "stalled client: still on generation %ld after the server released it", f1.generation);
	check_every_listed_block(&q, "stalled client, its table released", EXPECT_ANY);
	released = listed - (listed + 3) / 4;
	deadline = now() + 5;		/* the counters of the last read, if not in yet */
	do {
		f2 = filter_stats(&q);
		other = (f2.no_table - f1.no_table) + (f2.unproven - f1.unproven) +
			(f2.not_ram - f1.not_ram) + (f2.unsupported - f1.unsupported);
	} while ((f2.merged - f1.merged) + (f2.failed - f1.failed) + other < (long)listed &&
		 now() < deadline && usleep(100000) == 0);
	/*
	 * Every listed block is accounted once: merged (a kept block), a
	 * refused merge (a released one), or read from disk on another path
	 * the filter has for it (no table, unproven, not guest RAM,
	 * unsupported).  Once, on a host at load 3 or more, 4 of the 32 reads
	 * were in neither of the first two counters: the other paths are
	 * counted and printed, and must account for exactly the rest.
	 */
	ok(f2.merged - f1.merged <= (long)(listed - released) &&
	   (f2.merged - f1.merged) + (f2.failed - f1.failed) + other == (long)listed &&
	   (f2.failed - f1.failed) + other >= released && f2.failed > f1.failed &&
	   f2.last_errno != 0,
	   "stalled client: merged +%ld (want <= %u, the kept blocks), fallback-merge-failed +%ld "
	   "(want >= %u, the released ones, with the other disk paths), other disk paths +%ld "
	   "(no-table +%ld, unproven +%ld, not-guest-ram +%ld, unsupported +%ld), "
	   "last-merge-errno %ld", f2.merged - f1.merged, listed - released,
	   f2.failed - f1.failed, released, other, f2.no_table - f1.no_table,
	   f2.unproven - f1.unproven, f2.not_ram - f1.not_ram, f2.unsupported - f1.unsupported,
	   f2.last_errno);

	kill(stall_pids[1], SIGUSR2);		/* TABLE 2 and BYE reach the filter */
	deadline = now() + 60;
	do {
		usleep(500000);
		f1 = filter_stats(&q);
	} while (!(f1.connected && f1.generation == 2) && now() < deadline);
	ok(f1.connected && f1.generation == 2, "stalled client: switched to generation %ld",
	   f1.generation);
	check_every_listed_block(&q, "stalled client, on generation 2", EXPECT_ANY);
	stop_qemu(&q);
	kill_child(&stall_pids[1]);
	kill_child(&stall_pids[0]);
}

int main(int argc, char **argv)
{
	char path[256];
	struct qemu q, q2;
	struct counters k0, k1;
	struct fstats f0, f1;
	uint64_t gpa[64], r1[16], r3[4];
	unsigned int listed1, listed2;
	long list_count;
	double t_start = now();

	if (argc > 1)
		payload = argv[1];
	setvbuf(stdout, NULL, _IOLBF, 0);
	atexit(cleanup);
	signal(SIGTERM, on_signal);
	signal(SIGINT, on_signal);
	signal(SIGALRM, on_signal);
	signal(SIGPIPE, SIG_IGN);
	printf("TAP version 13\n");
	mkdir(WORK, 0755);
	mkdir(WORK "/run", 0755);

	snprintf(path, sizeof(path), "%s/base.raw", payload);
	load_image(path);
	snprintf(path, sizeof(path), "%s/base.pcsl", payload);
	image_sha = strdup(list_header(path, "image-content-sha256"));
	list_count = strtol(list_header(path, "count"), NULL, 10);
	ok(access("/sys/kernel/mm/ksm/merge_page_merged", F_OK) == 0,
	   "the kernel has the merge_pages series");
	/*
	 * The counts below are of the whole system's KSM: a stale stable node
	 * left by an earlier process, pruned by a merge's tree search, would
	 * take its sharers off them (ktest's INIT unmerges all between tests).
	 */
	k0 = ksm_counters();
	ok(k0.shared == 0 && k0.sharing == 0,
	   "KSM starts with nothing merged: pages_shared %ld, pages_sharing %ld",
	   k0.shared, k0.sharing);

	/* ---- the server, started with ksmd off (INIT's reset) */
	ksm_set("run", 0);
	khugepaged_as_on_a_pageshare_host();
	start_server();
	ok(file_contains(WORK "/server.log", "/sys/kernel/mm/ksm/run is 0, not 1"),
	   "server warns that merge_pages() needs ksmd running");
	ok(!(table_msg.flags & PST_FLAG_DEGRADED), "server table is not DEGRADED "
	   "(MADV_ALLOWMERGED accepted)");
	ok(table_msg.entry_count == (uint64_t)list_count && table_msg.image_virtual_size == image_size,
	   "server table: %" PRIu64 " entries (list: %ld), image size %" PRIu64,
	   table_msg.entry_count, list_count, table_msg.image_virtual_size);
	{
		unsigned int bad = 0;

		for (uint64_t b = 0; b < image_size / PS; b++) {
			uint8_t buf[PS];

			if (!srv_addr(b))
				continue;
			proc_read(&server, srv_addr(b), buf, PS);
			bad += memcmp(buf, image + b * PS, PS) != 0;
		}
		ok(bad == 0, "server's preloaded pages hold the image's blocks (%u wrong)", bad);
	}

	/* ---- QEMU, merge mode */
	start_qemu(&q, 0, "merge");
	find_ram(&q);
	ide_init(&q);
	f0 = filter_stats(&q);
	ok(f0.connected, "filter connected to the server");
	/*
	 * R0: merge_pages() needs ksmd in merge mode (run = 1); with run = 0
	 * every read falls back, and one failed call ends the window (not one
	 * call per page).
	 */
	ksm_set("run", 0);
	k0 = ksm_counters();
	f0 = filter_stats(&q);
	gpas(gpa, 16, 0x1800000, PS);
	listed1 = read_and_check(&q, "R0 ksmd off", 16, 16, gpa, false);
	f1 = filter_stats(&q);
	k1 = ksm_counters();
	ok(f1.failed - f0.failed == listed1 && f1.merged == f0.merged &&
	   f1.last_errno == EOPNOTSUPP && f1.merge_calls - f0.merge_calls == 1 &&
	   k1.merged == k0.merged,
	   "ksmd off: merge-failed +%ld (want %u), last-merge-errno %ld (want %d), "
	   "merge-calls +%ld (want 1), merge_page_merged +%ld", f1.failed - f0.failed,
	   listed1, f1.last_errno, EOPNOTSUPP, f1.merge_calls - f0.merge_calls,
	   k1.merged - k0.merged);
	/* As on a host: ksmd in merge mode, here scanning nothing by itself. */
	ksm_set("pages_to_scan", 0);
	ksm_set("sleep_millisecs", 20);
	ksm_set("run", 1);
	k0 = ksm_counters();
	f0 = filter_stats(&q);

	/* R1: blocks 0-15 into untouched guest pages, one PRD entry each */
	gpas(r1, 16, 0x400000, PS);
	listed1 = read_and_check(&q, "R1 fresh pages", 0, 16, r1, true);

	/* R2: blocks 64-95 into pages the guest wrote before (a THP) */
	qt(&q, "memset 0x600000 0x200000 0x5a");
	gpas(gpa, 32, 0x600000 + 0x3000, 2 * PS);
	listed2 = read_and_check(&q, "R2 written pages", 64, 32, gpa, true);
	k1 = ksm_counters();
	f1 = filter_stats(&q);
	ok(f1.merged - f0.merged == listed1 + listed2 && f1.not_listed - f0.not_listed ==
	   48 - listed1 - listed2 && f1.failed == f0.failed && f1.not_ram == f0.not_ram,
	   "filter counters: merged +%ld (want %u), not-listed +%ld, merge-failed +%ld, "
	   "not-guest-ram +%ld", f1.merged - f0.merged, listed1 + listed2,
	   f1.not_listed - f0.not_listed, f1.failed - f0.failed, f1.not_ram - f0.not_ram);
	if (f1.failed != f0.failed)
		diag("last-merge-errno %ld", f1.last_errno);
	ok(k1.merged - k0.merged == listed1 + listed2 && k1.sources - k0.sources == listed1 + listed2 &&
	   k1.failed == k0.failed,
	   "KSM merge_page_merged +%ld, merge_page_sources +%ld (want %u), merge_page_failed +%ld",
	   k1.merged - k0.merged, k1.sources - k0.sources, listed1 + listed2, k1.failed - k0.failed);
	ok(k1.shared - k0.shared == listed1 + listed2 && k1.sharing - k0.sharing == listed1 + listed2,
	   "KSM pages_shared +%ld, pages_sharing +%ld (want %u each)",
	   k1.shared - k0.shared, k1.sharing - k0.sharing, listed1 + listed2);
	diag("merge mode: %ld merged blocks in %ld merge calls, %ld ns (%.0f ns per block)",
	     f1.merged - f0.merged, f1.merge_calls - f0.merge_calls, f1.merge_ns - f0.merge_ns,
	     f1.merged > f0.merged ? (double)(f1.merge_ns - f0.merge_ns) / (f1.merged - f0.merged) : 0.0);

	/* R3: a second reader of blocks 0-3 in the same guest */
	k0 = ksm_counters();
	f0 = filter_stats(&q);
	gpas(r3, 4, 0x800000, PS);
	read_and_check(&q, "R3 second reader", 0, 4, r3, true);
	k1 = ksm_counters();
	f1 = filter_stats(&q);
	ok(k1.merged - k0.merged == 4 && k1.sources == k0.sources && k1.shared == k0.shared &&
	   k1.sharing - k0.sharing == 4 && f1.merged - f0.merged == 4,
	   "second reader: merge_page_merged +%ld, sources +%ld, pages_shared +%ld, "
	   "pages_sharing +%ld, filter merged +%ld (want 4, 0, 0, 4, 4)",
	   k1.merged - k0.merged, k1.sources - k0.sources, k1.shared - k0.shared,
	   k1.sharing - k0.sharing, f1.merged - f0.merged);

	/* CoW: the guest writes into its merged copy of block 1 */
	{
		static uint8_t pat[PS];
		struct page_state before = check_page(&q, r1[1], 1, NULL), after, other;
		uint8_t srv[PS], back[64];

		for (size_t i = 0; i < PS; i++)
			pat[i] = (uint8_t)(i * 7 + 3);
		gwrite(&q, r1[1], pat, PS);
		after = check_page(&q, r1[1], 1, pat);
		ok(before.merged && after.bytes_ok && after.pfn && after.pfn != before.pfn &&
		   !after.ksm, "CoW: the written guest page has a new PFN (%#" PRIx64 " -> %#"
		   PRIx64 "), the new bytes, and is no KSM page", before.pfn, after.pfn);
		proc_read(&server, srv_addr(1), srv, PS);
		ok(after.srv_pfn == before.srv_pfn && !memcmp(srv, image + PS, PS),
		   "CoW: the server's page keeps its PFN and bytes");
		other = check_page(&q, r3[1], 1, NULL);
		ok(other.merged && other.ksm && other.bytes_ok,
		   "CoW: the second reader's page of block 1 is still the server's page");
		gread(&q, r1[1], back, sizeof(back));
		ok(!memcmp(back, pat, sizeof(back)), "CoW: the guest reads its own bytes back (qtest)");
		gpa[0] = 0x900000;
		read_and_check(&q, "R4 re-read after CoW", 1, 1, gpa, true);
	}

	/* IDE WRITE DMA of block 2 through the overlay, then read it back */
	{
		static uint8_t pat[PS];
		struct prd prd = { 0xa00000, PS };
		struct page_state s, s3, old;
		uint64_t back[2] = { 0xa10000, 0xa11000 };

		for (size_t i = 0; i < PS; i++)
			pat[i] = (uint8_t)(i * 13 + 101);
		gwrite(&q, 0xa00000, pat, PS);
		ok(ide_ok(ide_dma(&q, CMD_WRITE_DMA, 2 * 8, 8, &prd, 1)),
		   "WRITE DMA of block 2 to the overlay completes");
		f0 = filter_stats(&q);
		ok(read_blocks(&q, 2, 2, back), "READ DMA of blocks 2-3 after the write");
		f1 = filter_stats(&q);
		s = check_page(&q, back[0], 2, pat);
		s3 = check_page(&q, back[1], 3, NULL);
		ok(s.bytes_ok && !s.merged && !s.ksm,
		   "written block 2 reads back as written, not merged (pfn %#" PRIx64 ")", s.pfn);
		ok(s3.bytes_ok && !s3.merged && !s3.ksm,
		   "block 3 (same overlay cluster, copied up) has the image's bytes, not merged");
		ok(f1.merged == f0.merged, "filter: nothing merged for the overlay's blocks (+%ld)",
		   f1.merged - f0.merged);
		old = check_page(&q, r1[2], 2, NULL);
		ok(old.merged && old.bytes_ok,
		   "the earlier guest page of block 2 still holds the base image's data "
		   "(pfn %#" PRIx64 ", %s, %s)", old.pfn, old.merged ? "the server's page" :
		   old.ksm ? "another KSM page" : "a private page",
		   old.bytes_ok ? "right bytes" : "WRONG BYTES");
	}

	/* A second QEMU process reads the same blocks: same server pages */
	start_qemu(&q2, 1, "merge");
	find_ram(&q2);
	ide_init(&q2);
	k0 = ksm_counters();
	gpas(gpa, 16, 0x400000, PS);
	read_and_check(&q2, "second qemu", 0, 16, gpa, true);
	{
		struct page_state a = check_page(&q, r3[0], 0, NULL);
		struct page_state b = check_page(&q2, gpa[0], 0, NULL);

		k1 = ksm_counters();
		ok(a.pfn == b.pfn && a.merged, "block 0: both QEMUs map the server's page %#" PRIx64,
		   b.srv_pfn);
		ok(k1.sources == k0.sources && k1.sharing - k0.sharing == listed1,
		   "second qemu: pages_sharing +%ld (want %u), sources +%ld (want 0)",
		   k1.sharing - k0.sharing, listed1, k1.sources - k0.sources);
	}
	check_every_listed_block(&q2, "second qemu", EXPECT_MERGED);
	stop_qemu(&q2);
	stop_qemu(&q);

	/* Timing: merge-ns per block, merge mode vs copy mode */
	{
		double ns_merge[2], ns_copy[2];

		timing("merge", 0, ns_merge);
		timing("copy", 1, ns_copy);
		diag("PAGESHARE-FILTER-TIMING ns per 4 KiB block in the filter's merge call: "
		     "merge %.0f (server page made KSM) %.0f (already KSM), copy %.0f %.0f",
		     ns_merge[0], ns_merge[1], ns_copy[0], ns_copy[1]);
	}

	booted_guest();

	/*
	 * Wrong image: a QEMU over another file of the same size, pointed at
	 * this server, even with the server's image-sha256 given (the
	 * operator's claim about the content is not proof of it): its own
	 * bytes, nothing merged, every listed block counted as unproven.
	 */
	{
		static const char other_path[] = WORK "/other.raw";
		uint8_t *other = malloc(image_size), *saved = image;
		int fd = open(other_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);

		if (!other || fd < 0)
			bail("other.raw: %s", strerror(errno));
		for (size_t i = 0; i < image_size; i++)
			other[i] = image[i] ^ 0xa5;
		if (write(fd, other, image_size) != (ssize_t)image_size)
			bail("write other.raw: %s", strerror(errno));
		close(fd);
		qemu_base = other_path;
		image = other;                  /* what this chain holds */
		start_qemu(&q, 0, "merge");
		find_ram(&q);
		ide_init(&q);
		k0 = ksm_counters();
		listed1 = check_every_listed_block(&q, "wrong image", EXPECT_NOT_MERGED);
		f1 = filter_stats(&q);
		k1 = ksm_counters();
		ok(f1.connected && f1.merged == 0 && f1.unproven >= listed1 && listed1 > 0 &&
		   k1.merged == k0.merged,
		   "wrong image: merged %ld (want 0), fallback-unproven %ld (want >= %u), "
		   "merge_page_merged +%ld (want 0)", f1.merged, f1.unproven, listed1,
		   k1.merged - k0.merged);
		ok(file_contains(WORK "/qemu0.log", "not using its table"),
		   "wrong image: QEMU says why it does not use the table");
		stop_qemu(&q);
		image = saved;
		qemu_base = NULL;
		free(other);
	}

	stalled_client();

	/*
	 * The base written in place under a running QEMU while the server is
	 * stopped (it cannot withdraw anything): the filter must see the
	 * change before it hands out the old bytes.  Last, as it changes
	 * base.raw.
	 */
	{
		char base_path[256];
		static uint8_t fresh[PS];
		int fd;

		start_qemu(&q, 0, "merge");
		find_ram(&q);
		ide_init(&q);
		gpas(gpa, 16, 0x400000, PS);
		read_and_check(&q, "before the base changes", 16, 16, gpa, true);
		kill(server_pid, SIGSTOP);
		snprintf(base_path, sizeof(base_path), "%s/base.raw", payload);
		fd = open(base_path, O_WRONLY);
		for (size_t i = 0; i < PS; i++)
			fresh[i] = (uint8_t)(i * 11 + 5);
		if (fd < 0 || pwrite(fd, fresh, PS, 40 * PS) != PS)
			bail("write base.raw: %s", strerror(errno));
		close(fd);
		memcpy(image + 40 * PS, fresh, PS);
		f0 = filter_stats(&q);
		check_every_listed_block(&q, "after the base changed in place",
				 EXPECT_NOT_MERGED);
		f1 = filter_stats(&q);
		ok(f1.base_changed && f1.merged == f0.merged,
		   "base changed: base-changed %d (want 1), merged +%ld (want 0)",
		   f1.base_changed, f1.merged - f0.merged);
		ok(file_contains(WORK "/qemu0.log", "changed while this VM uses it"),
		   "base changed: QEMU says so");
		kill(server_pid, SIGCONT);
		stop_qemu(&q);
	}

	ok(alive(server_pid), "the server is still running");
	cleanup();
	printf("1..%d\n", tap_n);
	diag("Totals: pass:%d fail:%d (%.0f s)", tap_n - tap_failed, tap_failed, now() - t_start);
	return tap_failed ? 1 : 0;
}
