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


INT32_MAX = 2**31 - 1


def int32_range_error(name: str, value: int, low: int) -> UsageError:
    """`name` is an INT32 input outside low..INT32_MAX. Triton's HTTP frontend keeps only the low 32 bits of a
    larger JSON number, so a negative value may be what a number past INT32_MAX became: the message names it."""
    message = f"{name} must be between {low} and {INT32_MAX}, not {value}"
    if value < 0:
        message += (f" (over HTTP JSON Triton keeps only the low 32 bits of a larger number: {value + 2**32} "
                    f"arrives as {value})")
    return UsageError(message)
