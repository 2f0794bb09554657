#!/usr/bin/env bash
# Regenerates gen/ from the protos: yieldloop's (../../protos) and google.rpc's status and error details, copied
# from the googleapis-common-protos wheel the Python side already has (the Buf registry is not used).
# Usage: ./generate.sh [OUT_DIR]   (default gen; tests regenerate into a scratch folder and compare)
set -euo pipefail
cd "$(dirname "$0")"
out=$(realpath -m "${1:-gen}")
python=${PYTHON:-python3}
rpc=$("$python" -c 'import google.rpc; print(list(google.rpc.__path__)[0])')
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/third_party/google/rpc"
cp "$rpc/status.proto" "$rpc/error_details.proto" "$scratch/third_party/google/rpc/"
printf 'version: v2\n' > "$scratch/third_party/buf.yaml"
rm -rf "$out"
mkdir -p "$out"
node_modules/.bin/buf generate ../../protos --template buf.gen.yaml -o "$out"
node_modules/.bin/buf generate "$scratch/third_party" --template buf.gen.yaml -o "$out"
