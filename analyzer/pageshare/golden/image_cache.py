"""The cache of built images: where a variant's image lives, its manifest, publication.

An image is ``cache_dir("images")/<variant>-<key>/`` holding base.qcow2 and
manifest.json, and counts only while its manifest carries the variant's
current key.  A build publishes by renaming its finished directory into
place, so no reader sees half an image.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pageshare.cache import cache_dir

from .disk_geometry import Geometry
from .spec import BUILDER_VERSION, _Spec, image_key


@dataclass(frozen=True)
class GoldenImage:
    variant: str
    path: Path
    manifest: dict[str, Any]


def _image_dir(variant: str) -> Path:
    return cache_dir("images") / f"{variant}-{image_key(variant)}"


def cached_image(variant: str) -> GoldenImage | None:
    """The finished image for this variant's current key, or None."""
    d = _image_dir(variant)
    qcow, manifest_path = d / "base.qcow2", d / "manifest.json"
    if not (qcow.is_file() and manifest_path.is_file()):
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("key") != image_key(variant):
        return None
    return GoldenImage(variant, qcow, manifest)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _publish(out: Path, final: Path, work: Path, force: bool) -> Path:
    """Rename the finished directory into place; a rename is all-or-nothing."""
    if final.exists():
        if not force:
            return final  # another build finished first; its image is as good
        final.rename(work / "replaced")
    out.rename(final)
    return final


def _manifest(
    variant: str, spec: _Spec, geom: Geometry, kernel: str, qcow: Path, seconds: float
) -> dict[str, Any]:
    return {
        "variant": variant,
        "key": image_key(variant),
        "builder_version": BUILDER_VERSION,
        "suite": spec.suite,
        "sources": spec.sources,
        "mmdebstrap_variant": spec.mmdebstrap_variant,
        "packages": spec.packages,
        "kernel_version": kernel,
        "layout": geom.layout,
        "root_partition": geom.root_partition,
        "root_start_sector": geom.root_start_sector,
        "root_fs_bytes": geom.fs_bytes,
        "fs_uuid": spec.fs_uuid,
        "root_fstype": spec.root_fstype,
        "root_subvol": spec.root_subvol,
        "boot_partition": geom.boot_partition,
        "boot_start_sector": geom.boot_start_sector,
        "boot_fs_uuid": spec.boot_fs_uuid,
        **(
            {
                "filesystems": [
                    {
                        "mountpoint": p.mountpoint,
                        "partition": p.partition,
                        "start_sector": p.start_sector,
                        "end_sector": p.end_sector,
                    }
                    for p in geom.placed
                ]
            }
            if geom.placed
            else {}
        ),
        **(
            {
                "swap_partition": geom.swap_partition,
                "swap_start_sector": geom.swap_start_sector,
                "swap_uuid": spec.swap_uuid,
            }
            if spec.swap_uuid
            else {}
        ),
        "hostname": spec.hostname,
        "virtual_size": geom.virtual_size,
        "file_size": qcow.stat().st_size,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 1),
        "sha256": _sha256(qcow),
    }
