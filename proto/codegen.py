"""Generate the Python gRPC stubs from `proto/` with grpcio-tools (a development script: the
runtime ships the generated stubs, not this, and grpcio-tools is a development dependency).

    python proto/codegen.py          # rewrite runtime/src/cosine/transport/*_pb2*.py
The stubs are committed; `tests/runtime/test_transport.py` regenerates into a temp dir and checks
they are identical, so the `.proto` stays the single source of the wire protocol.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # proto/, in the repository
PROTO = PROTO_ROOT / "cosine" / "transport" / "drafter.proto"
OUT = PROTO_ROOT.parent / "runtime" / "src" / "cosine" / "transport"
GENERATED = ("drafter_pb2.py", "drafter_pb2.pyi", "drafter_pb2_grpc.py")


def generate(out_dir: Path = OUT) -> list[Path]:
    """Run protoc (grpcio-tools) and copy the stubs into `out_dir`. Raises RuntimeError on failure."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={tmp}", f"--pyi_out={tmp}",
             f"--grpc_python_out={tmp}", str(PROTO)]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc}")
        gen = Path(tmp) / "cosine" / "transport"
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for name in GENERATED:
            shutil.copyfile(gen / name, out_dir / name)
            paths.append(out_dir / name)
    return paths


if __name__ == "__main__":
    for p in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT):
        print(p)
