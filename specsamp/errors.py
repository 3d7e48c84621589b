"""User-facing errors.

A `UserError` is a mistake the user can fix (a bad flag, a missing file, a mismatched model
pair). The command line prints its message as one line and exits with status 2; it never
shows a traceback for one. Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one clear line."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class RunFailed(Exception):
    """A run that could not finish for a reason outside the user's input (e.g. the cluster's
    scheduler was lost): one line, exit status 1; what was committed is kept."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
