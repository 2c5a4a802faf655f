/* SPDX-License-Identifier: LGPL-2.1-or-later */
/*
 * merge_page.h - userspace wrappers for merge_page(2) and merge_pages(2).
 *
 * The kernel calls take a pidfd of the publishing process.  merge_page()
 * below is the talk's call, merge_page(pid, src, dst): it opens a pidfd for
 * pid once and caches it.  A cached pidfd keeps naming the process it was
 * opened for; if that process is gone (ESRCH), the wrapper drops the entry
 * and opens a pidfd for whatever process has that pid now, once.  A pid
 * that names no process (any more) gives ESRCH, also while the process is
 * being reaped, when pidfd_open() itself says EINVAL (before Linux 6.16);
 * EINVAL from the wrapper means pid <= 0 or the id of a thread other than
 * the leader (pidfd_open()'s ENOENT from 6.16), not only the call's.  Callers
 * that can, should get the pidfd themselves (SO_PEERPIDFD, pidfd_open) and
 * use merge_page_fd(), which has no such race.
 *
 * All functions return like system calls: -1 with errno set on failure.
 */
#ifndef PAGESHARE_MERGE_PAGE_H
#define PAGESHARE_MERGE_PAGE_H

#include <sys/types.h>
#include <linux/ksm.h>	/* kernel-syscall/include/uapi/linux/ksm.h */

#ifdef __cplusplus
extern "C" {
#endif

/* merge_page(2): map page src of the process behind pidfd at dst. */
int merge_page_fd(int pidfd, const void *src, void *dst, unsigned int flags);

/* merge_pages(2): returns the number of leading entries merged. */
long merge_pages_fd(int pidfd, const struct merge_page_vec *vec,
		    unsigned int vlen, unsigned int flags);

/* The talk's interface: pid of the page server, its page, our page. */
int merge_page(pid_t pid, const void *src, void *dst);
long merge_pages(pid_t pid, const struct merge_page_vec *vec,
		 unsigned int vlen, unsigned int flags);

/* Close the cached pidfd of pid (or of all pids if pid is 0). */
void merge_page_forget(pid_t pid);

#ifdef __cplusplus
}
#endif

#endif /* PAGESHARE_MERGE_PAGE_H */
