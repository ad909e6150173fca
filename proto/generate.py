"""Regenerate (or check) kvroute's gRPC stubs from the .proto files under ``proto/``.

Usage::

    python proto/generate.py          # write kvroute/_proto/*_pb2.py, *_pb2.pyi, *_pb2_grpc.py
    python proto/generate.py --check  # regenerate into a temp dir; exit 1 naming every drifted file

The .proto files live at ``proto/kvroute/_proto/`` and are compiled with ``-I proto``, so the
generated ``*_pb2_grpc.py`` modules import their messages as ``from kvroute._proto import ...``
and work from inside the installed package.

One post-processing step, deterministic: each ``*_pb2.py`` registers its file in a private
``DescriptorPool`` instead of protobuf's process-wide default pool. kvroute declares messages
under the engines' own package names (``vllm``, ``sglang.runtime.v1``); in the default pool they
would collide ("duplicate symbol") with an engine's own generated code imported in the same process.

Output is byte-for-byte reproducible with the pinned ``grpcio-tools`` (see ``TOOLS_VERSION``).
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_DIR = PROTO_ROOT / "kvroute" / "_proto"
OUT_DIR = ROOT / "kvroute" / "_proto"
# The generated headers embed the protobuf/grpc versions of the tool; pyproject's "test" extra pins it.
TOOLS_VERSION = "1.75.1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
_PRIVATE_POOL = "_descriptor_pool.DescriptorPool().AddSerializedFile("


def _protos() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def _generate(dest: Path) -> list[Path]:
    """Compile every .proto into ``dest`` (mirroring kvroute/_proto/); return the generated files."""
    from grpc_tools import protoc  # type: ignore[import-untyped]  # grpcio-tools ships no type hints

    protos = _protos()
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_DIR}")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={dest}",
        f"--pyi_out={dest}",
        f"--grpc_python_out={dest}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out = dest / "kvroute" / "_proto"
    files = sorted(p for p in out.iterdir() if p.name.endswith(GENERATED_SUFFIXES))
    for path in files:
        if path.name.endswith("_pb2.py"):
            text = path.read_text()
            if text.count(_DEFAULT_POOL) != 1:
                raise SystemExit(f"{path.name}: unexpected protoc output; cannot move it to a private pool")
            path.write_text(text.replace(_DEFAULT_POOL, _PRIVATE_POOL))
    return files


def _committed() -> set[str]:
    return {p.name for p in OUT_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)} if OUT_DIR.is_dir() else set()


def main(argv: list[str] | None = None) -> int:
    """Generate the stubs, or with ``--check`` report drift from the committed ones; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the committed stubs differ")
    args = parser.parse_args(argv)

    installed = metadata.version("grpcio-tools")
    if installed != TOOLS_VERSION:
        print(f"warning: grpcio-tools {installed} installed, stubs are generated with {TOOLS_VERSION}", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        generated = _generate(Path(tmp))
        names = {p.name for p in generated}
        if args.check:
            drifted = sorted(
                p.name
                for p in generated
                if not (OUT_DIR / p.name).is_file() or not filecmp.cmp(p, OUT_DIR / p.name, shallow=False)
            )
            stale = sorted(_committed() - names)
            for name in drifted:
                print(f"drifted: kvroute/_proto/{name}")
            for name in stale:
                print(f"stale (no .proto generates it): kvroute/_proto/{name}")
            if drifted or stale:
                print("run: python proto/generate.py", file=sys.stderr)
                return 1
            print(f"ok: {len(generated)} generated files match")
            return 0
        OUT_DIR.mkdir(exist_ok=True)
        for name in sorted(_committed() - names):
            (OUT_DIR / name).unlink()
        for path in generated:
            shutil.copyfile(path, OUT_DIR / path.name)
            print(f"wrote kvroute/_proto/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
