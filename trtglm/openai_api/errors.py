"""The API's errors, as OpenAI answers them: `{"error": {"message", "type", "param", "code"}}` with an HTTP status
(400 for a malformed or out-of-range request, 404 for an unknown model or path, 413 for a body too large, 422 for
what this server understands but cannot do, 500 when Triton fails, 503 when it is unreachable or busy), and
pydantic's complaints about a request as such a 400."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.retry_after = retry_after  # seconds, for a Retry-After header

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": str(self.retry_after)}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def validation_error(errors: list[dict]) -> ApiError:
    """The first of pydantic's complaints as a 400 naming the field; of a union's, the member of the value's
    own type (a list of too many prompts: its length, not that it is no string)."""
    first = errors[0] if errors else {}
    location = _field(first)
    first = next((e for e in errors if _field(e) == location and not e.get("type", "").endswith("_type")), first)
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')})",
                        code="invalid_json")
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    return ApiError(400, f"{param}: {message}" if param else message, param, "invalid_value")


def _field(error: dict) -> list[str]:
    return [str(part) for part in error.get("loc", ()) if part != "body" and not _union_tag(part)]


def _union_tag(part) -> bool:
    """Whether a part of pydantic's error location names a member of a union (`str`, `list[str]`, a model)."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool"} or part[:1].isupper()
                                      or part.startswith("constrained-"))
