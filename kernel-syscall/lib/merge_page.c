// SPDX-License-Identifier: LGPL-2.1-or-later
/*
 * merge_page.c - userspace wrappers for merge_page(2) and merge_pages(2),
 * with a small pidfd cache for the pid-based interface.  Thread-safe.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "merge_page.h"

#ifndef __NR_pidfd_open
#define __NR_pidfd_open 434
#endif

#ifndef PIDFD_THREAD
#define PIDFD_THREAD O_EXCL	/* Linux 6.9 */
#endif

#define CACHE_SLOTS 16

static struct {
	pid_t pid;
	int pidfd;
	unsigned long used;	/* for LRU replacement */
} cache[CACHE_SLOTS];
static unsigned long clock_tick;
static pthread_mutex_t cache_lock = PTHREAD_MUTEX_INITIALIZER;

int merge_page_fd(int pidfd, const void *src, void *dst, unsigned int flags)
{
	return syscall(__NR_merge_page, pidfd, (uintptr_t)src, (uintptr_t)dst, flags);
}

long merge_pages_fd(int pidfd, const struct merge_page_vec *vec,
		    unsigned int vlen, unsigned int flags)
{
	return syscall(__NR_merge_pages, pidfd, vec, vlen, flags);
}

/*
 * pidfd_open(pid, 0), with ESRCH for a process that is gone and EINVAL for
 * a thread that is not a process.  Before Linux 6.16, pidfd_open() fails
 * with EINVAL, not ESRCH, when it finds the pid but no thread-group leader
 * with it: the process is being reaped right now (release_task() has
 * detached it but not yet freed the pid), it was reaped while the pid lives
 * on as a process group or session id, or the pid is that of a thread other
 * than the leader.  Only the last is the caller's mistake: a thread has a
 * task of its own, so pidfd_open(pid, PIDFD_THREAD) succeeds for it, and
 * fails when no task has the pid.  From 6.16, pidfd_open() says ESRCH and
 * ENOENT (a thread) itself; ENOENT would read as merge_pages()' "no page at
 * the source", so it becomes EINVAL here too.
 */
static int open_pidfd(pid_t pid)
{
	int fd, probe;

	fd = syscall(__NR_pidfd_open, pid, 0);
	if (fd >= 0 || pid <= 0)
		return fd;
	if (errno == ENOENT)
		errno = EINVAL;
	if (errno != EINVAL)
		return -1;
	probe = syscall(__NR_pidfd_open, pid, PIDFD_THREAD);
	if (probe >= 0) {
		close(probe);
		errno = EINVAL;	/* a thread, not a process */
	} else {
		errno = ESRCH;
	}
	return -1;
}

/* Return a cached or new pidfd for pid; -1 with errno on failure. */
static int pidfd_of(pid_t pid)
{
	int i, victim = 0, fd;

	pthread_mutex_lock(&cache_lock);
	for (i = 0; i < CACHE_SLOTS; i++) {
		if (cache[i].pid == pid && cache[i].pidfd > 0) {
			cache[i].used = ++clock_tick;
			fd = cache[i].pidfd;
			pthread_mutex_unlock(&cache_lock);
			return fd;
		}
		if (cache[i].used < cache[victim].used)
			victim = i;
	}
	fd = open_pidfd(pid);
	if (fd >= 0) {
		if (cache[victim].pidfd > 0)
			close(cache[victim].pidfd);
		cache[victim].pid = pid;
		cache[victim].pidfd = fd;
		cache[victim].used = ++clock_tick;
	}
	pthread_mutex_unlock(&cache_lock);
	return fd;
}

void merge_page_forget(pid_t pid)
{
	pthread_mutex_lock(&cache_lock);
	for (int i = 0; i < CACHE_SLOTS; i++) {
		if ((!pid || cache[i].pid == pid) && cache[i].pidfd > 0) {
			close(cache[i].pidfd);
			cache[i].pidfd = 0;
			cache[i].pid = 0;
			cache[i].used = 0;
		}
	}
	pthread_mutex_unlock(&cache_lock);
}

long merge_pages(pid_t pid, const struct merge_page_vec *vec,
		 unsigned int vlen, unsigned int flags)
{
	long ret;
	int fd;

	for (int attempt = 0; attempt < 2; attempt++) {
		fd = pidfd_of(pid);
		if (fd < 0)
			return -1;
		ret = merge_pages_fd(fd, vec, vlen, flags);
		if (ret >= 0 || errno != ESRCH)
			return ret;
		/* The process we cached is gone; the pid may name a new one. */
		merge_page_forget(pid);
	}
	return ret;
}

int merge_page(pid_t pid, const void *src, void *dst)
{
	struct merge_page_vec vec = { .src = (uintptr_t)src, .dst = (uintptr_t)dst };

	return merge_pages(pid, &vec, 1, 0) == 1 ? 0 : -1;
}
