"""A config snapshot as a manager serves it, with its worker replies serialized once.

A cache hit then costs a lookup and handing bytes to gRPC: no protobuf work
per call (the response serializer is the identity).
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from protos import lighthouse_config_pb2 as pb
from protos.limits import SEGMENT_AUTHOR_CHARS, SEGMENT_COMMENT_CHARS

CACHE, STALE, FALLBACK, LIGHTHOUSE = "cache", "stale", "fallback", "lighthouse"


def _reply(snapshot: Snapshot, segment: int, source: str, pinned: bool) -> bytes:
    reply = pb.ManagerConfigResponse(
        config_data=snapshot.configs[segment],
        version=snapshot.segment_version(segment),
        source=source,
        pinned=pinned,
        job=snapshot.job,
    )
    if snapshot.kind == FALLBACK:
        return reply.SerializeToString()
    reply.effective_step = snapshot.from_steps[segment]
    if segment < len(snapshot.authors):
        reply.author, reply.comment = snapshot.authors[segment], snapshot.comments[segment]
    if segment + 1 < len(snapshot.from_steps):  # the next change, named apart from what is served
        reply.pending_version = snapshot.segment_version(segment + 1)
        reply.pending_step = snapshot.from_steps[segment + 1]
    return reply.SerializeToString()


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
    # Per segment: the version whose config it is (0: not said, ``version`` names it), and who
    # made the change taking effect at its first step and why (empty when not said).
    versions: tuple[int, ...] = ()
    authors: tuple[str, ...] = ()
    comments: tuple[str, ...] = ()

    @classmethod
    def from_reply(cls, reply: pb.LighthouseConfigResponse, job: str = "") -> Snapshot:
        if reply.segments:
            segments = reply.segments
            return cls(
                reply.version,
                reply.state_id,
                reply.instance_id,
                CACHE,
                tuple(s.from_step for s in segments),
                tuple(dict(s.config_data) for s in segments),
                job=job,
                versions=tuple(s.version for s in segments),
                authors=tuple(s.author[:SEGMENT_AUTHOR_CHARS] for s in segments),
                comments=tuple(s.comment[:SEGMENT_COMMENT_CHARS] for s in segments),
            )
        configs = (dict(reply.config_data),)
        return cls(reply.version, reply.state_id, reply.instance_id, CACHE, (0,), configs, job=job)

    @classmethod
    def fallback(cls, job: str = "") -> Snapshot:
        """The empty config (version 0) served when the lighthouse does not answer."""
        return cls(0, "", "", FALLBACK, (0,), ({},), job=job)

    def as_stale(self) -> Snapshot:
        return self._stale

    @cached_property
    def _stale(self) -> Snapshot:
        return dataclasses.replace(self, kind=STALE, _replies={})

    def segment(self, step: int) -> int:
        """Index of the segment that holds ``step``."""
        if len(self.from_steps) == 1:
            return 0
        return max(0, bisect.bisect_right(self.from_steps, step) - 1)

    def segment_version(self, segment: int) -> int:
        """The version whose config segment ``segment`` is: its own, else the snapshot's (a
        lighthouse of an earlier release, or a segment made only of pruned versions)."""
        versions = self.versions
        return (versions[segment] if segment < len(versions) else 0) or self.version

    def same_configs(self, other: Snapshot, first: int, last: int) -> bool:
        """Whether ``other`` serves the config this one does at every step from ``first`` to
        ``last`` (compared once per segment boundary in that range, not per step)."""
        steps = {first} | {s for s in (*self.from_steps, *other.from_steps) if first < s <= last}
        return all(self.configs[self.segment(s)] == other.configs[other.segment(s)] for s in steps)

    def pending(self, step: int) -> tuple[int, int] | None:
        """(version, step) of the next change after ``step``, None when nothing is pending."""
        following = self.segment(step) + 1
        if following >= len(self.from_steps):
            return None
        return self.segment_version(following), self.from_steps[following]

    def reply(self, segment: int, pinned: bool) -> bytes:
        """The serialized worker reply for a segment."""
        key = (segment, pinned)
        cached = self._replies.get(key)
        if cached is None:
            cached = self._replies[key] = _reply(self, segment, self.kind, pinned)
        return cached

    def fresh_reply(self, segment: int, pinned: bool) -> bytes:
        """Like ``reply`` but labelled as just fetched from the lighthouse (rare: not cached)."""
        return _reply(self, segment, LIGHTHOUSE, pinned)
