"""notebooks/refinements.ipynb on a results database that `pageshare list
refine` wrote: three real refinements of the small golden image (its
inspection is cached, nothing boots), the fleet's summaries in a real
redis-server as page servers write them.

Generation 1 is a list as analyze-image writes one, with one block whose
hash is not the image's.  Round 1 refines it from the file and publishes
generation 2 (two blocks added, the wrong one dropped although guests read
it); a second refinement of generation 1 with other thresholds writes
another generation 2 that is never published.  Round 2 refines the
published generation 2 from Redis with a fourth host and more reads, and
drops the listed blocks nobody read.  The notebook, executed headless the
way `pageshare report --refinements` runs it, must follow generations 1, 2
and 3 (not the unpublished branch) and show for each the numbers the
database holds, which are also computed here from the summaries and the
lists themselves: blocks listed, added and dropped, and coverage, the
generation's share of the guests' reads.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("pandas")
pytest.importorskip("matplotlib")

import nbformat
from notebook_helpers import cell_errors, png_size, read_nb, shown_images, stream_text
from page_server_helpers import redis_server
from pageshare.analysis import notebook
from pageshare.cli import main
from pageshare.image.ext4map import file_sectors
from pageshare.lists import sectorlist
from pageshare.lists.feedback import FLAG_LISTED as L
from refine_helpers import Image, check_against_image, parent_list, publish_summaries, raw_image

PAGE = 4096
MIB = 2**20
FIGURES = ["refine_blocks", "refine_coverage"]
COLUMNS = [
    "generation",
    "made_by",
    "blocks",
    "MiB",
    "added",
    "dropped",
    "unread",
    "made_on_%",
    "covered_%",
    "measured_by",
    "hosts",
    "reads",
]

Records = dict[str, dict[int, tuple[int, int, int]]]  # host -> block -> guests, reads, flags


@dataclass
class Fleet:
    db: Path
    image: Image
    lists: dict[str, Path]  # gen1, gen2, alt (the unpublished generation 2), gen3
    rounds: dict[int, Records]  # refinement id -> the summaries it read
    lineage: list[int]  # the refinements that made generations 2 and 3
    off_lineage: int


@pytest.fixture(scope="module")
def fleet(small_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("refinements")
    img = raw_image(small_image, tmp / "small.raw")
    libc = file_sectors(img.raw, 0, "/usr/lib/x86_64-linux-gnu/libc.so.6", 0, 4096)
    dash = file_sectors(img.raw, 0, "/usr/bin/dash", 0, 4096)
    b = {
        name: s // 8
        for name, s in [
            *((f"libc{i}", libc[i]) for i in (0, 1, 2, 8, 20, 21, 22, 30)),
            ("dash0", dash[0]),
        ]
    }
    superblock, outside = 0, img.vsize // PAGE + 5
    lists = {g: tmp / f"{g}.pcsl" for g in ("gen1", "gen2", "alt", "gen3")}
    # Generation 1: libc's first 8 blocks and its 9th with a hash of other bytes.
    parent_list(img, libc[:8], lists["gen1"], wrong=(libc[8],))

    round1: Records = {
        "h1": {
            b["libc0"]: (2, 2, L),
            b["libc1"]: (1, 1, L),
            b["libc8"]: (1, 1, L),
            b["libc20"]: (2, 7, 0),
            b["libc21"]: (1, 1, 0),
            b["dash0"]: (3, 3, 0),
            b["libc22"]: (1, 1, 0),
            superblock: (2, 2, 0),
            outside: (1, 1, 0),
        },
        "h2": {
            b["libc0"]: (1, 1, L),
            b["libc8"]: (2, 2, L),
            b["libc20"]: (1, 1, 0),
            b["libc21"]: (1, 2, 0),
            b["libc22"]: (1, 1, 0),
            superblock: (2, 2, 0),
        },
        "h3": {b["libc1"]: (1, 1, L), b["libc21"]: (1, 1, 0)},
    }
    # Cumulative: the hosts' next summaries hold round 1's reads and more, and h4 joins.
    round2: Records = {
        "h1": {
            **round1["h1"],
            b["libc0"]: (2, 3, L),
            b["libc20"]: (3, 9, L),
            b["dash0"]: (3, 4, 0),
            b["libc2"]: (1, 1, L),
        },
        "h2": {
            **round1["h2"],
            b["libc21"]: (2, 3, L),
            b["libc30"]: (1, 1, 0),
            b["dash0"]: (1, 1, 0),
        },
        "h3": {**round1["h3"], b["libc30"]: (1, 1, 0)},
        "h4": {b["libc20"]: (2, 2, L), b["dash0"]: (1, 1, 0), b["libc30"]: (2, 2, 0)},
    }
    db = tmp / "results.sqlite"

    def refine(*args: str) -> dict[str, Any]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(
                [
                    "list",
                    "refine",
                    str(img.path),
                    "--db",
                    str(db),
                    "--redis",
                    rd.url,
                    "--json",
                    *args,
                ]
            )
        assert rc == 0, out.getvalue()
        res: dict[str, Any] = json.loads(out.getvalue())
        return res

    now = time.time()
    with redis_server(tmp) as rd:
        publish_summaries(rd.url, img.key, round1, now - 30 * 86400, now)
        r1 = refine(
            "--list",
            str(lists["gen1"]),
            "--min-guests",
            "3",
            "--min-hosts",
            "2",
            "-o",
            str(lists["gen2"]),
            "--publish",
        )
        alt = refine(
            "--list",
            str(lists["gen1"]),
            "--min-guests",
            "1",
            "--min-hosts",
            "1",
            "-o",
            str(lists["alt"]),
        )
        publish_summaries(rd.url, img.key, round2, now - 30 * 86400, now)
        r2 = refine(
            "--min-guests",
            "3",
            "--min-hosts",
            "2",
            "--drop-unread",
            "--window",
            "7d",
            "-o",
            str(lists["gen3"]),
        )
    # What the refinements did, checked against the image on its own (refine_helpers).
    assert (r1["generation"], r1["added"], r1["dropped_reasons"]) == (2, 2, {"bytes-differ": 1})
    check_against_image(img, lists["gen2"], {*libc[:8], libc[20], libc[21]})
    assert (alt["generation"], alt["added"]) == (2, 4)
    assert r2["parent"]["path"].startswith("redis:") and r2["parent"]["generation"] == 2
    assert (r2["generation"], r2["added"], r2["dropped_reasons"]) == (3, 3, {"unread": 5})
    check_against_image(
        img, lists["gen3"], {*libc[:3], libc[8], libc[20], libc[21], libc[30], dash[0]}
    )
    ids = [r1["refinement_id"], alt["refinement_id"], r2["refinement_id"]]
    yield Fleet(
        db, img, lists, {ids[0]: round1, ids[1]: round1, ids[2]: round2}, [ids[0], ids[2]], ids[1]
    )
    img.raw.unlink()


# --------------------------------------------------------------------------- expectations


def _blocks(path: Path) -> set[int]:
    return {s // 8 for s in sectorlist.read(path).blocks}


def _coverage(records: Records, listed: set[int]) -> tuple[int, float]:
    """(guest reads, % of them on listed blocks), from the summaries themselves."""
    total = sum(g for recs in records.values() for g, _, _ in recs.values())
    covered = sum(
        g for recs in records.values() for blk, (g, _, _) in recs.items() if blk in listed
    )
    return total, 100 * covered / total


def _from_inputs(f: Fleet) -> list[list[float | None]]:
    """The generation table, from the lists and summaries alone."""
    gens = [_blocks(f.lists[g]) for g in ("gen1", "gen2", "gen3")]
    r1, r2 = (f.rounds[i] for i in f.lineage)
    reads1, covered1 = _coverage(r1, gens[0])
    reads2, covered2 = _coverage(r2, gens[1])
    made2, made3 = _coverage(r1, gens[1])[1], _coverage(r2, gens[2])[1]
    unread = len(gens[1] - gens[2])  # round 2 dropped only unread blocks
    return [
        [
            1,
            None,
            len(gens[0]),
            len(gens[0]) * PAGE / MIB,
            None,
            None,
            None,
            None,
            covered1,
            f.lineage[0],
            len(r1),
            reads1,
        ],
        [
            2,
            f.lineage[0],
            len(gens[1]),
            len(gens[1]) * PAGE / MIB,
            len(gens[1] - gens[0]),
            len(gens[0] - gens[1]),
            0,
            made2,
            covered2,
            f.lineage[1],
            len(r2),
            reads2,
        ],
        [
            3,
            f.lineage[1],
            len(gens[2]),
            len(gens[2]) * PAGE / MIB,
            len(gens[2] - gens[1]),
            len(gens[1] - gens[2]),
            unread,
            made3,
            None,
            None,
            None,
            None,
        ],
    ]


def _from_db(db: Path, lineage: list[int]) -> list[list[float | None]]:
    """The generation table, from the refinement and refined_block rows."""
    con = sqlite3.connect(db)
    rows = {}
    for rid in lineage:
        (pgen, gen, pblocks, blocks, added, dropped, listed, unlisted, hosts) = con.execute(
            "SELECT parent_generation, generation, parent_blocks, listed_blocks, added, "
            "dropped, guest_reads_listed, guest_reads_unlisted, hosts_used FROM refinement "
            "WHERE id = ? AND status = 'ok'",
            (rid,),
        ).fetchone()
        moved = dict(
            con.execute(
                "SELECT action, SUM(guests) FROM refined_block WHERE refinement_id = ? "
                "GROUP BY action",
                (rid,),
            ).fetchall()
        )
        (unread,) = con.execute(
            "SELECT COUNT(*) FROM refined_block WHERE refinement_id = ? AND reason = 'unread'",
            (rid,),
        ).fetchone()
        reads = listed + unlisted
        after = listed - (moved.get("dropped") or 0) + (moved.get("added") or 0)
        rows[rid] = (
            pgen,
            gen,
            pblocks,
            blocks,
            added,
            dropped,
            unread,
            reads,
            100 * listed / reads,
            100 * after / reads,
            hosts,
        )
    con.close()
    first, second = (rows[i] for i in lineage)
    return [
        [
            first[0],
            None,
            first[2],
            first[2] * PAGE / MIB,
            None,
            None,
            None,
            None,
            first[8],
            lineage[0],
            first[10],
            first[7],
        ],
        [
            first[1],
            lineage[0],
            first[3],
            first[3] * PAGE / MIB,
            first[4],
            first[5],
            first[6],
            first[9],
            second[8],
            lineage[1],
            second[10],
            second[7],
        ],
        [
            second[1],
            lineage[1],
            second[3],
            second[3] * PAGE / MIB,
            second[4],
            second[5],
            second[6],
            second[9],
            None,
            None,
            None,
            None,
        ],
    ]


# --------------------------------------------------------------------------- the notebook


def _generations(text: str) -> list[list[float | None]]:
    """The printed generation table: a number per column, None for '-'."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    assert lines[0] == COLUMNS, text
    rows = []
    for cells in lines[1:]:
        if cells[0] == "generation":  # the list paths below the table
            break
        assert len(cells) == len(COLUMNS), cells
        rows.append([None if c == "-" else float(c) for c in cells])
    return rows


def _assert_table(got: list[list[float | None]], want: list[list[float | None]]) -> None:
    assert len(got) == len(want)
    for g_row, w_row in zip(got, want, strict=True):
        for col, g, w in zip(COLUMNS, g_row, w_row, strict=True):
            if w is None:
                assert g is None, (col, g_row, w_row)
            else:
                # printed with 2 (%) and 3 (MiB) decimals
                assert g == pytest.approx(w, abs=0.006), (col, g_row, w_row)


@pytest.fixture(scope="module")
def executed(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    out = tmp_path_factory.mktemp("nb")
    path = notebook.run_refinements_notebook(
        fleet.db, out / "executed.ipynb", out / "figures", timeout=120
    )
    return read_nb(path), out / "figures"


def test_notebook_plots_blocks_and_coverage_per_generation(
    fleet: Fleet, executed: tuple[Any, Path]
) -> None:
    nb, figures = executed
    assert cell_errors(nb) == []
    setup = stream_text(nb, "setup")
    assert f"refinement #{fleet.lineage[-1]}" in setup and str(fleet.image.path) in setup

    got = _generations(stream_text(nb, "generations"))
    want = _from_db(fleet.db, fleet.lineage)
    _assert_table(got, want)
    _assert_table(got, _from_inputs(fleet))
    # The numbers by hand: 8 of 24 guest reads on generation 1 (libc0 3, libc1 2, the
    # wrong block 3); generation 2 on those reads: 8 - 3 + 6 = 11; in round 2, 16 of 35;
    # generation 3 on those: 16 + 12.
    assert [r[7] for r in got] == [
        None,
        pytest.approx(100 * 11 / 24, abs=0.006),
        pytest.approx(80.0),
    ]
    assert [r[8] for r in got] == [
        pytest.approx(100 * 8 / 24, abs=0.006),
        pytest.approx(100 * 16 / 35, abs=0.006),
        None,
    ]
    paths = stream_text(nb, "generations")
    for g, name in ((1, "gen1"), (2, "gen2"), (3, "gen3")):
        assert f"generation {g}: {fleet.lists[name].resolve()}" in paths

    # Every refinement is listed, the unpublished branch not followed.
    lines = {line.split()[0]: line for line in stream_text(nb, "refinements").splitlines()[2:]}
    assert set(lines) == {str(i) for i in (*fleet.lineage, fleet.off_lineage)}
    assert all(lines[str(i)].rstrip().endswith("*") for i in fleet.lineage)
    assert not lines[str(fleet.off_lineage)].rstrip().endswith("*")
    assert " 1>2 " in lines[str(fleet.off_lineage)]
    rejected = stream_text(nb, "rejected")
    assert "below-min-hosts" in rejected and "outside-image" in rejected

    assert sorted(p.name for p in figures.iterdir()) == sorted(f"{f}.png" for f in FIGURES)
    for name in FIGURES:
        data = (figures / f"{name}.png").read_bytes()
        width, height = png_size(data, name)
        assert width >= 400 and height >= 200, (name, width, height)
    assert len(shown_images(nb)) == len(FIGURES)


def test_report_refinements_follows_the_refinement_named(
    fleet: Fleet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pageshare report --refinements --refinement ID --image PATH`: the
    unpublished branch alone, generation 1 and its generation 2."""
    out = tmp_path / "alt.ipynb"
    assert (
        notebook.main(
            [
                "--refinements",
                "--db",
                str(fleet.db),
                "--refinement",
                str(fleet.off_lineage),
                "--image",
                str(fleet.image.path),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip() == str(out.resolve())
    nb = read_nb(out)
    got = _generations(stream_text(nb, "generations"))
    gen1, alt = _blocks(fleet.lists["gen1"]), _blocks(fleet.lists["alt"])
    reads, covered = _coverage(fleet.rounds[fleet.off_lineage], gen1)
    _assert_table(
        got,
        [
            [
                1,
                None,
                len(gen1),
                len(gen1) * PAGE / MIB,
                None,
                None,
                None,
                None,
                covered,
                fleet.off_lineage,
                3,
                reads,
            ],
            [
                2,
                fleet.off_lineage,
                len(alt),
                len(alt) * PAGE / MIB,
                len(alt - gen1),
                len(gen1 - alt),
                0,
                _coverage(fleet.rounds[fleet.off_lineage], alt)[1],
                None,
                None,
                None,
                None,
            ],
        ],
    )
    assert list(tmp_path.iterdir()) == [out]  # no figures asked, none saved
    assert nb.metadata["pageshare"]["refinement_id"] == fleet.off_lineage

    # What it refuses, and says so.
    with pytest.raises(SystemExit):
        notebook.main(["--refinements", "--analysis", "1", "--db", str(fleet.db)])
    assert "give one" in capsys.readouterr().err
    assert (
        notebook.main(
            [
                "--refinements",
                "--db",
                str(fleet.db),
                "--refinement",
                "99",
                "--out",
                str(tmp_path / "bad.ipynb"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "cell 1 (setup) failed: LookupError" in err and "no refinement with id 99" in err
    assert (
        notebook.main(
            [
                "--refinements",
                "--db",
                str(fleet.db),
                "--image",
                "deadbeef00",
                "--out",
                str(tmp_path / "bad.ipynb"),
            ]
        )
        == 1
    )
    assert "no image 'deadbeef00' (images: #1 " in capsys.readouterr().err


def test_rows_without_a_dropped_blocks_reads(fleet: Fleet, tmp_path: Path) -> None:
    """Rows written before refine recorded a dropped block's reads: a block
    dropped because its bytes differ may have been read, so the share of the
    reads its generation lists is unknown ('-'); one dropped as unread was
    read by nobody, so that share still follows."""
    db = tmp_path / "old.sqlite"
    shutil.copy(fleet.db, db)
    con = sqlite3.connect(db)
    con.execute(
        "UPDATE refined_block SET guests = NULL, hosts = NULL, reads = NULL "
        "WHERE action = 'dropped'"
    )
    con.commit()
    con.close()
    out = notebook.run_refinements_notebook(db, tmp_path / "old.ipynb", None, timeout=120)
    got = _generations(stream_text(read_nb(out), "generations"))
    want = _from_db(fleet.db, fleet.lineage)
    want[1][7] = None
    _assert_table(got, want)
    assert got[2][7] == pytest.approx(80.0)


def test_refine_records_what_the_fleet_read_of_a_dropped_block(fleet: Fleet) -> None:
    """The block dropped because its bytes differ: 1 + 2 guests on two hosts
    read it; the unread ones: none."""
    con = sqlite3.connect(fleet.db)
    rows = con.execute(
        "SELECT refinement_id, reason, guests, hosts, reads FROM refined_block "
        "WHERE action = 'dropped' ORDER BY refinement_id, sector"
    ).fetchall()
    first, second = fleet.lineage
    assert [r for r in rows if r[0] == first] == [(first, "bytes-differ", 3, 2, 3)]
    assert [r[1:] for r in rows if r[0] == second] == [("unread", 0, 0, 0)] * 5


def test_committed_notebook_has_no_outputs() -> None:
    nb = read_nb(notebook.REFINEMENTS_NOTEBOOK)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.get("id")
