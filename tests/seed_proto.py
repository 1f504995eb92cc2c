"""A client generated from the seed's own torchft.proto (tests/torchft_seed/), as a torchft user has.

Compiled once per process into a temporary folder; package ``torchft`` lands in protobuf's default
pool, beside the lighthouse's private copy of the GetConfig messages (no clash: that is the test).
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from functools import cache
from importlib import resources
from pathlib import Path
from types import ModuleType

from grpc_tools import protoc

SEED_PROTO_DIR = Path(__file__).resolve().parent / "torchft_seed"


@cache
def seed_modules() -> tuple[ModuleType, ModuleType]:
    """(torchft_pb2, torchft_pb2_grpc) of the seed's proto."""
    out = Path(tempfile.mkdtemp(prefix="torchft-seed-"))
    include = resources.files("grpc_tools").joinpath("_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{SEED_PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        "torchft.proto",
    ]
    assert protoc.main(args) == 0, "protoc failed on the seed's torchft.proto"
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module("torchft_pb2"), importlib.import_module("torchft_pb2_grpc")
    finally:
        sys.path.remove(str(out))
