/* SPDX-License-Identifier: LGPL-2.1-or-later */
/*
 * ksm_sysfs.h - read and write the knobs and counters of /sys/kernel/mm/ksm.
 *
 * The test and benchmark programs in ../tests each need a few of them; this
 * is the one place that knows the path.  Both return like system calls.
 */
#ifndef PAGESHARE_KSM_SYSFS_H
#define PAGESHARE_KSM_SYSFS_H

/* The value of /sys/kernel/mm/ksm/<name>, or -1 with errno set. */
long ksm_sysfs_get(const char *name);

/* Write val to /sys/kernel/mm/ksm/<name>: 0, or -1 with errno set. */
int ksm_sysfs_set(const char *name, long val);

#endif /* PAGESHARE_KSM_SYSFS_H */
