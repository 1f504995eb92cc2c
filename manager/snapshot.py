"""A config snapshot as a manager serves it, with its worker replies serialized once.

A cache hit then costs a lookup and handing bytes to gRPC: no protobuf work
per call (the response serializer is the identity).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from functools import cached_property

from protos import lighthouse_config_pb2 as pb

CACHE, STALE, FALLBACK, LIGHTHOUSE = "cache", "stale", "fallback", "lighthouse"


def _reply(config: dict[str, str], version: int, source: str, pinned: bool, job: str) -> bytes:
    return pb.ManagerConfigResponse(
        config_data=config, version=version, source=source, pinned=pinned, job=job
    ).SerializeToString()


@dataclass(frozen=True, eq=False)
class Snapshot:
    """One lighthouse version: its config per step range (one range when nothing is scheduled)."""

    version: int
    state_id: str
    instance_id: str
    kind: str  # CACHE for a lighthouse snapshot, STALE or FALLBACK otherwise
    from_steps: tuple[int, ...]  # sorted; segment i holds from from_steps[i] on
    configs: tuple[dict[str, str], ...]
    _replies: dict[tuple[int, bool], bytes] = field(default_factory=dict, repr=False)
    job: str = ""  # the manager's job, named in every reply

    @classmethod
    def from_reply(cls, reply: pb.LighthouseConfigResponse, job: str = "") -> Snapshot:
        if reply.segments:
            from_steps = tuple(s.from_step for s in reply.segments)
            configs = tuple(dict(s.config_data) for s in reply.segments)
        else:
            from_steps, configs = (0,), (dict(reply.config_data),)
        return cls(reply.version, reply.state_id, reply.instance_id, CACHE, from_steps, configs, job=job)

    @classmethod
    def fallback(cls, job: str = "") -> Snapshot:
        """The empty config (version 0) served when the lighthouse does not answer."""
        return cls(0, "", "", FALLBACK, (0,), ({},), job=job)

    def as_stale(self) -> Snapshot:
        return self._stale

    @cached_property
    def _stale(self) -> Snapshot:
        return Snapshot(
            self.version, self.state_id, self.instance_id, STALE, self.from_steps, self.configs, job=self.job
        )

    def segment(self, step: int) -> int:
        """Index of the segment that holds ``step``."""
        if len(self.from_steps) == 1:
            return 0
        return max(0, bisect.bisect_right(self.from_steps, step) - 1)

    def reply(self, segment: int, pinned: bool) -> bytes:
        """The serialized worker reply for a segment."""
        key = (segment, pinned)
        cached = self._replies.get(key)
        if cached is None:
            cached = self._replies[key] = _reply(
                self.configs[segment], self.version, self.kind, pinned, self.job
            )
        return cached

    def fresh_reply(self, segment: int, pinned: bool) -> bytes:
        """Like ``reply`` but labelled as just fetched from the lighthouse (rare: not cached)."""
        return _reply(self.configs[segment], self.version, LIGHTHOUSE, pinned, self.job)
