"""The seed's ``torchft.LighthouseService/GetConfig`` messages, in a descriptor pool of their own.

Not protobuf's default pool: package ``torchft`` there would clash with any other torchft proto
module imported in the same process (see torchft_seed.proto).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from importlib import resources
from typing import Protocol, cast

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SEED_SERVICE = "torchft.LighthouseService"
SEED_GET_CONFIG = f"/{SEED_SERVICE}/GetConfig"
JOB_METADATA = "lighthouse-job"  # call metadata naming the job (none: "default")

POOL = descriptor_pool.DescriptorPool()
for _file in descriptor_pb2.FileDescriptorSet.FromString(
    resources.files("protos").joinpath("torchft_seed.binpb").read_bytes()
).file:
    POOL.Add(_file)

SeedConfigRequest = message_factory.GetMessageClass(
    POOL.FindMessageTypeByName("torchft.LighthouseConfigRequest")
)
SeedConfigResponse = message_factory.GetMessageClass(
    POOL.FindMessageTypeByName("torchft.LighthouseConfigResponse")
)


class _SeedConfigReply(Protocol):
    """What this project sets on a ``torchft.LighthouseConfigResponse``: the class is built at run
    time from the descriptor set, so protobuf's stubs know it only as a ``Message`` without fields."""

    @property
    def config_data(self) -> MutableMapping[str, str]: ...

    def SerializeToString(self, *, deterministic: bool = ...) -> bytes: ...


def seed_config_reply(config: Mapping[str, str]) -> bytes:
    """The seed's ``GetConfig`` reply carrying ``config``, serialized."""
    reply = cast(_SeedConfigReply, SeedConfigResponse())
    reply.config_data.update(config)
    return reply.SerializeToString()


# What the dashboard reads of torchft's own quorum calls (lighthouse.rpc.torchft_forward.TorchftView).
QuorumResponse = message_factory.GetMessageClass(
    POOL.FindMessageTypeByName("torchft.LighthouseQuorumResponse")
)
HeartbeatRequest = message_factory.GetMessageClass(
    POOL.FindMessageTypeByName("torchft.LighthouseHeartbeatRequest")
)
