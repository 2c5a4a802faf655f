"""pagescan output parsing."""

import pytest
from pageshare.analysis.classify import COLUMNS, ClassificationError, parse

HEADER = "#pagescan v1\t" + "\t".join(COLUMNS) + "\n"
FILE_LINE = (
    "4660\tfile\t2000000000002c\t17\tffff888003b1c2a8\t131\t800001\text4\t"
    "059a5ac684ce4b8f88bf106cefac840b\t800001\tvda\t2048\t65536\t12\tU---P\n"
)


def test_file_record_fields() -> None:
    recs = parse(HEADER + FILE_LINE)
    r = recs[4660]
    assert r.kind == "file" and r.page_cache
    assert r.index == 17 and r.ino == 131 and r.inode == 0xFFFF888003B1C2A8
    assert r.fstype == "ext4" and r.disk == "vda" and r.start_sect == 2048
    assert r.i_size == 65536 and r.blkbits == 12 and r.s_dev == 0x800001
    assert r.clean


@pytest.mark.parametrize(
    "state,clean",
    [("U---P", True), ("UD---", False), ("U-W--", False), ("U--L-", False), ("-----", False)],
)
def test_clean_needs_uptodate_and_quiet(state: str, clean: bool) -> None:
    line = FILE_LINE.replace("U---P", state)
    assert parse(HEADER + line)[4660].clean is clean


def test_short_records() -> None:
    recs = parse(HEADER + "1\tnopage\n2\tslab\t200\n3\tanon\t8000000000000\n")
    assert recs[1].kind == "nopage" and not recs[1].page_cache
    assert recs[2].flags == 0x200
    assert recs[3].kind == "anon"


def test_dash_fields_are_empty() -> None:
    line = FILE_LINE.replace("\text4\t", "\t-\t").replace("\tvda\t", "\t-\t")
    r = parse(HEADER + line)[4660]
    assert r.fstype == "" and r.disk == ""


@pytest.mark.parametrize(
    "text,msg",
    [
        ("", "header"),
        ("4660\tfile\n", "header"),
        (HEADER.replace("state", "nope"), "columns"),
        (HEADER + "12\tfile\t0\t1\n", "fields"),
        (HEADER + "x\tanon\n", "line 2"),
        (HEADER + "5\tweird\n", "unknown kind"),
        (HEADER + FILE_LINE.replace("\t17\t", "\tseventeen\t"), "line 2"),
    ],
)
def test_bad_input_is_rejected(text: str, msg: str) -> None:
    with pytest.raises(ClassificationError, match=msg):
        parse(text)
