"""The disk layouts the golden images copy, in numbers.

Units, and the sectors and sizes where Debian's cloud images and installers
put each partition, for every layout a variant can name ("whole-disk" needs
none).  disk_geometry.py turns them into a variant's Geometry.
"""

SECTOR = 512
FS_BLOCK = 4096
GIB = 1024**3

# Debian's cloud images put the root filesystem at this sector, after a BIOS
# boot partition (14) and an ESP (15); copying the layout keeps block offsets
# comparable with images operators really use.
GPT_ROOT_START_SECTOR = 262144
GPT_ROOT_PARTITION = 1
GPT_BIOS_BOOT = (14, 2048, 8191)
GPT_ESP = (15, 8192, GPT_ROOT_START_SECTOR - 1)
# The "gpt-bootsplit" layout puts a separate /boot (partition 2, 128 MiB,
# room for two kernels and initrds) where the root starts in "gpt", and the
# root right after it, as Debian's installer and the RHEL family lay out a
# separate /boot.
BOOT_PARTITION = 2
BOOT_SECTORS = 128 * 1024 * 1024 // 512
BOOT_LABEL = "boot"
# The "gpt-lvm" layout: the root partition is an LVM physical volume holding
# volume group vg0 with one linear logical volume "root" (what Debian's
# installer makes with "guided - use entire disk and set up LVM", minus swap).
LVM_VG, LVM_LV = "vg0", "root"
LVM_ROOT_BYTES = 1536 * 1024 * 1024
# The "mbr" layout, as Debian's installer partitions a BIOS machine's disk
# ("guided - use entire disk", fdisk -l of a fresh install): an MBR (msdos)
# label, the root in primary partition 1 (bootable) from sector 2048 to a
# MiB boundary, then a gap, extended partition 2 starting two sectors before
# its one logical partition 5 (its EBR is the extended partition's first
# sector), which holds swap up to the end of the disk.
MBR_ROOT_START_SECTOR = 2048
MBR_ROOT_PARTITION = 1
MBR_EXTENDED_PARTITION = 2
MBR_SWAP_PARTITION = 5
MBR_SWAP_SECTORS = 128 * 1024 * 1024 // 512
# The "gpt-efi" layout: a UEFI machine's disk as Debian's installer lays it
# out with a separate /boot and /var ("guided - use entire disk", then /boot
# and /var as partitions of their own): the EFI system partition (FAT32,
# mounted at /boot/efi), /boot, the root, /var, in that order from sector
# 2048, each on a MiB boundary; the root takes what the others leave.  The
# variant's "filesystems" gives them in disk order, the root as "/".
EFI_FIRST_SECTOR = 2048
MIB_SECTORS = 1024 * 1024 // 512
GPT_TYPE = {"vfat": "ef00", "ext2": "8300", "ext3": "8300", "ext4": "8300"}
# The backup GPT at the end of the disk: 32 sectors of entries plus the header.
GPT_BACKUP_SECTORS = 33
