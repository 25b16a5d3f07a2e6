"""The error every host call can return to an inferlet: a kind (the WIT `error-kind` enum)
and a precise message."""

from __future__ import annotations

from enum import StrEnum


class ErrorKind(StrEnum):
    INVALID_HANDLE = "invalid-handle"
    INVALID_ARGUMENT = "invalid-argument"
    OUT_OF_RESOURCES = "out-of-resources"
    NOT_FOUND = "not-found"
    ALREADY_EXISTS = "already-exists"
    PERMISSION_DENIED = "permission-denied"
    UNSUPPORTED = "unsupported"
    IO = "io"
    INFERENCE_FAILED = "inference-failed"
    DISCARDED = "discarded"


class HostError(Exception):
    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message
