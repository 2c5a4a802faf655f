#!/bin/busybox sh
# /init of each booted guest of bench/e2e_vs_ksm.py (busybox initramfs,
# kernel-syscall/config/guest-bench.config).  The guest mounts the golden
# image's root read-only from its virtio-blk disk (a qcow2 overlay of the
# golden image, through the pageshare filter or not), runs the image's own
# binaries, then reads its programs and libraries the way `grep -r` does (the talk's
# file-reading workload), prints a checksum of what it read, frees
# __STALE_MIB__ MiB of stale memory and idles with its page cache kept,
# until the driver stops it.  With --mixed, the kernel command line gives
# each guest its own directories to read and checksum (e2e_grep=, comma-
# separated) and a delay before it starts (e2e_delay=, s), so that guests
# are not in lockstep; the delay counts in the guest's boot time.  With
# --corunner, one guest reads nothing after its boot: it hashes e2e_cpu=
# MiB of zeros (CPU-bound, no disk), the co-runner whose pace the
# benchmark compares with and without the filter beside it.
# (shellcheck: busybox sh is an ash, which it checks as dash; $c, $grep_dirs
# and $sum_dirs are lists of words, a command line and directories, split
# on purpose.)
# shellcheck shell=dash disable=SC2086
/bin/busybox --install -s /bin
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
up() { cut -d' ' -f1 /proc/uptime; }
n=0; while [ ! -b /dev/vda ] && [ $n -lt 600 ]; do sleep 0.1; n=$((n+1)); done
if ! mount -t ext4 -o ro /dev/vda /mnt; then
    echo "GUEST-ERROR cannot mount /dev/vda (ext4, the golden image's root)"
    poweroff -f
fi
mount -t proc proc /mnt/proc 2>/dev/null
mount -t devtmpfs dev /mnt/dev 2>/dev/null
grep_dirs="__GREP_DIRS__" sum_dirs="__SUM_DIRS__" delay=0 cpu=
read -r cmdline < /proc/cmdline
for a in $cmdline; do
    case $a in
    e2e_grep=*) grep_dirs=$(echo "${a#e2e_grep=}" | tr , ' '); sum_dirs=$grep_dirs ;;
    e2e_delay=*) delay=${a#e2e_delay=} ;;
    e2e_cpu=*) cpu=${a#e2e_cpu=} ;;
    esac
done
sleep "$delay"
echo "GUEST-BOOTED $(up)"
if [ -n "$cpu" ]; then
    # the driver stamps both lines as they appear: the pace is host time
    echo "GUEST-CPUBEGIN $(up)"
    dd if=/dev/zero bs=1M count="$cpu" 2>/dev/null | sha256sum > /dev/null
    echo "GUEST-CPUEND $(up)"
    echo "GUEST-WORK-DONE $(up)"
    while :; do sleep 3600; done
fi
t0=$(up)
# the image's own binaries, which load its shared libraries
for c in "/bin/bash -c true" "/usr/bin/systemctl --version" \
         "/usr/lib/systemd/systemd --version" "/usr/bin/udevadm --version" \
         "/usr/bin/udevadm hwdb --test=pci:v00008086d00001237" \
         "/usr/bin/journalctl --version" "/usr/bin/dpkg -l" \
         "/usr/bin/apt-cache policy" "/usr/bin/perl -e 1" "/sbin/ldconfig -p" \
         "/usr/bin/ls -la /usr/bin" "/usr/bin/find /usr/share/doc -name copyright"; do
    chroot /mnt $c >/dev/null 2>&1
done
t1=$(up)
echo "GUEST-BINS $t0 $t1"
grep -r -q -F PAGESHARE-BENCH-NEVER-FOUND $grep_dirs
t2=$(up)
echo "GUEST-GREP $t1 $t2"
# one tar stream of the same tree is the same bytes only if every file is
sum=$(tar -cf - $sum_dirs 2>/dev/null | sha256sum)
echo "GUEST-SUM ${sum%% *}"
# Memory freed with stale data in it, the same in every guest: what a
# booted Debian leaves when it frees its unpacked initramfs, and what free
# page reporting is for (a reporting guest hands it back to the host, KSM
# would otherwise merge it).  A file on the initramfs's tmpfs, deleted:
# page i holds "pageshare stale page" and i, so that each page differs from
# the others but is the same in every guest, no page is a disk block's or
# zeros, and the sampler knows them all (bench/e2e_vs_ksm.py: stale_page).
memfree() { sed -n 's/^MemFree: *\([0-9]*\) kB/\1/p' /proc/meminfo; }
f0=$(memfree)
awk -v n=$((__STALE_MIB__ * 256)) \
    'BEGIN { for (i = 0; i < n; i++) printf "pageshare stale page %4074d\n", i }' > /stale
f1=$(memfree)
rm -f /stale
sleep 5
order=$(cat /sys/module/page_reporting/parameters/page_reporting_order 2>/dev/null)
echo "GUEST-FREED __STALE_MIB__ $f0 $f1 $(memfree) ${order:--}"
echo "GUEST-WORK-DONE $(up)"
while :; do sleep 3600; done
