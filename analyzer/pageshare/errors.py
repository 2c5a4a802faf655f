"""Errors that reach the operator.

Every failure the operator can act on is a UserError: one line saying what is
wrong and one saying what to do.  The CLI prints both and exits non-zero; it
never prints a traceback for these.  `kind` names the class of problem for
scripts (`analyze-image --json` prints it in its error object): "user-error"
unless a more precise kind applies, e.g. "image-damaged".
"""


class UserError(Exception):
    """A problem with the input or the host that the operator can fix."""

    def __init__(self, message: str, hint: str = "", exit_code: int = 2,
                 kind: str = "user-error") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code
        self.kind = kind

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message
