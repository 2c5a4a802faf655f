// SPDX-License-Identifier: LGPL-2.1-or-later
/*
 * ksm_sysfs.c - /sys/kernel/mm/ksm, one knob or counter at a time.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ksm_sysfs.h"

static int ksm_sysfs_open(const char *name, int flags)
{
	char path[128];

	if (snprintf(path, sizeof(path), "/sys/kernel/mm/ksm/%s", name) >= (int)sizeof(path)) {
		errno = ENAMETOOLONG;
		return -1;
	}
	return open(path, flags | O_CLOEXEC);
}

long ksm_sysfs_get(const char *name)
{
	char buf[32], *end;
	ssize_t n;
	long val;
	int fd;

	fd = ksm_sysfs_open(name, O_RDONLY);
	if (fd < 0)
		return -1;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0) {
		if (!n)
			errno = ENODATA;
		return -1;
	}
	buf[n] = 0;
	errno = 0;
	val = strtol(buf, &end, 10);
	if (errno || end == buf) {
		errno = errno ? errno : EINVAL;
		return -1;
	}
	return val;
}

int ksm_sysfs_set(const char *name, long val)
{
	char buf[32];
	ssize_t n;
	int fd, len;

	fd = ksm_sysfs_open(name, O_WRONLY);
	if (fd < 0)
		return -1;
	len = snprintf(buf, sizeof(buf), "%ld", val);
	n = write(fd, buf, len);
	close(fd);
	if (n != len) {
		if (n >= 0)
			errno = EIO;
		return -1;
	}
	return 0;
}
