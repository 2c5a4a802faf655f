"""Errors that reach the operator.

All of them derive from PageshareError (below).  Every failure the operator
can act on is a UserError: one line saying what is
wrong and one saying what to do.  The CLI prints both and exits non-zero; it
never prints a traceback for these.  `kind` names the class of problem for
scripts (`analyze-image --json` prints it in its error object): "user-error"
unless a more precise kind applies, e.g. "image-damaged".  print_error is
the one way the commands write an error and its hint on stderr.
"""

import argparse
import sys
from typing import NoReturn


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


class UsageError(PageshareError):
    """A command line that does not parse (raised by RaisingArgumentParser)."""


class RaisingArgumentParser(argparse.ArgumentParser):
    """argparse would print its own message and sys.exit(2); a command that
    reports every error the same way (print_error) and returns its code
    catches UsageError instead.  Subparsers are made of the same class."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)
