#!/usr/bin/env bash
# Build (once) the virtual environment the real-relay test runs the Shepherd Model Gateway's own
# KV-event relay in: smg-grpc-servicer and smg-grpc-proto without their engine dependencies, plus
# exactly what kv_relay.py and load_record.py import. Idempotent: a complete venv is reused.
# Prints the venv's path on its last line.
set -euo pipefail

SERVICER_VERSION="0.14.1"
PROTO_VERSION="0.4.28"
CACHE="${KVROUTE_ENGINES_CACHE:-$HOME/.cache/kvroute-engines}"
VENV="$CACHE/smg-relay-$SERVICER_VERSION-proto-$PROTO_VERSION"
STAMP="$VENV/.kvroute-complete"

if [ -f "$STAMP" ] && "$VENV/bin/python" -c "import smg_grpc_servicer.kv_relay" 2>/dev/null; then
    echo "$VENV"
    exit 0
fi
rm -rf "$VENV"
mkdir -p "$CACHE"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# kv_relay imports grpc, msgspec, zmq (with the relay's asyncio sockets) and the generated protos.
"$VENV/bin/pip" install -q "grpcio>=1.81.1" "protobuf>=6.33.5" "msgspec>=0.18.0" "pyzmq>=25.0.0"
"$VENV/bin/pip" install -q --no-deps "smg-grpc-proto==$PROTO_VERSION" "smg-grpc-servicer==$SERVICER_VERSION"
"$VENV/bin/python" -c "import smg_grpc_servicer.kv_relay, smg_grpc_proto.generated.vllm_engine_pb2"
touch "$STAMP"
echo "$VENV"
