#!/usr/bin/env bash
# Regenerates gen/ from ../../protos (buf from clients/typescript's dev dependencies; the plugins from Debian's
# protoc-gen-go and protoc-gen-go-grpc). Usage: ./generate.sh [OUT_DIR]   (default: this folder)
set -euo pipefail
cd "$(dirname "$0")"
out=$(realpath -m "${1:-.}")
rm -rf "$out/gen"
mkdir -p "$out"
../typescript/node_modules/.bin/buf generate ../../protos --template buf.gen.yaml -o "$out"
