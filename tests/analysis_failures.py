"""What a failed analysis must look like: exit status, one clear message with a
hint, no traceback, nothing left in the work directory; with --json, exactly
one JSON object that says what failed.  For the tests of input the analysis
refuses: test_bad_input.py, test_unaligned_partition.py,
test_encrypted_image.py, test_md_raid.py and test_btrfsmap.py.
"""

from typing import Any

from conftest import Analysis


def assert_clean_failure(r: Analysis, message: str, rc: int = 2) -> None:
    assert r.rc == rc, r.stderr
    assert message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert "hint:" in r.stderr
    assert list(r.workdir.iterdir()) == []


def json_error(r: Analysis, kind: str, message: str, rc: int = 2) -> dict[str, Any]:
    """--json: exactly one JSON object on stdout that says what failed; same exit status."""
    assert r.rc == rc, r.stderr
    data = r.json()
    assert data["ok"] is False and data["exit_code"] == rc, data
    error = data["error"]
    assert isinstance(error, dict)
    assert error["kind"] == kind and message in error["message"], data
    assert error["hint"], data
    assert list(r.workdir.iterdir()) == []
    return error
