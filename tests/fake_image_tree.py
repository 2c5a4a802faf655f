"""FakeImage: an image's file tree as a dict of files and symlinks, answering
the few libguestfs calls pageshare.image.bootfiles makes (is_file, readlink, ls,
cat, ...), so that which kernel and initrd a boot loader picks is checked
without an image or an appliance.  Used by test_boot_layouts.py and
test_btrfsmap.py.  (test_lvm.py has a FakeImage of its own, over disk bytes.)
"""


class FakeImage:
    """The few libguestfs calls bootfiles makes, on a dict of files and symlinks
    (the image's tree with every fstab file system mounted)."""

    def __init__(self, files: dict[str, str], links: dict[str, str] | None = None) -> None:
        self.files, self.links = files, links or {}

    def _target(self, path: str) -> str:
        link = self.links.get(path)
        if link is None:
            return path
        return link if link.startswith("/") else path.rsplit("/", 1)[0] + "/" + link

    def is_file(self, path: str, followsymlinks: bool = False) -> bool:
        return (self._target(path) if followsymlinks else path) in self.files

    def is_symlink(self, path: str) -> bool:
        return path in self.links

    def readlink(self, path: str) -> str:
        return self.links[path]

    def is_dir(self, path: str) -> bool:
        return any(p.startswith(path.rstrip("/") + "/") for p in [*self.files, *self.links])

    def ls(self, path: str) -> list[str]:
        pre = path.rstrip("/") + "/"
        return sorted(
            {p[len(pre) :].split("/")[0] for p in [*self.files, *self.links] if p.startswith(pre)}
        )

    def cat(self, path: str) -> str:
        return self.files[path]
