"""API errors as the API server sends them: ``Status`` objects with reason, code and details."""

from __future__ import annotations

from typing import Any

from .schema import FieldError


class ApiError(Exception):
    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        *,
        name: str = "",
        group: str = "",
        kind: str = "",
        causes: list[dict[str, str]] | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details: dict[str, Any] = {}
        if name:
            self.details["name"] = name
        if group:
            self.details["group"] = group
        if kind:
            self.details["kind"] = kind
        if causes:
            self.details["causes"] = causes
        if retry_after is not None:
            self.details["retryAfterSeconds"] = retry_after
        self.retry_after = retry_after

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            out["details"] = self.details
        return out


def not_found(qualified: str, name: str, group: str = "", kind: str = "") -> ApiError:
    return ApiError(
        404, "NotFound", f'{qualified} "{name}" not found', name=name, group=group, kind=kind.split(".")[0] or qualified
    )


def already_exists(qualified: str, name: str, group: str = "", kind: str = "") -> ApiError:
    return ApiError(
        409, "AlreadyExists", f'{qualified} "{name}" already exists', name=name, group=group, kind=kind or qualified
    )


def conflict(qualified: str, name: str, why: str, group: str = "", kind: str = "") -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified} "{name}": {why}',
        name=name,
        group=group,
        kind=kind or qualified,
    )


def invalid(kind_group: str, name: str, errors: list[FieldError], group: str = "", kind: str = "") -> ApiError:
    summary = ", ".join(f"{e.field}: {e.message}" for e in errors)
    if len(errors) > 1:
        summary = "[" + summary + "]"
    return ApiError(
        422,
        "Invalid",
        f'{kind_group} "{name}" is invalid: {summary}',
        name=name,
        group=group,
        kind=kind,
        causes=[e.cause() for e in errors],
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)
