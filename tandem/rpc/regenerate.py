"""Regenerates the committed gRPC stubs in tandem/rpc/ from proto/tandem/v1/*.proto (`make proto`).

protoc emits `from tandem.v1 import x_pb2`; the stubs live flat in `tandem.rpc`, so imports are rewritten.
Pinned grpcio-tools (no newer than the GPU machine's grpcio) keeps one set of stubs valid in both places.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO_DIR = os.path.join(ROOT, "proto")
OUT_DIR = os.path.dirname(os.path.abspath(__file__))


def generate() -> dict[str, str]:
    """Returns {file name: contents} of the stubs the .proto files produce now."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(os.path.join("tandem", "v1", f) for f in os.listdir(os.path.join(PROTO_DIR, "tandem", "v1"))
                    if f.endswith(".proto"))
    include = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                          f"--grpc_python_out={tmp}", *protos])
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        out = {}
        gen = os.path.join(tmp, "tandem", "v1")
        for name in sorted(os.listdir(gen)):
            with open(os.path.join(gen, name)) as f:
                out[name] = re.sub(r"^from tandem\.v1 import", "from tandem.rpc import", f.read(), flags=re.M)
        return out


def main() -> int:
    for name, text in generate().items():
        with open(os.path.join(OUT_DIR, name), "w") as f:
            f.write(text)
        print("wrote", os.path.join("tandem", "rpc", name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
