"""``LighthouseProvider``: the job's config keys as OpenFeature flags (extra ``openfeature``).

::

    from openfeature import api
    from openfeature.evaluation_context import EvaluationContext
    from worker_client.openfeature import LighthouseProvider

    api.set_provider(LighthouseProvider(ManagerClient("127.0.0.1:29512")))
    flags = api.get_client()
    lr = flags.get_float_value("lr", 1e-3, EvaluationContext(attributes={"step": step}))

A flag is a config key; its type is the key's JSON type. The wire carries a string as it is and
any other value as its JSON text, so a value that reads as JSON is taken as that JSON value (a
string value ``"3"`` reads as a number: the wire does not tell them apart). A value of the wrong
type answers the default with ``TYPE_MISMATCH``: a number is no string, a boolean no number. An
integer flag takes a JSON number with an integral value (``5``, ``5.0``); a float flag takes any
number (JSON has one number type). ``step`` (an int) in the evaluation context resolves through
``get_config(step=N)``, as training ranks do: every rank of a group resolves the same value at a
step. Without it, ``get_config()`` (the job's live config, unpinned).

``variant`` is the config's version; ``reason`` follows where the manager's answer came from:
STATIC fetched from the lighthouse for this call, CACHED from the manager's confirmed cache (the
usual), STALE the last good config served through an outage (``manager serve --serve-stale``),
ERROR with ``GENERAL`` and the default for the fallback (no config confirmed: lighthouse or
manager unreachable). This provider never raises into the caller.

Events are found on resolutions (no background thread): CONFIGURATION_CHANGED when an answer is
newer than any seen before (``flags_changed``: the keys whose values differ from the last one's),
STALE when an answer is not confirmed (stale or fallback), READY when a confirmed one comes back.
They follow the answers: with ``step`` answers within a step lease stay confirmed through an
outage, while a stepless resolution may see the fallback at the same time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from openfeature.evaluation_context import EvaluationContext
from openfeature.event import ProviderEventDetails
from openfeature.exception import ErrorCode
from openfeature.flag_evaluation import FlagResolutionDetails, FlagValueType, Reason
from openfeature.provider import AbstractProvider, Metadata

from protos.tls import TLSConfig
from worker_client.client import UNCONFIRMED, ConfigUnavailable, ManagerClient
from worker_client.config import Config

NAME = "lighthouse"
STEP = "step"  # the evaluation context's attribute naming the training step

# Where the manager's answer came from -> the OpenFeature reason (the fallback is an error).
REASONS = {"lighthouse": Reason.STATIC, "cache": Reason.CACHED, "stale": Reason.STALE}

V = TypeVar("V")
ObjectValue = Sequence[FlagValueType] | Mapping[str, FlagValueType]


def json_type(value: Any) -> str:
    """The JSON type of a served value as ``Config.get_json`` reads it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, float) and not math.isfinite(value):
        return "string"  # "NaN", "Infinity": the lighthouse stores no such number, so a string
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _integral(value: Any) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


# Per flag type: its name in messages, which decoded values it takes, and the typed read.
_Kind = tuple[str, Callable[[Any], bool], Callable[[Config, str], Any]]
BOOLEAN: _Kind = ("a boolean", lambda v: json_type(v) == "boolean", Config.get_bool)
STRING: _Kind = ("a string", lambda v: json_type(v) == "string", Config.get_str)
INTEGER: _Kind = ("an integer", lambda v: json_type(v) == "number" and _integral(v), Config.get_int)
FLOAT: _Kind = ("a number", lambda v: json_type(v) == "number", Config.get_float)
OBJECT: _Kind = ("an object or array", lambda v: json_type(v) in ("object", "array"), Config.get_json)


class InvalidStep(ValueError):
    """The evaluation context's ``step`` is not a non-negative integer."""


def step_of(context: EvaluationContext | None) -> int | None:
    """The training step the evaluation context names, None without one."""
    if context is None or STEP not in context.attributes:
        return None
    step = context.attributes[STEP]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidStep(f"evaluation context attribute {STEP!r} must be a non-negative int, got {step!r}")
    return step


class LighthouseProvider(AbstractProvider):
    """An OpenFeature provider answering flags from a replica group's manager.

    ``client_or_address``: a ``ManagerClient`` (left open at ``shutdown``: it is yours) or a
    manager's address (the provider makes its own client, with ``timeout`` and ``tls``, and
    closes it at ``shutdown``). At a step, one call to the manager answers all its flags: a pinned
    answer is kept for the step.
    """

    def __init__(
        self,
        client_or_address: ManagerClient | str,
        *,
        timeout: timedelta | float | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        super().__init__()
        if isinstance(client_or_address, ManagerClient):
            if timeout is not None or tls is not None:
                raise TypeError("timeout and tls are for an address; a ManagerClient has its own")
            self.client = client_or_address
            self._owns_client = False
        else:
            options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
            self.client = ManagerClient(client_or_address, tls=tls, **options)
            self._owns_client = True
        self._lock = threading.Lock()
        self._seen: Config | None = None  # the newest confirmed answer: what a change is compared to
        self._stale = False  # the last answer was not confirmed (STALE was emitted)
        self._at_step: Config | None = None  # the last pinned, confirmed answer (its step's config)

    def get_metadata(self) -> Metadata:
        return Metadata(name=NAME)

    def shutdown(self) -> None:
        if self._owns_client:
            self.client.close()

    def resolve_boolean_details(
        self, flag_key: str, default_value: bool, evaluation_context: EvaluationContext | None = None
    ) -> FlagResolutionDetails[bool]:
        return self._resolve(flag_key, default_value, evaluation_context, BOOLEAN)

    def resolve_string_details(
        self, flag_key: str, default_value: str, evaluation_context: EvaluationContext | None = None
    ) -> FlagResolutionDetails[str]:
        return self._resolve(flag_key, default_value, evaluation_context, STRING)

    def resolve_integer_details(
        self, flag_key: str, default_value: int, evaluation_context: EvaluationContext | None = None
    ) -> FlagResolutionDetails[int]:
        return self._resolve(flag_key, default_value, evaluation_context, INTEGER)

    def resolve_float_details(
        self, flag_key: str, default_value: float, evaluation_context: EvaluationContext | None = None
    ) -> FlagResolutionDetails[float]:
        return self._resolve(flag_key, default_value, evaluation_context, FLOAT)

    def resolve_object_details(
        self,
        flag_key: str,
        default_value: ObjectValue,
        evaluation_context: EvaluationContext | None = None,
    ) -> FlagResolutionDetails[ObjectValue]:
        return self._resolve(flag_key, default_value, evaluation_context, OBJECT)

    def _resolve(
        self, key: str, default: V, context: EvaluationContext | None, kind: _Kind
    ) -> FlagResolutionDetails[V]:
        try:
            step = step_of(context)
        except InvalidStep as exc:
            return _error(default, ErrorCode.INVALID_CONTEXT, str(exc))
        config = self.config(step)
        if config.source not in REASONS:
            return _error(
                default,
                ErrorCode.GENERAL,
                f"no confirmed config: the manager answered {config.source!r} "
                "(the lighthouse or the manager is unreachable)",
            )
        raw = config.get(key)
        if raw is None:
            return _error(default, ErrorCode.FLAG_NOT_FOUND, f"no key {key!r} in version {config.version}")
        what, accepts, read = kind
        value = config.get_json(key)
        if not accepts(value):
            found = json_type(value)
            return _error(default, ErrorCode.TYPE_MISMATCH, f"key {key!r} holds {_a(found)}, not {what}")
        metadata: dict[str, bool | int | float | str] = {
            "source": config.source,
            "job": config.job,
            "pinned": config.pinned,
        }
        if config.step is not None:
            metadata["step"] = config.step
        return FlagResolutionDetails(
            value=read(config, key),
            variant=str(config.version),
            reason=REASONS[config.source],
            flag_metadata=metadata,
        )

    def config(self, step: int | None) -> Config:
        """The manager's answer for ``step`` (None: stepless), after emitting the events it brings."""
        held = self._at_step
        if step is not None and held is not None and held.step == step:
            return held
        try:
            config = self.client.get_config(step=step)
        except ConfigUnavailable as exc:  # a strict client: its answer, else the fallback
            config = exc.answer if exc.answer is not None else Config(step=step)
        self._observe(config)
        if step is not None and config.pinned and config.source not in UNCONFIRMED:
            self._at_step = config
        return config

    def _observe(self, config: Config) -> None:
        """Emit what this answer tells: STALE, READY again, or CONFIGURATION_CHANGED."""
        with self._lock:
            if config.source in UNCONFIRMED:
                if not self._stale:
                    self._stale = True
                    self.emit_provider_stale(
                        ProviderEventDetails(
                            message=f"the manager answered {config.source!r}: no confirmed config",
                            metadata={"source": config.source, "version": config.version},
                        )
                    )
                return
            if self._stale:
                self._stale = False
                self.emit_provider_ready(ProviderEventDetails(metadata={"version": config.version}))
            seen = self._seen
            if seen is not None and _order(config) <= _order(seen):
                return  # an older step's config, or the same one: no change
            self._seen = config
            if seen is None:
                return  # the first answer: nothing to compare with
            changed = sorted(k for k in seen.keys() | config.keys() if seen.get(k) != config.get(k))
            if changed:
                self.emit_provider_configuration_changed(
                    ProviderEventDetails(
                        flags_changed=changed,
                        message=f"version {seen.version} -> {config.version}",
                        metadata={"version": config.version, "previous_version": seen.version},
                    )
                )


def _order(config: Config) -> tuple[int, int]:
    """Newer answers sort higher: one version may name two configs, told apart by their first step."""
    return config.version, config.effective_step or 0


def _a(kind: str) -> str:
    return kind if kind == "null" else f"{'an' if kind[0] in 'ao' else 'a'} {kind}"


def _error(default: V, code: ErrorCode, message: str) -> FlagResolutionDetails[V]:
    return FlagResolutionDetails(value=default, reason=Reason.ERROR, error_code=code, error_message=message)
