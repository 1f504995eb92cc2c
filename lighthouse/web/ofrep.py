"""OFREP, the OpenFeature Remote Evaluation Protocol, on the dashboard's port: any OpenFeature SDK's
OFREP provider reads a job's config as flags, without our client.

A flag is a key of a job's config, its value the key's JSON value, its variant the config
version (as a string), its reason ``STATIC``. Without ``step`` in the context it is the head
version's config (``GET /api/config``'s ``version`` and ``config``); with ``step``, what every
group trains at that step (``GET /api/config/at-step/N``), the variant then the version whose
config holds there. The job is the context's ``targetingKey``, else the ``X-Lighthouse-Job``
header, else ``default``.

Evaluations are reads: open under an allowed Host (or with a token of this lighthouse), as
``GET /api/config`` is; nothing here changes a config. Every refusal is OFREP's
``{"key", "errorCode", "errorDetails"}``: a request that is not a JSON object of at most 1 MiB
is 400 ``PARSE_ERROR`` (OFREP has no 411, 413 or 415), a context that names no job this
lighthouse holds, a bad ``step`` or a non-object context 400 ``INVALID_CONTEXT`` (single and bulk
alike: bulk has no 404), a key the config lacks 404 ``FLAG_NOT_FOUND``. Types are the client's
check: OFREP sends no type, so ``TYPE_MISMATCH`` comes from the provider.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

from lighthouse.config.values import ConfigError
from lighthouse.jobs.registry import JobRegistry
from lighthouse.jobs.versions import NotFound, first_segment
from lighthouse.web.messages import HttpError, Request, Response, json_response
from protos.job_ids import InvalidJobId, JobId, check_job_id

logger = logging.getLogger(__name__)

FLAGS_PATH = "/ofrep/v1/evaluate/flags"  # bulk; a single flag is FLAGS_PATH/{key}
JOB_HEADER = "X-Lighthouse-Job"
REASON = "STATIC"  # a config value: no targeting, no split (DEFAULT would mean a fallback)


class Refusal(Exception):
    """An OFREP error answer: ``status`` with ``errorCode`` ``code``."""

    def __init__(self, status: int, code: str, details: str) -> None:
        super().__init__(details)
        self.status = status
        self.code = code
        self.details = details

    def answer(self, key: str | None) -> Response:
        body: dict[str, Any] = {"errorCode": self.code, "errorDetails": self.details}
        return json_response(body if key is None else {"key": key, **body}, self.status)


@dataclass(frozen=True)
class Query:
    """Whose flags at which step (None: the head version's config)."""

    job: JobId
    step: int | None


@dataclass(frozen=True)
class Evaluation:
    """Every flag of a job at one version (and step), in OFREP's success shape."""

    job: JobId
    version: int
    variant: int
    step: int | None
    config: dict[str, Any]

    @property
    def metadata(self) -> dict[str, Any]:
        """OFREP metadata holds booleans, strings and numbers only."""
        meta: dict[str, Any] = {"job": self.job, "version": self.version}
        return meta if self.step is None else {**meta, "step": self.step}

    def flag(self, key: str) -> dict[str, Any]:
        value = self.config[key]
        answer: dict[str, Any] = {"key": key}
        if value is not None:  # null: OFREP's code-default flag (no value: the caller's default)
            answer["value"] = value
        return {**answer, "reason": REASON, "variant": str(self.variant), "metadata": self.metadata}


class OfrepApi:
    """The two OFREP core routes; ``check_read`` raises the HttpError a read is refused with."""

    def __init__(self, jobs: JobRegistry, check_read: Callable[[Request], None]) -> None:
        self.jobs = jobs
        self._check_read = check_read

    def evaluate_flag(self, req: Request) -> Response:
        """POST /ofrep/v1/evaluate/flags/{key}: one flag (the key percent-decoded, UTF-8)."""
        key = unquote_to_bytes(req.params[0].encode("latin-1")).decode("utf-8", "replace")
        try:
            evaluation = self._evaluate(self._query(req))
        except Refusal as refusal:
            return refusal.answer(key)
        except Exception:
            return _internal_error(req)
        if key not in evaluation.config:
            where = f"the config of job {evaluation.job!r} (version {evaluation.version})"
            return Refusal(404, "FLAG_NOT_FOUND", f"no key {key[:200]!r} in {where}").answer(key)
        return json_response(evaluation.flag(key))

    def evaluate_flags(self, req: Request) -> Response:
        """POST /ofrep/v1/evaluate/flags: every flag, with an ETag of the answer (``If-None-Match``
        naming it: 304, the flags are as the caller holds them)."""
        try:
            evaluation = self._evaluate(self._query(req))
        except Refusal as refusal:
            return refusal.answer(None)
        except Exception:
            return _internal_error(req)
        answer = json_response(
            {"flags": [evaluation.flag(key) for key in evaluation.config], "metadata": evaluation.metadata}
        )
        # The answer's own hash: it changes exactly when a flag, the version or the step does.
        etag = '"' + hashlib.sha256(answer.body).hexdigest()[:32] + '"'
        headers = {"ETag": etag, "Cache-Control": "no-cache"}
        held = _entity_tags(req.headers.get("If-None-Match", ""))
        if etag in held or "*" in held:
            return Response(304, b"", answer.content_type, headers)
        return Response(200, answer.body, answer.content_type, headers)

    # ------------------------------------------------------------ the request
    def _query(self, req: Request) -> Query:
        try:
            self._check_read(req)  # before the body: a refused Host learns nothing
        except HttpError as exc:
            raise Refusal(exc.status, "GENERAL", exc.message) from None
        context = _context(_body(req))
        key = context.get("targetingKey")
        if key is not None and not isinstance(key, str):
            raise Refusal(400, "INVALID_CONTEXT", "targetingKey must be a string: the job's id")
        header = req.headers.get(JOB_HEADER, "").strip()
        if key and header and key != header:
            raise Refusal(
                400, "INVALID_CONTEXT", f"targetingKey {key[:80]!r} and {JOB_HEADER} {header[:80]!r} differ"
            )
        try:
            job = check_job_id(key or header)
        except InvalidJobId as exc:
            raise Refusal(
                400, "INVALID_CONTEXT", f"targetingKey or {JOB_HEADER} names the job: {exc}"
            ) from None
        step = context.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
            raise Refusal(400, "INVALID_CONTEXT", f"step must be an integer >= 0, got {str(step)[:40]}")
        return Query(job, step)

    def _evaluate(self, query: Query) -> Evaluation:
        try:
            store = self.jobs.existing(query.job).store
        except NotFound as exc:
            raise Refusal(
                400, "INVALID_CONTEXT", f"{exc} (targetingKey or {JOB_HEADER} names the job)"
            ) from None
        with store.lock:  # the version and its config from one instant
            latest = store.latest()
            version = latest.version if latest is not None else 0
            if query.step is None:
                config = dict(latest.config) if latest is not None else {}
                return Evaluation(query.job, version, version, None, config)
            config = store.resolve(version, query.step)  # the head is never pruned
            segments = store.segments(version)
            variant = segments[first_segment(segments, query.step)].version  # 0: pruned versions made it
            return Evaluation(query.job, version, variant, query.step, config)


def _body(req: Request) -> Any:
    """The request's JSON; an empty body is ``{}`` (no context: the job ``default``)."""
    if not req.headers.get("Transfer-Encoding"):
        try:
            if not req.content_length():
                return {}
        except HttpError as exc:
            raise Refusal(400, "PARSE_ERROR", exc.message) from None
    try:
        return req.json_body()
    except (HttpError, ConfigError) as exc:  # not JSON, too large, not application/json, no length
        raise Refusal(400, "PARSE_ERROR", exc.message if isinstance(exc, HttpError) else str(exc)) from None


def _context(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise Refusal(
            400, "PARSE_ERROR", 'the body must be a JSON object: {"context": {"targetingKey": JOB}}'
        )
    context = body.get("context")
    if context is None:
        return {}
    if not isinstance(context, dict):
        raise Refusal(400, "INVALID_CONTEXT", f"context must be a JSON object, got {type(context).__name__}")
    return context


def _entity_tags(header: str) -> set[str]:
    """The tags of an ``If-None-Match`` list (a weak ``W/"x"`` matches ``"x"``: the comparison is weak)."""
    return {tag.strip().removeprefix("W/") for tag in header.split(",") if tag.strip()}


def _internal_error(req: Request) -> Response:
    logger.exception("OFREP %s failed", req.path[:200])
    return json_response({"errorDetails": "internal error (see the lighthouse log)"}, 500)
