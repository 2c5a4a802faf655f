#!/bin/sh
# The in-VM half of bench/e2e_vs_ksm.py: runs in the pageshare host (the
# patched 6.12 kernel booted under QEMU, everything in its initramfs under
# /pageshare) and runs each configuration in turn with the same guests and
# workload:
#
#   none         no sharing (ksmd stopped, no filter)
#   ksm          KSM as a 6.12 host runs it: run=1 and the kernel's defaults
#                (pages_to_scan 100, sleep 20 ms, smart_scan on)
#   ksm-advisor  the same with advisor_mode=scan-time
#   pageshare    the filter in merge mode with pageshare-server, and KSM
#                as in "ksm" for everything else
#   ksm-fpr      "ksm" with virtio-balloon free page reporting in the guests
#   pageshare-faults
#                "pageshare" while the server is killed and restarted, reloads
#                a list of half the blocks and ksmd is switched off and on
#   ksm-ptsN, pageshare-ptsN
#                "ksm" or "pageshare" with ksmd's pages_to_scan = N instead
#                of 100 (points of KSM's CPU/sharing frontier; N = 0 keeps
#                KSM in merge mode, as merge_pages needs, with ksmd idle)
#
# Every line the outer script reads starts with E2E-: E2E-EV (an event),
# E2E-G/E2E-H (e2e_sampler's samples), E2E-GUEST (a guest's own marks),
# E2E-GLOG (a guest's serial log), E2E-ERROR (a refusal or a failure).
#
# The host must be a pageshare host: the merge_pages series, and KSM in
# merge mode (run=1), as pageshare-server needs it; the driver refuses
# anything else before it starts a thing.  It saves KSM's settings first
# and puts them back on every way out.
#
#   sh driver.sh              run what /pageshare/e2e.env says
#   sh driver.sh --preflight  only check that this host can run it
#
# Expansions are unquoted where they cannot split or glob: $P, $W and $K
# are the payload's directory, /tmp/e2e and KSM's sysfs directory (no
# blanks, no wildcards), the rest numbers, or lists of words split on
# purpose (the saved KSM settings, mig_refs' six counters).
# shellcheck disable=SC2086,SC2046
set -u
P=${PAGESHARE_PAYLOAD:-/pageshare}
W=/tmp/e2e
K=${E2E_KSM_SYSFS:-/sys/kernel/mm/ksm}
LIST=/tmp/pageshare/base.pcsl
cfg=preflight
saved_ksm=""

ms() { awk '{ printf "%d", $1 * 1000 }' /proc/uptime; }
ev() { echo "E2E-EV $cfg $(ms) $*"; }
fail() {
    echo "E2E-ERROR $*"
    if [ -n "$saved_ksm" ]; then
        stop_all
        restore_ksm
    fi
    restore_khp
    pressure_off
    redis_stop
    exit 1
}

preflight() {
    [ -d "$K" ] || fail "this kernel has no KSM ($K missing): the benchmark needs" \
        "a pageshare host, a kernel with CONFIG_KSM and the merge_pages series" \
        "(kernel-syscall/)"
    [ -e "$K/merge_page_merged" ] || fail "this kernel lacks the merge_pages series" \
        "($K/merge_page_merged missing): boot the patched kernel" \
        "(kernel-syscall/ktest.py builds it); pageshare cannot merge here"
    [ -w "$K/run" ] || fail "$K/run is not writable: run the benchmark as root"
    run=$(cat "$K/run")
    [ "$run" = 1 ] || fail "KSM is off on this host ($K/run is $run, not 1):" \
        "pageshare merges guest pages into KSM pages and needs KSM in merge" \
        "mode; switch it on (echo 1 > $K/run) and start the benchmark again"
}

# KSM's settings as found, restored on every way out ("knob value" pairs;
# advisor_mode reads "[none] scan-time": the bracketed one is set).
KSM_KNOBS="pages_to_scan sleep_millisecs smart_scan use_zero_pages max_page_sharing
    stable_node_chains_prune_millisecs advisor_mode advisor_target_scan_time
    advisor_max_cpu advisor_min_pages_to_scan advisor_max_pages_to_scan"
save_ksm() {
    saved_ksm="run $(cat "$K/run")"
    for f in $KSM_KNOBS; do
        [ -e "$K/$f" ] || continue
        v=$(sed 's/.*\[\(.*\)\].*/\1/' "$K/$f")
        saved_ksm="$saved_ksm $f $v"
    done
}
restore_ksm() {
    [ -n "$saved_ksm" ] || return 0
    # stop and unmerge first: max_page_sharing cannot change while pages are merged
    echo 2 > "$K/run"
    echo 0 > "$K/run"
    set -- $saved_ksm
    run=$2
    shift 2
    while [ $# -ge 2 ]; do
        echo "$2" > "$K/$1" 2>/dev/null || echo "E2E-EV $cfg $(ms) ksm-restore-failed $1=$2"
        shift 2
    done
    echo "$run" > "$K/run"
    saved_ksm=""
}

# A pageshare host's khugepaged setting (the pageshare-server package sets
# it at boot): max_ptes_shared = 0, so that khugepaged never collapses a
# 2 MiB range of guest RAM holding a shared page, which copies (unshares)
# its KSM pages.  It is the host's, so every configuration runs with it,
# KSM's too; the value found is restored on every way out.
KHP=/sys/kernel/mm/transparent_hugepage/khugepaged
saved_khp=""
pageshare_khp() {
    [ -w "$KHP/max_ptes_shared" ] || return 0
    saved_khp=$(cat "$KHP/max_ptes_shared")
    echo 0 > "$KHP/max_ptes_shared"
}
restore_khp() {
    [ -n "$saved_khp" ] || return 0
    echo "$saved_khp" > "$KHP/max_ptes_shared" ||
        echo "E2E-EV $cfg $(ms) khugepaged-restore-failed max_ptes_shared=$saved_khp"
    saved_khp=""
}

if [ "${1:-}" = --preflight ]; then
    preflight
    echo "E2E-PREFLIGHT ok"
    exit 0
fi
# shellcheck source=/dev/null  # written by bench/e2e_vs_ksm.py
. $P/e2e.env
preflight
save_ksm
pageshare_khp

ksm_defaults() {
    # 6.12's boot defaults; the "none" configuration stops ksmd instead
    echo 100 > $K/pages_to_scan
    echo 20 > $K/sleep_millisecs
    echo 1 > $K/smart_scan
    echo 0 > $K/use_zero_pages
    echo 256 > $K/max_page_sharing
    [ -e $K/advisor_mode ] && echo none > $K/advisor_mode
}

server_pid=0
sampler_pid=0
marks_pid=0
qemu_pids=""

stop_all() {
    [ "$marks_pid" != 0 ] && kill "$marks_pid" 2>/dev/null
    [ "$sampler_pid" != 0 ] && kill "$sampler_pid" 2>/dev/null
    for p in $qemu_pids; do kill "$p" 2>/dev/null; done
    for p in $qemu_pids; do wait "$p" 2>/dev/null; done
    [ "$sampler_pid" != 0 ] && wait "$sampler_pid" 2>/dev/null
    if [ "$server_pid" != 0 ]; then
        kill "$server_pid" 2>/dev/null
        wait "$server_pid" 2>/dev/null
    fi
    [ "$marks_pid" != 0 ] && wait "$marks_pid" 2>/dev/null
    sampler_pid=0 server_pid=0 marks_pid=0 qemu_pids=""
    # unmerge what is left so the next configuration starts from nothing
    echo 2 > $K/run
    echo 0 > $K/run
}
trap 'echo "E2E-ERROR the driver was stopped (signal)"; stop_all; restore_ksm; restore_khp; pressure_off; exit 1' INT TERM

# --pressure (PRESSURE_MIB > 0): host memory pressure in every
# configuration.  A tmpfs file of PRESSURE_MIB MiB, written before the
# guests start and never read again, takes the memory; a zram swap device
# lets the kernel reclaim anonymous and shmem pages (the filler's first, as
# the oldest, then the guests' and the server's).  The filler is text, so
# zram holds it in little memory.  Swap and filler go on every way out.
pressure_on() {
    [ "${PRESSURE_MIB:-0}" -gt 0 ] || return 0
    if ! grep -q '^/dev/zram0 ' /proc/swaps; then
        [ -e /sys/block/zram0/disksize ] ||
            fail "--pressure needs zram (CONFIG_ZRAM) in the pageshare host kernel"
        echo $((PRESSURE_MIB * 2))M > /sys/block/zram0/disksize ||
            fail "zram0: cannot set its size"
        mkswap /dev/zram0 > /dev/null || fail "mkswap /dev/zram0 failed"
        swapon /dev/zram0 || fail "cannot swap on /dev/zram0"
    fi
    mkdir -p $W/pressure
    mount -t tmpfs -o size=$((PRESSURE_MIB + 16))m pressure $W/pressure ||
        fail "cannot mount the filler's tmpfs"
    yes "pageshare host memory pressure, a line of filler text" |
        head -c $((PRESSURE_MIB * 1048576)) > $W/pressure/fill
    ev pressure "filler_mib=$PRESSURE_MIB $(grep -E '^(MemAvailable|SwapFree):' /proc/meminfo | tr -s ' ' | tr '\n' ' ')"
}
pressure_off() {
    [ "${PRESSURE_MIB:-0}" -gt 0 ] || return 0
    rm -f $W/pressure/fill
    umount $W/pressure 2>/dev/null
    return 0
}
# --feedback (FEEDBACK=1): a Redis in the host VM for the server's read
# feedback ([feedback] in server.toml); emptied before each filter
# configuration, and what the server published dumped after it:
#   E2E-FB cfg key field value     the summary's text fields
#   E2E-FBB cfg key line           its blocks field, base64, line by line
RSOCK=/tmp/redis.sock
redis_pid=0
redis_start() {
    [ "${FEEDBACK:-0}" = 1 ] || return 0
    $P/bin/redis-server --unixsocket $RSOCK --port 0 --save "" --appendonly no \
        > $W/redis.log 2>&1 &
    redis_pid=$!
    wait_file $RSOCK 60 || fail "redis-server did not start: $(tail -3 $W/redis.log)"
}
redis_stop() {
    [ "$redis_pid" != 0 ] || return 0
    kill "$redis_pid" 2>/dev/null
    wait "$redis_pid" 2>/dev/null
    redis_pid=0
}
rcli() { $P/bin/redis-cli -s $RSOCK --raw "$@"; }
feedback_reset() {
    [ "${FEEDBACK:-0}" = 1 ] || return 0
    rcli FLUSHALL > /dev/null || fail "redis: FLUSHALL failed"
}
feedback_dump() {
    [ "${FEEDBACK:-0}" = 1 ] || return 0
    for key in $(rcli KEYS 'pageshare:feedback:*'); do
        case $key in *:hosts) continue ;; esac
        for f in host image since updated guests version; do
            echo "E2E-FB $cfg $key $f $(rcli HGET "$key" $f)"
        done
        # --raw ends the value with a newline: the reader drops it
        rcli HGET "$key" blocks > $W/fb-blocks
        base64 $W/fb-blocks | sed "s|^|E2E-FBB $cfg $key |"
    done
}

swap_off() {
    grep -q '^/dev/zram0 ' /proc/swaps || return 0
    swapoff /dev/zram0 && echo 1 > /sys/block/zram0/reset
}

wait_file() { # path seconds
    n=0
    while [ ! -e "$1" ] && [ $n -lt $(($2 * 10)) ]; do sleep 0.1; n=$((n + 1)); done
    [ -e "$1" ]
}

start_server() {
    # the cache (the image's verified identity) survives a restart
    rm -rf /tmp/pageshare/run
    mkdir -p /tmp/pageshare/run /tmp/pageshare/cache
    $P/bin/pageshare-server run --config $P/server.toml >> $W/server.log 2>&1 &
    server_pid=$!
    n=0
    until [ -e /tmp/pageshare/run/base.sock ]; do
        kill -0 "$server_pid" 2>/dev/null ||
            { cat $W/server.log; fail "pageshare-server exited before publishing base.sock"; }
        [ $n -gt 6000 ] && { cat $W/server.log; fail "pageshare-server: no base.sock after 600 s"; }
        sleep 0.1
        n=$((n + 1))
    done
    # as on a host where the server runs before VMs start: wait until the
    # image is published (its first start hashes the whole image)
    n=0
    until grep -q "image base: published" $W/server.log; do
        kill -0 "$server_pid" 2>/dev/null ||
            { cat $W/server.log; fail "pageshare-server exited before publishing"; }
        [ $n -gt 6000 ] && { cat $W/server.log; fail "pageshare-server: image not published after 600 s"; }
        sleep 0.1
        n=$((n + 1))
    done
    ev server-ready "$(grep -c . $W/server.log)"
}

start_guest() { # index filter(0/1) balloon(0/1)
    i=$1 filter=$2 balloon=$3
    ovl=$W/ovl$i.qcow2
    rm -f $ovl $W/g$i.log $W/qmp$i.sock $W/hmp$i.sock
    $P/bin/qemu-img create -q -f qcow2 -F qcow2 -b $P/base.qcow2 $ovl ||
        fail "qemu-img create $ovl"
    backing=base trace=
    set -- -blockdev \
        '{"driver":"file","node-name":"base-file","filename":"'$P'/base.qcow2","read-only":true}' \
        -blockdev '{"driver":"qcow2","node-name":"base","file":"base-file","read-only":true}'
    if [ "$filter" = 1 ]; then
        # exactly qemu-patches/README.md's -blockdev graph, in merge mode
        set -- "$@" -blockdev '{"driver":"pageshare","node-name":"ps","file":"base","read-only":true,"server":"/tmp/pageshare/run/base.sock","mode":"merge"}'
        backing="ps"
        # each merge's guest address, for the sampler (its TRACE_LOG)
        trace="-trace pageshare_merge"
    fi
    set -- "$@" -blockdev '{"driver":"file","node-name":"ovl-file","filename":"'$ovl'"}' \
        -blockdev '{"driver":"qcow2","node-name":"ovl","file":"ovl-file","backing":"'$backing'"}' \
        -device virtio-blk-pci,drive=ovl
    [ "$balloon" = 1 ] && set -- "$@" -device virtio-balloon-pci,free-page-reporting=on
    # --mixed: this guest's own reads and start (guest-init.sh)
    eval "gargs=\${GUEST_ARGS_$i:-}"
    # The kernel's messages are kept (no "quiet"): a guest that does not
    # boot says how far it got.  no_timer_check, as libguestfs boots its
    # TCG appliance: the kernel's boot-time test of the timer interrupt
    # waits about 60 ms of TSC time for 4 ticks, which a nested guest on a
    # loaded host can miss; it then panics "IO-APIC + timer doesn't work!"
    # (two of the runs' guests did, after the pageshare configuration).
    # panic=-1: a guest that panics anyway exits (-no-reboot) instead of
    # spinning, and its configuration runs again.  page_reporting_order=9
    # reports free 2 MiB blocks, as a distribution kernel with THP does
    # (this small kernel has no THP, so its default would be 4 MiB); without
    # a balloon it is unused.  A second monitor (hmp$i.sock) is free for the
    # driver's questions while the sampler holds the first.
    # shellcheck disable=SC2154  # gargs: set by the eval above
    $P/bin/qemu-system-x86_64 -M pc -accel tcg,tb-size=64 -m "${GUEST_MIB}M" -smp 1 \
        -nodefaults -display none -no-reboot -L $P/share/qemu \
        -kernel $P/guest/vmlinuz -initrd $P/guest/initramfs.cpio.gz \
        -append "console=ttyS0 no_timer_check panic=-1 page_reporting.page_reporting_order=9 $gargs" \
        -serial file:$W/g$i.log -qmp unix:$W/qmp$i.sock,server=on,wait=off \
        -qmp unix:$W/hmp$i.sock,server=on,wait=off $trace "$@" > $W/qemu$i.log 2>&1 &
    qemu_pids="$qemu_pids $!"
}

# Each guest's markers, stamped as they appear (to a second) by a process
# of their own, whatever the driver is doing meanwhile (the faults
# configuration's faults take half a minute): a nested guest's own clock
# runs slow when the host is loaded.
stamp_marks() {
    seen=" "
    while :; do
        for i in $(seq 1 "$GUESTS"); do
            for m in BOOTED BINS GREP FREED CPUBEGIN CPUEND WORK-DONE; do
                case "$seen" in *" $i:$m "*) continue ;; esac
                if grep -q "GUEST-$m" $W/g$i.log 2>/dev/null; then
                    seen="$seen$i:$m "
                    ev mark "$i $m"
                    # the sampler's next pass reads every page (a guest's
                    # end of reads, GREP, is read at once)
                    : > $W/marks/$i.$m
                fi
            done
        done
        sleep 1
    done
}

# A guest's serial log, as E2E-GLOG lines (the outer script keeps them in
# the run's serial log).
dump_guest_log() { # index
    tr -d '\r' < $W/g$1.log 2>/dev/null | head -n 400 | sed "s/^/E2E-GLOG $cfg $1 /"
}

# Guests that have not printed GUEST-BOOTED BOOT_TIMEOUT s after they were
# started: each one's serial log and where its CPU is (RIP, sampled five
# times), and status 0.  Status 1 while there is time, or all booted.
boot_hung() {
    [ "$all_booted" = 1 ] && return 1
    [ "$(cat $W/g*.log 2>/dev/null | grep -c GUEST-BOOTED)" -ge "$GUESTS" ] &&
        { all_booted=1; return 1; }
    [ $(($(ms) / 1000)) -lt "$boot_deadline" ] && return 1
    hung=0
    for i in $(seq 1 "$GUESTS"); do
        grep -q GUEST-BOOTED $W/g$i.log 2>/dev/null && continue
        rips=""
        for n in 1 2 3 4 5; do
            rips="$rips $($P/bin/e2e_sampler --hmp $W/hmp$i.sock 'info registers' 2>&1 |
                sed -n 's/.*RIP=\([0-9a-f]*\).*/\1/p' | head -n 1)"
            sleep 1
        done
        # booted while we looked: late, not hung
        grep -q GUEST-BOOTED $W/g$i.log 2>/dev/null && continue
        hung=1
        ev boot-hung "$i not booted after $BOOT_TIMEOUT s; RIP$rips"
        dump_guest_log "$i"
        $P/bin/e2e_sampler --hmp $W/hmp$i.sock 'info registers' 2>&1 |
            tr -d '\r' | sed "s/^/E2E-GLOG $cfg $i regs: /"
    done
    [ "$hung" = 1 ]
}

# A guest's QEMU that exited: before its guest booted (a panic, with
# panic=-1) its log is shown and status 0 (the configuration may run
# again); after, the run fails.  Status 1: all there.
qemu_gone() {
    i=0
    for p in $qemu_pids; do
        i=$((i + 1))
        kill -0 "$p" 2>/dev/null && continue
        grep -q GUEST-BOOTED $W/g$i.log 2>/dev/null ||
            { ev boot-failed "$i: its QEMU exited before the guest booted"; dump_guest_log "$i"; return 0; }
        grep -hv pageshare_merge $W/qemu*.log   # its errors, not the trace
        fail "guest $i's QEMU exited"
    done
    return 1
}

# All guests print GUEST-WORK-DONE (or one fails); $1: timeout in seconds.
# Status 2: a guest did not boot (boot_hung), the configuration may run again.
wait_guests() {
    deadline=$(($(ms) / 1000 + $1))
    while :; do
        done_n=0
        for i in $(seq 1 "$GUESTS"); do
            grep -q GUEST-ERROR $W/g$i.log 2>/dev/null &&
                { dump_guest_log "$i"; fail "guest $i: $(grep GUEST-ERROR $W/g$i.log)"; }
            grep -q GUEST-WORK-DONE $W/g$i.log 2>/dev/null && done_n=$((done_n + 1))
        done
        [ "$done_n" = "$GUESTS" ] && return 0
        qemu_gone && return 2
        kill -0 "$sampler_pid" 2>/dev/null || fail "e2e_sampler exited (its message is above)"
        boot_hung && return 2
        [ $(($(ms) / 1000)) -gt "$deadline" ] && fail "guests not done after $1 s"
        sleep 1
    done
}

# While the guests read: the server SIGKILLed and restarted, a reload with
# a list of half the blocks, ksmd switched off and on again.  The guests'
# checksums must still be everyone else's.
inject_faults() {
    until [ "$(cat $W/g*.log 2>/dev/null | grep -c GUEST-BOOTED)" -ge "$GUESTS" ]; do
        qemu_gone && return 2
        boot_hung && return 2
        sleep 1
    done
    kill -9 "$server_pid"
    wait "$server_pid" 2>/dev/null
    ev fault server-killed
    start_server
    ev fault server-restarted
    sleep 10
    cp $P/base-half.pcsl /tmp/pageshare/half.pcsl
    mv /tmp/pageshare/half.pcsl "$LIST"
    $P/bin/pageshare-server reload --config $P/server.toml >> $W/server.log 2>&1 ||
        fail "pageshare-server reload failed: $(tail -3 $W/server.log)"
    ev fault list-reloaded-half
    sleep 10
    echo 0 > $K/run
    ev fault ksmd-off
    sleep 10
    echo 1 > $K/run
    ev fault ksmd-on
}

# The host's huge page events so far (/proc/vmstat): a merge into a huge
# page of guest RAM splits its PMD first, and khugepaged's collapses copy
# pages (KSM's among them) into new huge pages.
thp_counters() {
    grep -E '^thp_(fault_alloc|collapse_alloc|split_page|split_pmd) ' /proc/vmstat |
        tr ' ' = | tr '\n' ' '
}

run_config() { # name filter ksm(off/default/advisor) balloon
    cfg=$1 c_filter=$2 c_ksm=$3 c_balloon=$4
    ev begin "filter=$c_filter ksm=$c_ksm balloon=$c_balloon guests=$GUESTS guest_mib=$GUEST_MIB"
    ksm_defaults
    c_base=${cfg%-r[0-9]*}  # NAME-rN: NAME run again
    case $c_base in *-pts[0-9]*) echo "${c_base##*-pts}" > $K/pages_to_scan ;; esac
    ev ksm-knobs "pages_to_scan=$(cat $K/pages_to_scan) sleep_millisecs=$(cat $K/sleep_millisecs)"
    ev thp-begin "$(thp_counters)"
    if [ "$c_ksm" = off ]; then
        echo 0 > $K/run
    else
        [ "$c_ksm" = advisor ] && echo scan-time > $K/advisor_mode
        echo 1 > $K/run
    fi
    if [ "$c_filter" = 1 ]; then
        feedback_reset
        # the full list, in a place a reload may replace it
        mkdir -p /tmp/pageshare
        cp $P/base.pcsl "$LIST"
        rm -rf /tmp/pageshare/cache
        : > $W/server.log
        start_server
    fi
    pressure_on
    for i in $(seq 1 "$GUESTS"); do start_guest "$i" "$c_filter" "$c_balloon"; done
    ev guests-started "$qemu_pids"
    all_booted=0
    boot_deadline=$(($(ms) / 1000 + BOOT_TIMEOUT))
    set --
    i=0
    for p in $qemu_pids; do
        i=$((i + 1))
        wait_file $W/qmp$i.sock 120 || fail "guest $i: no QMP socket"
        if [ "$c_filter" = 1 ]; then
            set -- "$@" "$p:$W/qmp$i.sock:$W/qemu$i.log"
        else
            set -- "$@" "$p:-"
        fi
    done
    rm -rf $W/marks
    mkdir -p $W/marks
    E2E_STALE_HASHES=$P/stale.hashes E2E_MARKS=$W/marks $P/bin/e2e_sampler "$cfg" $P/listed.hashes \
        "$INTERVAL_MS" "$server_pid" "$GUEST_MIB" "$@" &
    sampler_pid=$!
    stamp_marks &
    marks_pid=$!
    rc=0
    [ "$c_base" = pageshare-faults ] && { inject_faults || rc=$?; }
    [ "$rc" = 0 ] && { wait_guests "$WORK_TIMEOUT" || rc=$?; }
    if [ "$rc" != 0 ]; then
        stop_all
        pressure_off
        return "$rc"
    fi
    ev work-done
    for i in $(seq 1 "$GUESTS"); do
        # the guest's own marks: booted, binaries, grep start/end, sum, the
        # memory it freed (MiB, MemFree before/after, page_reporting_order)
        echo "E2E-GUEST $cfg $i $(grep -E '^GUEST-(BOOTED|BINS|GREP|SUM|FREED|CPUBEGIN|CPUEND|WORK-DONE)' $W/g$i.log |
            tr -d '\r' | tr '\n' ' ')"
    done
    [ "$c_filter" = 1 ] && ev server-log "$(tr '\n' '|' < $W/server.log | cut -c1-600)"
    sleep "$OBSERVE"
    ev thp-end "$(thp_counters)"
    ev end
    [ "$c_filter" = 1 ] && feedback_dump
    for i in $(seq 1 "$GUESTS"); do dump_guest_log "$i"; done
    [ "${MIGRATE:-0}" = 1 ] && [ "$cfg" = pageshare ] && migrate_phase
    stop_all
    pressure_off
}

# ------------------------------------------------------------------------
# Live migration of guest 1 after the workload (MIGRATE=1, the bench's
# --migrate; issue 21 in merge mode): for each of MIG_METHODS, from the
# same guest state, guest 1 migrates over a Unix socket at MIG_BW bytes/s
# to a new QEMU with its own command line (read from /proc) plus
# -incoming defer; then that destination is stopped and guest 1, paused
# after the migration, runs on ("cont") for the next method.  Lines:
#   E2E-MQ method JSON          the source's last query-migrate reply
#   E2E-M  method key=value ... status, times, both QEMUs' CPU (ms, from
#                               migrate to completion), the filters'
#                               migration-refs-* counters, census times
#   E2E-MS method side <E2E-G fields from t_ms on>
#                               e2e_sampler's samples of the source (side
#                               src, one, before the migration) and of the
#                               destination (dst, every second from right
#                               after switchover: for block-refs a few, for
#                               the others until the share of listed pages
#                               it holds that are KSM pages reaches
#                               block-refs' first one, or MIG_KSM_CAP s)
# A method that fails is an E2E-M line with status=failed and the next
# one runs; the phase never fails the run.
MIG_METHODS=${MIG_METHODS:-block-refs precopy xbzrle multifd-zstd}
MIG_BW=${MIG_BW:-125000000}
MIG_KSM_CAP=${MIG_KSM_CAP:-300}
mig_target=""

mig_q() { # socket json: the reply line
    $P/bin/e2e_sampler --qmp "$1" "$2" 2>&1
}
mig_field() { # json key: the first number after "key":
    echo "$1" | sed -n "s/.*\"$2\": *\([0-9-]*\).*/\1/p" | head -n 1
}
mig_str() { # json key: the first string after "key":
    echo "$1" | sed -n "s/.*\"$2\": *\"\([^\"]*\)\".*/\1/p" | head -n 1
}
mig_cpu_ms() { # pid: utime + stime, ms
    awk '{ printf "%d", ($14 + $15) * 10 }' /proc/$1/stat 2>/dev/null || echo -1
}
# The filter's migration-refs-* counters, "sent refused merged copied read
# failed" (only the pageshare node has them)
mig_refs() { # socket
    r=$(mig_q "$1" '{"execute": "query-blockstats", "arguments": {"query-nodes": true}}')
    out=""
    for k in sent refused merged copied read failed; do
        v=$(mig_field "$r" "migration-refs-$k")
        out="$out ${v:--1}"
    done
    echo $out
}
# Capabilities and parameters of a method, the same on both sides; every
# capability is set each time (a source keeps what the last method set).
mig_configure() { # socket method
    x=false mf=false br=false
    case $2 in
    xbzrle) x=true ;;
    multifd-zstd) mf=true ;;
    block-refs) br=true ;;
    esac
    mig_q "$1" '{"execute": "migrate-set-capabilities", "arguments": {"capabilities": [{"capability": "xbzrle", "state": '$x'}, {"capability": "multifd", "state": '$mf'}, {"capability": "block-refs", "state": '$br'}]}}' |
        grep -q '"return"' || return 1
    mig_q "$1" '{"execute": "migrate-set-parameters", "arguments": {"xbzrle-cache-size": 268435456, "multifd-channels": 2}}' |
        grep -q '"return"' || return 1
    [ "$2" = multifd-zstd ] || return 0
    mig_q "$1" '{"execute": "migrate-set-parameters", "arguments": {"multifd-compression": "zstd"}}' |
        grep -q '"return"'
}
mig_wait_status() { # socket status seconds
    n=0
    until mig_q "$1" '{"execute": "query-status"}' | grep -q "\"status\": \"$2\""; do
        [ $n -ge $(($3 * 5)) ] && return 1
        sleep 0.2
        n=$((n + 1))
    done
}
# e2e_sampler on one QEMU in the background, its lines in $W/mig-$2.samples
mig_sampler() { # pid side
    rm -f $W/mig-$2.samples
    $P/bin/e2e_sampler mig $P/listed.hashes 1000 "$server_pid" "$GUEST_MIB" "$1:-" \
        > $W/mig-$2.samples 2>&1 &
    mig_sampler_pid=$!
}
mig_samples() { # file: its E2E-G lines
    grep '^E2E-G ' "$1" 2>/dev/null
}
mig_emit_samples() { # method side (of the source, its first sample)
    if [ "$2" = src ]; then n=1; else n=100000; fi
    mig_samples $W/mig-$2.samples | head -n $n | sed "s/^E2E-G [^ ]* /E2E-MS $1 $2 /"
    grep -v '^E2E-' $W/mig-$2.samples 2>/dev/null | head -n 5 | sed "s/^/E2E-EV $cfg $(ms) mig-sampler $1 $2: /"
}
mig_stop_sampler() {
    # (never "kill 0": that is the driver's whole process group)
    [ "$mig_sampler_pid" != 0 ] || return 0
    kill "$mig_sampler_pid" 2>/dev/null
    wait "$mig_sampler_pid" 2>/dev/null
    mig_sampler_pid=0
}
# the last E2E-G line's listed pages, in permille shared (-1: none yet)
mig_share() { # file
    mig_samples "$1" | tail -n 1 | awk '{ print ($10 > 0) ? int($11 * 1000 / $10) : -1 }'
}
mig_start_dst() { # source pid
    rm -f $W/migq.sock $W/migh.sock $W/mig-g.log
    # one argument a line (none holds a newline), its sockets and serial log renamed
    tr '\0' '\n' < /proc/$1/cmdline |
        sed -e "s#^file:$W/g[0-9]*[.]log\$#file:$W/mig-g.log#" \
            -e "s#^unix:$W/qmp[0-9]*[.]sock,#unix:$W/migq.sock,#" \
            -e "s#^unix:$W/hmp[0-9]*[.]sock,#unix:$W/migh.sock,#" > $W/mig-cmdline
    set --
    while IFS= read -r a; do set -- "$@" "$a"; done < $W/mig-cmdline
    "$@" -incoming defer > $W/mig-qemu.log 2>&1 &
    mig_dst_pid=$!
    wait_file $W/migq.sock 120
}
mig_stop_dst() {
    [ "$mig_dst_pid" != 0 ] || return 0
    kill "$mig_dst_pid" 2>/dev/null
    wait "$mig_dst_pid" 2>/dev/null
    mig_dst_pid=0
}
mig_failed() { # method why
    echo "E2E-M $1 status=failed why=$(echo "$2" | tr ' ' '_' | cut -c1-300)"
    tail -n 5 $W/mig-qemu.log 2>/dev/null | grep -v pageshare_merge |
        sed "s/^/E2E-EV $cfg $(ms) mig-dst-log $1: /"
    mig_stop_sampler
    mig_stop_dst
    mig_q $W/hmp1.sock '{"execute": "migrate_cancel"}' > /dev/null
    # the source runs on for the next method (after a failed migration it
    # is running already)
    mig_q $W/hmp1.sock '{"execute": "cont"}' > /dev/null
    return 1
}

mig_one() { # method
    m=$1
    ssock=$W/hmp1.sock dsock=$W/migq.sock uri=unix:$W/mig.sock
    src_pid=$(echo $qemu_pids | cut -d' ' -f1)
    ev mig-begin "$m"
    mig_wait_status $ssock running 60 || { mig_failed "$m" "the source is not running"; return 1; }
    # the source's census: one full sample
    mig_sampler "$src_pid" src
    n=0
    until [ -n "$(mig_samples $W/mig-src.samples)" ] || [ $n -ge 120 ]; do sleep 0.5; n=$((n + 1)); done
    mig_stop_sampler
    mig_emit_samples "$m" src
    rm -f $W/mig.sock
    mig_start_dst "$src_pid" || { mig_failed "$m" "the destination has no QMP socket"; return 1; }
    mig_configure $ssock "$m" || { mig_failed "$m" "source: capabilities refused"; return 1; }
    mig_configure $dsock "$m" || { mig_failed "$m" "destination: capabilities refused"; return 1; }
    mig_q $ssock '{"execute": "migrate-set-parameters", "arguments": {"max-bandwidth": '$MIG_BW'}}' |
        grep -q '"return"' || { mig_failed "$m" "max-bandwidth refused"; return 1; }
    if [ "$m" = block-refs ]; then
        # the destination names the source's image by its server's table:
        # connected, with a table (a generation)
        n=0
        until r=$(mig_q $dsock '{"execute": "query-blockstats", "arguments": {"query-nodes": true}}') &&
            case $r in *'"connected": true'*'"generation": '[0-9]*) true ;; *) false ;; esac; do
            [ $n -ge 300 ] && { mig_failed "$m" "the destination's filter has no server"; return 1; }
            sleep 0.2
            n=$((n + 1))
        done
    fi
    r=$(mig_q $dsock '{"execute": "migrate-incoming", "arguments": {"uri": "'$uri'"}}')
    case $r in *'"return"'*) ;; *) mig_failed "$m" "migrate-incoming: $r"; return 1 ;; esac
    set -- $(mig_refs $ssock)
    src_sent0=$1 src_refused0=$2
    c0s=$(mig_cpu_ms "$src_pid") c0d=$(mig_cpu_ms "$mig_dst_pid")
    t0=$(ms)
    r=$(mig_q $ssock '{"execute": "migrate", "arguments": {"uri": "'$uri'"}}')
    case $r in *'"return"'*) ;; *) mig_failed "$m" "migrate: $r"; return 1 ;; esac
    while :; do
        r=$(mig_q $ssock '{"execute": "query-migrate"}')
        st=$(mig_str "$r" status)
        case $st in completed | failed | cancelled) break ;; esac
        [ $(($(ms) - t0)) -gt 900000 ] && break
        sleep 0.2
    done
    t1=$(ms)
    c1s=$(mig_cpu_ms "$src_pid") c1d=$(mig_cpu_ms "$mig_dst_pid")
    # the census right after switchover, before anything else
    [ "$st" = completed ] && mig_sampler "$mig_dst_pid" dst
    echo "E2E-MQ $m $r"
    [ "$st" = completed ] || { mig_failed "$m" "status $st: $(mig_str "$r" error-desc)"; return 1; }
    mig_wait_status $dsock running 60 || { mig_failed "$m" "the destination is not running"; return 1; }
    t_run=$(ms)
    set -- $(mig_refs $ssock)
    src_sent=$(($1 - src_sent0)) src_refused=$(($2 - src_refused0))
    set -- $(mig_refs $dsock)
    echo "E2E-M $m status=completed t_migrate_ms=$t0 t_done_ms=$t1 t_running_ms=$t_run" \
        "src_cpu_ms=$((c1s - c0s)) dst_cpu_ms=$((c1d - c0d)) bandwidth=$MIG_BW" \
        "refs_sent=$src_sent refs_refused=$src_refused refs_merged=$3 refs_copied=$4" \
        "refs_read=$5 refs_failed=$6"
    # the destination's share of listed pages shared, until block-refs' (or the cap)
    target=${mig_target:-950}
    n=0
    while :; do
        sleep 1
        n=$((n + 1))
        kill -0 "$mig_dst_pid" 2>/dev/null || break
        kill -0 "$mig_sampler_pid" 2>/dev/null || break
        share=$(mig_share $W/mig-dst.samples)
        [ -n "$share" ] || share=-1
        if [ "$m" = block-refs ]; then
            # a few samples after the first
            [ "$(mig_samples $W/mig-dst.samples | wc -l)" -ge 6 ] && break
        else
            [ "$share" -ge "$target" ] && break
        fi
        [ $(($(ms) - t1)) -ge $((MIG_KSM_CAP * 1000)) ] && break
    done
    mig_stop_sampler
    if [ "$m" = block-refs ]; then
        mig_target=$(mig_samples $W/mig-dst.samples | head -n 1 |
            awk '{ print ($10 > 0) ? int($11 * 1000 / $10) : "" }')
    fi
    echo "E2E-M $m census_end_ms=$(ms) ksm_target_permille=$target ksm_cap_s=$MIG_KSM_CAP"
    mig_emit_samples "$m" dst
    mig_stop_dst
    r=$(mig_q $ssock '{"execute": "cont"}')
    case $r in *'"return"'*) ;; *) ev mig-cont-failed "$m: $r" ;; esac
    ev mig-end "$m"
}

migrate_phase() {
    ev mig-phase "methods=$MIG_METHODS bandwidth=$MIG_BW ksm_cap_s=$MIG_KSM_CAP"
    # the configuration's sampler and marks are done: they would take CPU
    # from the migrations and the census
    [ "$marks_pid" != 0 ] && kill "$marks_pid" 2>/dev/null && wait "$marks_pid" 2>/dev/null
    [ "$sampler_pid" != 0 ] && kill "$sampler_pid" 2>/dev/null && wait "$sampler_pid" 2>/dev/null
    marks_pid=0 sampler_pid=0 mig_sampler_pid=0 mig_dst_pid=0
    for m in $MIG_METHODS; do
        mig_one "$m" || true
    done
    ev mig-phase-end
}

# A configuration, run again from the start once if a guest did not boot
# (the summary takes the samples from its last "begin" on).
run_once_more() { # run_config's arguments
    run_config "$@" && return 0
    ev retry "a guest did not boot (its log is above); the configuration runs again" \
        "from the start"
    run_config "$@" && return 0
    fail "configuration $1: a guest did not boot, twice (its serial log is above)"
}

mkdir -p $W
redis_start
ev ksm-saved "$saved_ksm"
ev khugepaged-max-ptes-shared "0 (was ${saved_khp:-not settable})"
# NAME-rN (N a number) runs configuration NAME again, under a name of its
# own in the results: runs that alternate (--corunner).
for c in $CONFIGS; do
    case ${c%-r[0-9]*} in
    none) run_once_more "$c" 0 off 0 ;;
    ksm) run_once_more "$c" 0 default 0 ;;
    ksm-advisor) run_once_more "$c" 0 advisor 0 ;;
    pageshare) run_once_more "$c" 1 default 0 ;;
    pageshare-faults) run_once_more "$c" 1 default 0 ;;
    ksm-fpr) run_once_more "$c" 0 default 1 ;;
    ksm-pts[0-9]*) run_once_more "$c" 0 default 0 ;;
    pageshare-pts[0-9]*) run_once_more "$c" 1 default 0 ;;
    *) fail "unknown configuration $c" ;;
    esac
done
cfg=all
restore_ksm
restore_khp
swap_off
redis_stop
ev ksm-restored "$(cat $K/run)"
ev finished
