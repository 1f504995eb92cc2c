"""Generate the Python code for every ``protos/**/*.proto`` (one script, one truth).

``protos/etcd/`` holds etcd's own v3 API protos (vendored, see their headers), so
the etcd client runs on stubs from the same protoc as the project's own.

Run ``python protos/generate.py`` after editing a .proto file; ``--check``
exits 1 when the committed generated code differs from a fresh generation
(the test suite runs it, so stale code cannot land).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", ".binpb")
# Compiled to a descriptor set only (loaded into a private pool; see torchft_seed.proto).
DESCRIPTOR_SET_ONLY = frozenset({"torchft_seed.proto"})


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto into ``out_dir/protos`` and return the files written."""
    for proto in sorted(PROTO_DIR.rglob("*.proto")):
        (out_dir / proto.parent.relative_to(ROOT)).mkdir(parents=True, exist_ok=True)
        # Include path = repo root, so generated imports read `from protos import ...`.
        if proto.name in DESCRIPTOR_SET_ONLY:
            target = out_dir / proto.relative_to(ROOT).with_suffix(".binpb")
            outputs = [f"--descriptor_set_out={target}"]
        else:
            outputs = [f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
        args = ["grpc_tools.protoc", f"-I{ROOT}", *outputs, str(proto.relative_to(ROOT))]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
    return generated_files(out_dir / "protos")


def generated_files(proto_dir: Path) -> list[Path]:
    """Every generated file under ``proto_dir``, at any depth."""
    return sorted(p for p in proto_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def stale_files() -> list[str]:
    """Names of generated files that are missing, extra or different from a fresh run."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_dir = Path(tmp) / "protos"
        fresh = {str(p.relative_to(fresh_dir)): p for p in generate(Path(tmp))}
        committed = {str(p.relative_to(PROTO_DIR)): p for p in generated_files(PROTO_DIR)}
        names = sorted(set(fresh) | set(committed))
        return [
            n
            for n in names
            if n not in fresh or n not in committed or not filecmp.cmp(fresh[n], committed[n], shallow=False)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="only compare, write nothing")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("generated code is out of date: " + ", ".join(stale), file=sys.stderr)
            print("run: python protos/generate.py", file=sys.stderr)
            return 1
        return 0
    for path in generate(ROOT):
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
