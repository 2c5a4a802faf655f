"""Errors that reach the operator.

All of them derive from PageshareError (below).  Every failure the operator
can act on is a UserError: one line saying what is
wrong and one saying what to do.  The CLI prints both and exits non-zero; it
never prints a traceback for these.  `kind` names the class of problem for
scripts (`analyze-image --json` prints it in its error object): "user-error"
unless a more precise kind applies, e.g. "image-damaged".  print_error is
the one way the commands write an error and its hint on stderr, and
print_json_error the one way --json writes it on stdout.
"""

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any, NoReturn


class PageshareError(Exception):
    """The base of every error pageshare raises on purpose.

    Each says what is wrong and, where it can, what to do (``hint``); ``kind``
    names the class of problem for --json output.  Subclasses that reject
    input or report a failed tool also derive from ValueError or
    RuntimeError, so callers that catch those built-ins keep working:

    - UserError (and DistributeError): the operator can fix it; the CLIs print
      it with its hint and exit non-zero;
    - UsageError: a command line that does not parse;
    - AttachError: `pageshare attach/detach`, with a stable kind;
    - QMPError, LibvirtUnavailable: QEMU or libvirt refused or is unreachable;
    - ListFormatError, LvmError, BtrfsUnsupported, ClassificationError: input
      (a list, LVM metadata, a btrfs, crash's output) that is not used.
    """

    kind = "error"
    hint = ""


class UserError(PageshareError):
    """A problem with the input or the host that the operator can fix."""

    def __init__(
        self, message: str, hint: str = "", exit_code: int = 2, kind: str = "user-error"
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


def print_error(message: str, hint: str = "", prog: str = "") -> None:
    """An error and its hint on stderr: "error: ..." and "  hint: ...", or,
    for a command that names itself (prog), "prog: error: ..." and
    "prog: hint: ...", so each line can be told apart in a mixed log."""
    lead = f"{prog}: " if prog else ""
    print(f"{lead}error: {message}", file=sys.stderr)
    if hint:
        print(f"{lead}hint: {hint}" if prog else f"  hint: {hint}", file=sys.stderr)


def print_json_error(
    kind: str, message: str, hint: str = "", exit_code: int = 2, indent: int = 1, **context: Any
) -> None:
    """A failure as the one JSON object a command's --json prints on stdout:
    {"ok": false, "exit_code", what CONTEXT names, "error": {kind, message, hint}}."""
    error = {"kind": kind, "message": message, "hint": hint}
    out = {"ok": False, "exit_code": exit_code, **context, "error": error}
    print(json.dumps(out, indent=indent), flush=True)


def parse_args_or_exit_code(
    parser: argparse.ArgumentParser, argv: list[str], print_json_usage: Callable[[], None]
) -> argparse.Namespace | int:
    """PARSER's arguments, or the code argparse exits with: 0 after --help, 2
    after a usage error on stderr, then also print_json_usage's object on
    stdout if the command line asks for --json."""
    try:
        return parser.parse_args(argv)
    except SystemExit as e:
        if "--json" in argv and e.code not in (0, None):
            print_json_usage()
        return int(e.code or 0)


class UsageError(PageshareError):
    """A command line that does not parse (raised by RaisingArgumentParser)."""


class RaisingArgumentParser(argparse.ArgumentParser):
    """argparse would print its own message and sys.exit(2); a command that
    reports every error the same way (print_error) and returns its code
    catches UsageError instead.  Subparsers are made of the same class."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
