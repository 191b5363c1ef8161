"""Errors the HTTP API answers with, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``. No FastAPI import: the engine thread and
the request parser raise these too."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered with HTTP ``status``; ``param`` names the request field at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str,
    param: str | None = None,
    code: str | None = None,  # noqa: A002
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    """400: a request field the server cannot accept."""
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str = "") -> APIError:
    return APIError(
        400,
        f"{param} is not supported by this server{what}",
        param=param,
        code="unsupported_parameter",
    )


def overloaded(depth: int, bound: int) -> APIError:
    return APIError(
        429,
        f"the server's queue is full ({depth} requests wait, --max-queue {bound}); retry later",
        type="rate_limit_error",
        code="rate_limit_exceeded",
    )


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or wrong API key: send 'Authorization: Bearer <key>'",
        type="authentication_error",
        code="invalid_api_key",
    )


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="engine_stopped")
