"""The seed's ``torchft.LighthouseService/GetConfig`` messages, in a descriptor pool of their own.

Not protobuf's default pool: package ``torchft`` there would clash with any other torchft proto
module imported in the same process (see torchft_seed.proto).
"""

from __future__ import annotations

from importlib import resources

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
# What the dashboard reads of torchft's own quorum calls (lighthouse.torchft_forward.TorchftView).
QuorumResponse = message_factory.GetMessageClass(
    POOL.FindMessageTypeByName("torchft.LighthouseQuorumResponse")
)
HeartbeatRequest = message_factory.GetMessageClass(
    POOL.FindMessageTypeByName("torchft.LighthouseHeartbeatRequest")
)
