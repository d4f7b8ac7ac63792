"""Errors a user can cause: each is one line on stderr and a distinct exit code."""


class TrtglmError(Exception):
    """Base class; `exit_code` is what the CLI exits with."""

    exit_code = 1


class UsageError(TrtglmError):
    """Bad or contradictory command-line values (unsupported tp size, bad dtype, ...)."""

    exit_code = 2


class ModelFileError(TrtglmError):
    """Missing, corrupt or mis-shaped input files (HF folder, checkpoint, tokenizer)."""

    exit_code = 3


class OutputExistsError(TrtglmError):
    """The output already exists and --force was not given."""

    exit_code = 4


class VerificationError(TrtglmError):
    """A numerical check against the reference is outside its tolerance."""

    exit_code = 5


class DependencyError(TrtglmError):
    """A needed package or tool is not installed."""

    exit_code = 6
