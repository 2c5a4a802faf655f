"""Reading a golden image offline: its disk, partitions and LVM volumes, file systems, boot files.

diskimage reads the virtual disk (raw, qcow2) and hashes its content;
image_inspect says what is in the image (libguestfs), fslayout which of its
file systems can be mapped to disk sectors (with lvm for linear logical
volumes) and bootfiles which kernel and initrd it boots; ext4map, xfsmap and
btrfsmap read each file system's block map.  Nothing here boots a guest.
"""
