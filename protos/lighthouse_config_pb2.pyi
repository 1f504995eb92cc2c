from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ManagerStatus(_message.Message):
    __slots__ = ("replica_id", "address", "version", "requests", "cache_hits", "step", "switches", "job", "lease_through_step", "steps_past_lease", "metrics", "metrics_batch", "metrics_dropped", "live_version", "pending_version", "pending_step", "run_id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_PAST_LEASE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    METRICS_BATCH_FIELD_NUMBER: _ClassVar[int]
    METRICS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    LIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_STEP_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    version: int
    requests: int
    cache_hits: int
    step: int
    switches: _containers.RepeatedCompositeFieldContainer[StepSwitch]
    job: str
    lease_through_step: int
    steps_past_lease: int
    metrics: _containers.RepeatedCompositeFieldContainer[MetricSummaries]
    metrics_batch: int
    metrics_dropped: int
    live_version: int
    pending_version: int
    pending_step: int
    run_id: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., version: _Optional[int] = ..., requests: _Optional[int] = ..., cache_hits: _Optional[int] = ..., step: _Optional[int] = ..., switches: _Optional[_Iterable[_Union[StepSwitch, _Mapping]]] = ..., job: _Optional[str] = ..., lease_through_step: _Optional[int] = ..., steps_past_lease: _Optional[int] = ..., metrics: _Optional[_Iterable[_Union[MetricSummaries, _Mapping]]] = ..., metrics_batch: _Optional[int] = ..., metrics_dropped: _Optional[int] = ..., live_version: _Optional[int] = ..., pending_version: _Optional[int] = ..., pending_step: _Optional[int] = ..., run_id: _Optional[str] = ...) -> None: ...

class MetricSummaries(_message.Message):
    __slots__ = ("name", "steps", "count", "nonfinite", "sum", "min", "max")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    name: str
    steps: bytes
    count: bytes
    nonfinite: bytes
    sum: bytes
    min: bytes
    max: bytes
    def __init__(self, name: _Optional[str] = ..., steps: _Optional[bytes] = ..., count: _Optional[bytes] = ..., nonfinite: _Optional[bytes] = ..., sum: _Optional[bytes] = ..., min: _Optional[bytes] = ..., max: _Optional[bytes] = ...) -> None: ...

class MetricGroupSummaries(_message.Message):
    __slots__ = ("replica_id", "metrics")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    metrics: _containers.RepeatedCompositeFieldContainer[MetricSummaries]
    def __init__(self, replica_id: _Optional[str] = ..., metrics: _Optional[_Iterable[_Union[MetricSummaries, _Mapping]]] = ...) -> None: ...

class MetricPeerBatch(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[MetricGroupSummaries]
    def __init__(self, groups: _Optional[_Iterable[_Union[MetricGroupSummaries, _Mapping]]] = ...) -> None: ...

class StepSwitch(_message.Message):
    __slots__ = ("version", "step", "previous_step")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STEP_FIELD_NUMBER: _ClassVar[int]
    version: int
    step: int
    previous_step: int
    def __init__(self, version: _Optional[int] = ..., step: _Optional[int] = ..., previous_step: _Optional[int] = ...) -> None: ...

class LighthouseConfigRequest(_message.Message):
    __slots__ = ("replica_id", "known_version", "known_state_id", "status", "job", "lease_seconds", "lease_from_step")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_STATE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    known_version: int
    known_state_id: str
    status: ManagerStatus
    job: str
    lease_seconds: float
    lease_from_step: int
    def __init__(self, replica_id: _Optional[str] = ..., known_version: _Optional[int] = ..., known_state_id: _Optional[str] = ..., status: _Optional[_Union[ManagerStatus, _Mapping]] = ..., job: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., lease_from_step: _Optional[int] = ...) -> None: ...

class ConfigSegment(_message.Message):
    __slots__ = ("from_step", "config_data", "version", "author", "comment")
    class ConfigDataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    CONFIG_DATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AUTHOR_FIELD_NUMBER: _ClassVar[int]
    COMMENT_FIELD_NUMBER: _ClassVar[int]
    from_step: int
    config_data: _containers.ScalarMap[str, str]
    version: int
    author: str
    comment: str
    def __init__(self, from_step: _Optional[int] = ..., config_data: _Optional[_Mapping[str, str]] = ..., version: _Optional[int] = ..., author: _Optional[str] = ..., comment: _Optional[str] = ...) -> None: ...

class LighthouseConfigResponse(_message.Message):
    __slots__ = ("config_data", "version", "not_modified", "instance_id", "state_id", "segments", "current_step", "stable_through_step", "keepalive_ms", "run_start_step")
    class ConfigDataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONFIG_DATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NOT_MODIFIED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_STEP_FIELD_NUMBER: _ClassVar[int]
    STABLE_THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_START_STEP_FIELD_NUMBER: _ClassVar[int]
    config_data: _containers.ScalarMap[str, str]
    version: int
    not_modified: bool
    instance_id: str
    state_id: str
    segments: _containers.RepeatedCompositeFieldContainer[ConfigSegment]
    current_step: int
    stable_through_step: int
    keepalive_ms: int
    run_start_step: int
    def __init__(self, config_data: _Optional[_Mapping[str, str]] = ..., version: _Optional[int] = ..., not_modified: _Optional[bool] = ..., instance_id: _Optional[str] = ..., state_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[ConfigSegment, _Mapping]]] = ..., current_step: _Optional[int] = ..., stable_through_step: _Optional[int] = ..., keepalive_ms: _Optional[int] = ..., run_start_step: _Optional[int] = ...) -> None: ...

class LighthouseHeartbeatRequest(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: ManagerStatus
    def __init__(self, status: _Optional[_Union[ManagerStatus, _Mapping]] = ...) -> None: ...

class LighthouseHeartbeatResponse(_message.Message):
    __slots__ = ("version", "instance_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    instance_id: str
    def __init__(self, version: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class ManagerConfigRequest(_message.Message):
    __slots__ = ("group_rank", "step", "known_version", "peek", "metrics", "metrics_dropped")
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEEK_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    METRICS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    group_rank: int
    step: int
    known_version: int
    peek: bool
    metrics: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    metrics_dropped: int
    def __init__(self, group_rank: _Optional[int] = ..., step: _Optional[int] = ..., known_version: _Optional[int] = ..., peek: _Optional[bool] = ..., metrics: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ..., metrics_dropped: _Optional[int] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "values")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    step: int
    values: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ManagerConfigResponse(_message.Message):
    __slots__ = ("config_data", "version", "source", "pinned", "job", "stable_through_step", "pending_version", "pending_step", "author", "comment", "effective_step")
    class ConfigDataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CONFIG_DATA_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STABLE_THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    PENDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_STEP_FIELD_NUMBER: _ClassVar[int]
    AUTHOR_FIELD_NUMBER: _ClassVar[int]
    COMMENT_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_STEP_FIELD_NUMBER: _ClassVar[int]
    config_data: _containers.ScalarMap[str, str]
    version: int
    source: str
    pinned: bool
    job: str
    stable_through_step: int
    pending_version: int
    pending_step: int
    author: str
    comment: str
    effective_step: int
    def __init__(self, config_data: _Optional[_Mapping[str, str]] = ..., version: _Optional[int] = ..., source: _Optional[str] = ..., pinned: _Optional[bool] = ..., job: _Optional[str] = ..., stable_through_step: _Optional[int] = ..., pending_version: _Optional[int] = ..., pending_step: _Optional[int] = ..., author: _Optional[str] = ..., comment: _Optional[str] = ..., effective_step: _Optional[int] = ...) -> None: ...

class ManagerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ManagerInfo(_message.Message):
    __slots__ = ("replica_id", "job", "address", "source", "version", "cache_age_s", "cache_ttl_s", "lighthouse", "lighthouses", "last_answer_age_s", "last_error", "pinned_steps", "first_pinned_step", "last_pinned_step", "lighthouse_step", "requests", "cache_hits", "upstream_fetches", "upstream_failures", "lease_through_step", "live_version", "pending_version", "pending_step")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_AGE_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSE_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSES_FIELD_NUMBER: _ClassVar[int]
    LAST_ANSWER_AGE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    PINNED_STEPS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PINNED_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_PINNED_STEP_FIELD_NUMBER: _ClassVar[int]
    LIGHTHOUSE_STEP_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FETCHES_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LEASE_THROUGH_STEP_FIELD_NUMBER: _ClassVar[int]
    LIVE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_VERSION_FIELD_NUMBER: _ClassVar[int]
    PENDING_STEP_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    job: str
    address: str
    source: str
    version: int
    cache_age_s: float
    cache_ttl_s: float
    lighthouse: str
    lighthouses: _containers.RepeatedScalarFieldContainer[str]
    last_answer_age_s: float
    last_error: str
    pinned_steps: int
    first_pinned_step: int
    last_pinned_step: int
    lighthouse_step: int
    requests: int
    cache_hits: int
    upstream_fetches: int
    upstream_failures: int
    lease_through_step: int
    live_version: int
    pending_version: int
    pending_step: int
    def __init__(self, replica_id: _Optional[str] = ..., job: _Optional[str] = ..., address: _Optional[str] = ..., source: _Optional[str] = ..., version: _Optional[int] = ..., cache_age_s: _Optional[float] = ..., cache_ttl_s: _Optional[float] = ..., lighthouse: _Optional[str] = ..., lighthouses: _Optional[_Iterable[str]] = ..., last_answer_age_s: _Optional[float] = ..., last_error: _Optional[str] = ..., pinned_steps: _Optional[int] = ..., first_pinned_step: _Optional[int] = ..., last_pinned_step: _Optional[int] = ..., lighthouse_step: _Optional[int] = ..., requests: _Optional[int] = ..., cache_hits: _Optional[int] = ..., upstream_fetches: _Optional[int] = ..., upstream_failures: _Optional[int] = ..., lease_through_step: _Optional[int] = ..., live_version: _Optional[int] = ..., pending_version: _Optional[int] = ..., pending_step: _Optional[int] = ...) -> None: ...
