"""Requests and answers of the lighthouse's HTTP API: parsing with limits, JSON errors.

Every refusal is an ``HttpError`` that becomes ``{"error": "..."}`` with its
status; bodies are read only after their type and size are checked.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import dataclass, field
from email.message import Message
from typing import Any
from urllib.parse import parse_qs

from lighthouse.config.values import parse_json
from protos.job_ids import DEFAULT_JOB, JobId

MAX_BODY_BYTES = 1024 * 1024
MAX_FORM_BYTES = 3 * MAX_BODY_BYTES  # URL-encoding takes up to 3 bytes for one
FORM = "application/x-www-form-urlencoded"


class HttpError(Exception):
    """Answered as ``{"error": message, **extra}`` with ``status``."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}
        self.extra = extra


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """Always valid JSON: a float that is not finite (held only by versions stored before numbers
    were checked) is written as the string "Infinity", "-Infinity" or "NaN"."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(obj), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    body = text.encode()
    return Response(status, body, "application/json", {"Cache-Control": "no-store", **(headers or {})})


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("inf", "Infinity").replace("nan", "NaN")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def error_response(exc: HttpError) -> Response:
    return json_response({"error": exc.message, **exc.extra}, exc.status, exc.headers)


@dataclass
class Request:
    """One parsed request; the body is read only on demand, after its size is checked."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: Message
    rfile: io.BufferedIOBase
    params: tuple[str, ...] = ()
    body_read: bool = False
    job: JobId = DEFAULT_JOB  # from an /api/jobs/{job}/... or /jobs/{job}/... path (checked there)
    reply_headers: dict[str, str] = field(default_factory=dict)  # added to the answer, also to an error

    def arg(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None

    def int_arg(self, name: str, minimum: int = 0) -> int | None:
        text = self.arg(name)
        if text is None:
            return None
        return parse_int(text, name, minimum)

    def json_body(self) -> Any:
        """The body as JSON: application/json, Content-Length <= 1 MiB, UTF-8."""
        return parse_json(self._body("application/json", MAX_BODY_BYTES), "body")

    def form_json(self, name: str) -> Any:
        """The JSON text in form field ``name`` (application/x-www-form-urlencoded, as the seed's
        editor page sends it): parsed like a JSON body; its errors name the field."""
        data = self._body(FORM, MAX_FORM_BYTES)
        try:
            fields = parse_qs(
                data.decode("ascii"), keep_blank_values=True, max_num_fields=50, errors="strict"
            )
        except UnicodeError:
            raise HttpError(400, "form body is not URL-encoded UTF-8") from None
        except ValueError:
            raise HttpError(400, "too many form fields (max 50)") from None
        values = fields.get(name, [])
        if len(values) != 1:
            raise HttpError(400, f"form field {name!r} (the config's JSON text) is required once")
        return parse_json(values[0], name)

    def _body(self, content_type: str, limit: int) -> bytes:
        """The body's bytes, of ``content_type`` (UTF-8) and at most ``limit`` bytes."""
        ctype = self.headers.get("Content-Type", "")
        mime, _, rest = ctype.partition(";")
        charset = re.search(r"charset\s*=\s*\"?([\w-]+)", rest, re.IGNORECASE)
        if mime.strip().lower() != content_type or (
            charset and charset.group(1).lower() not in ("utf-8", "utf8")
        ):
            raise HttpError(415, f"Content-Type must be {content_type}, got {ctype or 'none'!r}")
        if self.headers.get("Transfer-Encoding"):
            raise HttpError(411, "chunked bodies are not accepted: send Content-Length")
        length = self.content_length()
        if length is None:
            raise HttpError(411, "Content-Length is required")
        if length > limit:
            raise HttpError(413, f"body is {length} bytes (max {limit})")
        data = self.rfile.read(length)
        self.body_read = True
        if len(data) != length:
            raise HttpError(400, f"body ended after {len(data)} of {length} bytes")
        return data

    def content_length(self) -> int | None:
        """The body's declared length, None without the header. Anything but one number in ASCII
        digits is a 400 (RFC 9112, 6.3): ``str.isdigit`` and ``int`` also take "²" or "٣"."""
        lengths = {value.strip() for value in self.headers.get_all("Content-Length") or []}
        if not lengths:
            return None
        if len(lengths) > 1 or not re.fullmatch(r"[0-9]{1,18}", next(iter(lengths))):
            raise HttpError(400, "invalid Content-Length")
        return int(next(iter(lengths)))

    def has_unread_body(self) -> bool:
        if self.body_read:
            return False
        if self.headers.get("Transfer-Encoding"):
            return True
        try:
            return (self.content_length() or 0) > 0
        except HttpError:
            return True  # no telling where its body ends: drain what comes, then close


def parse_int(text: str, name: str, minimum: int = 0) -> int:
    if not re.fullmatch(r"-?[0-9]{1,18}", text.strip()):
        raise HttpError(400, f"{name} must be an integer, got {text[:40]!r}")
    value = int(text)
    if value < minimum:
        raise HttpError(400, f"{name} must be >= {minimum}, got {value}")
    return value


def clean_text(text: str, limit: int) -> str:
    """Header/query text fit for the history: printable characters only, bounded."""
    with contextlib.suppress(UnicodeError):  # headers arrive decoded as latin-1; most clients send UTF-8
        text = text.encode("latin-1").decode("utf-8")
    return "".join(ch for ch in text if ch.isprintable()).strip()[:limit]


def if_match_version(header: str | None) -> int | None:
    """``If-Match: 5`` or ``"5"`` (or ``W/"5"``); ``*`` or no header: no precondition."""
    if header is None or header.strip() in ("", "*"):
        return None
    text = header.strip().removeprefix("W/").strip('"')
    if not re.fullmatch(r"[0-9]{1,18}", text):
        raise HttpError(400, f"If-Match must be a version number, got {header[:40]!r}")
    return int(text)


def error_answer(status: int, message: str) -> Response:
    return json_response({"error": message}, status)
