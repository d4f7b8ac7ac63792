"""Errors a user can cause: each is one line on stderr and a distinct exit code."""


class TrtglmError(Exception):
    """Base class; `exit_code` is what the CLI exits with."""

    exit_code = 1


class UsageError(TrtglmError):
    """Bad or contradictory command-line values (unsupported tp size, bad dtype, ...)."""

    exit_code = 2


class PromptTooLongError(UsageError):
    """A prompt longer than the engine's max_input_len."""


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


# How a full queue's refusal reads, wherever it comes from: trtglm's engine (QueueFullError) or Triton's own
# scheduler queue (max_queue_size). Inside a gRPC stream, and through an ensemble over HTTP, Triton passes on the
# words but not the UNAVAILABLE status, so clients of those paths tell a full queue by them.
BUSY_WORDS = ("the queue is full", "Exceeds maximum queue size")


def is_busy(message: str) -> bool:
    """Whether an error's message says that a queue was full (retry later), not that the request was wrong."""
    return any(words in message for words in BUSY_WORDS)


def int32_range_error(name: str, value: int, low: int) -> UsageError:
    """`name` is an INT32 input outside low..INT32_MAX. Triton's HTTP frontend keeps only the low 32 bits of a
    larger JSON number, so a negative value may be what a number past INT32_MAX became: the message names it."""
    return int_range_error(name, value, low, 32)


def int_range_error(name: str, value: int, low: int, bits: int) -> UsageError:
    """`name` is a signed input of `bits` bits outside low..its largest value (see int32_range_error)."""
    message = f"{name} must be between {low} and {2**(bits - 1) - 1}, not {value}"
    if value < 0:
        message += (f" (over HTTP JSON Triton keeps only the low {bits} bits of a larger number: {value + 2**bits} "
                    f"arrives as {value})")
    return UsageError(message)
