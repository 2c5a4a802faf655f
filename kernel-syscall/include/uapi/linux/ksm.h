/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
#ifndef _UAPI_LINUX_KSM_H
#define _UAPI_LINUX_KSM_H

#include <linux/types.h>

/*
 * merge_page(2) and merge_pages(2): map pages that another process
 * published with madvise(MADV_ALLOWMERGED) copy-on-write into the caller.
 */

/* Fail with EAGAIN instead of waiting for ksmd or for a page lock. */
#define MERGE_PAGE_NOWAIT	0x1
/* Fail with EBUSY instead of splitting a huge page mapped at dst. */
#define MERGE_PAGE_NOSPLIT	0x2

/**
 * struct merge_page_vec - one merge_pages() entry
 * @src: page-aligned address in the process named by the pidfd
 * @dst: page-aligned address in the caller
 */
struct merge_page_vec {
	__u64 src;
	__u64 dst;
};

#endif /* _UAPI_LINUX_KSM_H */

/*
 * pageshare: everything above this comment is byte-identical to the
 * include/uapi/linux/ksm.h that kernel-syscall/patches adds (ktest.py
 * checks this).  Below: the series' madvise() advices and x86_64 syscall
 * numbers, for userspace built against kernel headers without them.
 */
#ifndef PAGESHARE_UAPI_KSM_COMPAT_H
#define PAGESHARE_UAPI_KSM_COMPAT_H

#ifndef MADV_ALLOWMERGED
#define MADV_ALLOWMERGED	26	/* merge_page() may share these pages */
#endif
#ifndef MADV_DISALLOWMERGED
#define MADV_DISALLOWMERGED	27	/* undo MADV_ALLOWMERGED */
#endif

#if defined(__x86_64__) && !defined(__ILP32__)
#ifndef __NR_merge_page
#define __NR_merge_page		463
#endif
#ifndef __NR_merge_pages
#define __NR_merge_pages	464
#endif
#endif

#endif /* PAGESHARE_UAPI_KSM_COMPAT_H */
