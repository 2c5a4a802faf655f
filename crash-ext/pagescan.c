// SPDX-License-Identifier: GPL-2.0-only
/*
 * pagescan.c - crash extension that classifies guest page frames.
 *
 * pageshare needs to know, for every guest frame that host KSM merged across
 * two VMs, whether the frame holds page cache of a file on the base image
 * (and which file, at which index), block-device page cache, anonymous memory
 * or something else.  crash's own commands can tell this page by page, but
 * any gdb-evaluated expression costs ~200 ms, so a walk over 100k frames needs
 * compiled code: this extension reads struct page, address_space, inode,
 * super_block and block_device with offsets resolved once from the vmlinux
 * debug info, and caches per-inode facts.
 *
 * Usage inside crash:
 *	extend /path/to/pagescan.so
 *	pagescan [-i pfnfile] [-o outfile]
 *
 * Output: one tab-separated record per PFN, format documented in
 * crash-ext/README.md and parsed by pageshare/analysis/classify.py.  The first line is
 * a "#pagescan v1" header naming the columns.
 *
 * Works with crash 8.0.x on Linux 6.1 and with newer crash on 6.12 (where
 * PG_slab became a page type); every offset and flag number comes from the
 * kernel's own debug info, never from constants.
 */
#include "defs.h"

#define PAGESCAN_VERSION "1"

static void cmd_pagescan(void);
static char *help_pagescan[];

static struct command_table_entry command_table[] = {
	{ "pagescan", cmd_pagescan, help_pagescan, 0 },
	{ NULL },
};

/* Offsets into kernel structures; -1 when the member does not exist. */
static struct {
	long page_size;
	long page_flags, page_mapping, page_index, page_compound_head, page_type;
	long as_host;
	long inode_ino, inode_sb, inode_mapping, inode_size, inode_blkbits;
	long sb_dev, sb_bdev, sb_type, sb_uuid;
	long fstype_name;
	long bdev_dev, bdev_start_sect, bdev_disk, bdev_inode_vfs_inode;
	long disk_name;
	long pg_locked, pg_uptodate, pg_dirty, pg_writeback, pg_swapbacked;
	long pg_slab, pg_private, pg_reserved;
	long pgty_slab;		/* 6.12+: slab is a page type, not a flag */
	int ready;
} o;

static long member(char *s, char *m)
{
	long v = MEMBER_OFFSET(s, m);

	/* Members inside anonymous unions need the ANON_ lookup. */
	if (v < 0)
		v = ANON_MEMBER_OFFSET(s, m);
	return v;
}

static long enumval(char *name)
{
	long v;

	return enumerator_value(name, &v) ? v : -1;
}

static void __attribute__((constructor)) pagescan_init(void)
{
	register_extension(command_table);
}

static void resolve_offsets(void)
{
	o.page_size = STRUCT_SIZE("page");
	o.page_flags = member("page", "flags");
	o.page_mapping = member("page", "mapping");
	o.page_index = member("page", "index");
	o.page_compound_head = member("page", "compound_head");
	o.page_type = member("page", "page_type");
	o.as_host = member("address_space", "host");
	o.inode_ino = member("inode", "i_ino");
	o.inode_sb = member("inode", "i_sb");
	o.inode_mapping = member("inode", "i_mapping");
	o.inode_size = member("inode", "i_size");
	o.inode_blkbits = member("inode", "i_blkbits");
	o.sb_dev = member("super_block", "s_dev");
	o.sb_bdev = member("super_block", "s_bdev");
	o.sb_type = member("super_block", "s_type");
	o.sb_uuid = member("super_block", "s_uuid");
	o.fstype_name = member("file_system_type", "name");
	o.bdev_dev = member("block_device", "bd_dev");
	o.bdev_start_sect = member("block_device", "bd_start_sect");
	o.bdev_disk = member("block_device", "bd_disk");
	o.disk_name = member("gendisk", "disk_name");
	/* struct bdev_inode { struct block_device bdev; struct inode vfs_inode; } */
	o.bdev_inode_vfs_inode = member("bdev_inode", "vfs_inode");
	o.pg_locked = enumval("PG_locked");
	o.pg_uptodate = enumval("PG_uptodate");
	o.pg_dirty = enumval("PG_dirty");
	o.pg_writeback = enumval("PG_writeback");
	o.pg_swapbacked = enumval("PG_swapbacked");
	o.pg_slab = enumval("PG_slab");
	o.pg_private = enumval("PG_private");
	o.pg_reserved = enumval("PG_reserved");
	o.pgty_slab = enumval("PGTY_slab");

	if (o.page_size <= 0 || o.page_flags < 0 || o.page_mapping < 0 ||
	    o.page_index < 0 || o.page_compound_head < 0 || o.as_host < 0 ||
	    o.inode_ino < 0 || o.inode_sb < 0 || o.inode_mapping < 0)
		error(FATAL, "pagescan: struct page/inode layout not found in debug info\n");
	o.ready = 1;
}

#define FLAG(flags, bit) ((bit) >= 0 && (((flags) >> (bit)) & 1UL))

static int rd(ulong addr, void *buf, long len, char *what)
{
	return readmem(addr, KVADDR, buf, len, what, RETURN_ON_ERROR | QUIET);
}

/*
 * Per-inode facts, cached: a page cache of 100k pages usually belongs to a
 * few thousand inodes, and each lookup below costs several readmem calls.
 */
#define INODE_CACHE_SIZE 65536

struct inode_info {
	ulong inode;
	ulong ino, sdev, bddev, start_sect, isize;
	int blkbits;
	char fstype[16];
	char disk[32];
	char uuid[33];
};

static struct inode_info *icache;

static void read_bdev(ulong bdev, struct inode_info *e)
{
	uint dev = 0;
	ulong disk = 0;

	rd(bdev + o.bdev_dev, &dev, sizeof(dev), "bd_dev");
	e->bddev = dev;
	if (o.bdev_start_sect >= 0)
		rd(bdev + o.bdev_start_sect, &e->start_sect, sizeof(ulong), "bd_start_sect");
	if (o.bdev_disk >= 0 && o.disk_name >= 0 &&
	    rd(bdev + o.bdev_disk, &disk, sizeof(disk), "bd_disk") && disk)
		rd(disk + o.disk_name, e->disk, sizeof(e->disk) - 1, "disk_name");
}

static struct inode_info *inode_info(ulong inode)
{
	struct inode_info *e = &icache[(inode >> 6) % INODE_CACHE_SIZE];
	ulong sb = 0, fstype = 0, name = 0, bdev = 0;
	unsigned char uuid[16];
	uint sdev = 0;
	int i;

	if (e->inode == inode)
		return e;
	memset(e, 0, sizeof(*e));
	e->inode = inode;
	rd(inode + o.inode_ino, &e->ino, sizeof(ulong), "i_ino");
	rd(inode + o.inode_size, &e->isize, sizeof(ulong), "i_size");
	if (o.inode_blkbits >= 0) {
		unsigned char bits = 0;

		rd(inode + o.inode_blkbits, &bits, 1, "i_blkbits");
		e->blkbits = bits;
	}
	if (!rd(inode + o.inode_sb, &sb, sizeof(sb), "i_sb") || !sb)
		return e;
	rd(sb + o.sb_dev, &sdev, sizeof(sdev), "s_dev");
	e->sdev = sdev;
	if (rd(sb + o.sb_type, &fstype, sizeof(fstype), "s_type") && fstype &&
	    rd(fstype + o.fstype_name, &name, sizeof(name), "fs name") && name)
		read_string(name, e->fstype, sizeof(e->fstype) - 1);
	if (o.sb_uuid >= 0 && rd(sb + o.sb_uuid, uuid, sizeof(uuid), "s_uuid"))
		for (i = 0; i < 16; i++)
			sprintf(e->uuid + 2 * i, "%02x", uuid[i]);

	if (!strcmp(e->fstype, "bdev") && o.bdev_inode_vfs_inode >= 0)
		bdev = inode - o.bdev_inode_vfs_inode;	/* I_BDEV(inode) */
	else if (o.sb_bdev >= 0)
		rd(sb + o.sb_bdev, &bdev, sizeof(bdev), "s_bdev");
	if (bdev)
		read_bdev(bdev, e);
	return e;
}

static int is_slab(ulong flags, const char *pagebuf)
{
	uint type;

	if (FLAG(flags, o.pg_slab))
		return 1;
	if (o.pgty_slab < 0 || o.page_type < 0)
		return 0;
	/* 6.12: the top byte of page_type holds the PGTY_* value. */
	type = UINT(pagebuf + o.page_type);
	return (type >> 24) == (uint)o.pgty_slab;
}

static void classify(ulong pfn, FILE *out)
{
	char buf[256], head_buf[256];
	const char *kind;
	char *pg = buf;
	ulong page, head, chead, flags, mapping, index, host = 0, imap = 0;
	struct inode_info *e = NULL;

	if (!phys_to_page(PTOB(pfn), &page)) {
		fprintf(out, "%lu\tnopage\n", pfn);
		return;
	}
	if (o.page_size > (long)sizeof(buf) ||
	    !readmem(page, KVADDR, buf, o.page_size, "page", RETURN_ON_ERROR | QUIET)) {
		fprintf(out, "%lu\tunreadable\n", pfn);
		return;
	}
	head = page;
	chead = ULONG(buf + o.page_compound_head);
	if (chead & 1) {
		/* Tail page: flags, mapping and index live in the head page. */
		head = chead - 1;
		if (!readmem(head, KVADDR, head_buf, o.page_size, "head page",
			     RETURN_ON_ERROR | QUIET)) {
			fprintf(out, "%lu\tunreadable\n", pfn);
			return;
		}
		pg = head_buf;
	}
	flags = ULONG(pg + o.page_flags);
	mapping = ULONG(pg + o.page_mapping);
	index = ULONG(pg + o.page_index) + (page - head) / o.page_size;

	if (is_slab(flags, pg))
		kind = "slab";		/* slab_cache overlays ->mapping */
	else if (!mapping)
		kind = "nomapping";	/* free, kernel, page tables, ... */
	else if ((mapping & 3) == 3)
		kind = "ksm";		/* merged by the guest's own KSM */
	else if (mapping & 1)
		kind = "anon";
	else if (mapping & 2)
		kind = "movable";
	else if (!rd(mapping + o.as_host, &host, sizeof(host), "host") || !host ||
		 !rd(host + o.inode_mapping, &imap, sizeof(imap), "i_mapping") ||
		 imap != mapping)
		/* Not an inode's own page cache (stale or overlaid field). */
		kind = "badmapping";
	else {
		e = inode_info(host);
		if (FLAG(flags, o.pg_swapbacked))
			kind = "shmem";
		else if (!strcmp(e->fstype, "bdev"))
			kind = "bdev";
		else
			kind = "file";
	}
	if (!e) {
		fprintf(out, "%lu\t%s\t%lx\n", pfn, kind, flags);
		return;
	}
	fprintf(out, "%lu\t%s\t%lx\t%lu\t%lx\t%lu\t%lx\t%s\t%s\t%lx\t%s\t%lu\t%lu\t%d\t%c%c%c%c%c\n",
		pfn, kind, flags, index, e->inode, e->ino, e->sdev,
		e->fstype[0] ? e->fstype : "-", e->uuid[0] ? e->uuid : "-",
		e->bddev, e->disk[0] ? e->disk : "-", e->start_sect, e->isize,
		e->blkbits,
		FLAG(flags, o.pg_uptodate) ? 'U' : '-',
		FLAG(flags, o.pg_dirty) ? 'D' : '-',
		FLAG(flags, o.pg_writeback) ? 'W' : '-',
		FLAG(flags, o.pg_locked) ? 'L' : '-',
		FLAG(flags, o.pg_private) ? 'P' : '-');
}

static void cmd_pagescan(void)
{
	char *in = NULL, *outname = NULL, line[64];
	FILE *fin, *out = fp;
	ulong pfn, n = 0, s;
	int c, i;

	while ((c = getopt(argcnt, args, "i:o:")) != EOF) {
		switch (c) {
		case 'i':
			in = optarg;
			break;
		case 'o':
			outname = optarg;
			break;
		default:
			argerrs++;
			break;
		}
	}
	if (argerrs)
		cmd_usage(pc->curcmd, SYNOPSIS);
	if (!o.ready)
		resolve_offsets();
	if (!icache && !(icache = calloc(INODE_CACHE_SIZE, sizeof(*icache))))
		error(FATAL, "pagescan: out of memory\n");
	if (outname && !(out = fopen(outname, "w")))
		error(FATAL, "pagescan: cannot open %s: %s\n", outname, strerror(errno));

	fprintf(out, "#pagescan v" PAGESCAN_VERSION
		"\tpfn\tkind\tflags\tindex\tinode\tino\ts_dev\tfstype\tfs_uuid"
		"\tbd_dev\tdisk\tstart_sect\ti_size\tblkbits\tstate\n");
	if (in) {
		if (!(fin = fopen(in, "r")))
			error(FATAL, "pagescan: cannot open %s: %s\n", in, strerror(errno));
		while (fgets(line, sizeof(line), fin)) {
			if (line[0] == '\n' || line[0] == '#')
				continue;
			classify(strtoul(line, NULL, 0), out);
			n++;
		}
		fclose(fin);
	} else {
		/* vt->max_mapnr is 0 on SPARSEMEM kernels: walk the node spans. */
		for (i = 0; i < vt->numnodes; i++) {
			s = BTOP(vt->node_table[i].start_paddr);
			for (pfn = s; pfn < s + vt->node_table[i].size; pfn++, n++)
				classify(pfn, out);
		}
	}
	if (out != fp && fclose(out))
		error(FATAL, "pagescan: writing %s failed: %s\n", outname, strerror(errno));
	fprintf(fp, "pagescan: %lu pfns classified\n", n);
}

static char *help_pagescan[] = {
	"pagescan",
	"classify guest page frames for pageshare",
	"[-i pfnfile] [-o outfile]",
	"  Classifies each PFN listed in pfnfile (one per line, decimal or 0x hex;",
	"  all PFNs of all nodes when -i is omitted) as file, bdev, shmem, anon,",
	"  ksm, movable, slab, nomapping, badmapping, nopage or unreadable, and",
	"  writes one tab-separated record per PFN to outfile (default: stdout).",
	"  For page-cache frames the record carries the index, the inode, its",
	"  filesystem and block device (start sector, disk name) and the page",
	"  state (U uptodate, D dirty, W writeback, L locked, P private).",
	"  The columns are named on the first line (\"#pagescan v1 ...\").",
	NULL
};
