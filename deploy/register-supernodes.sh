#!/usr/bin/env bash
# Register SuperNode public keys with a SuperLink that runs with --enable-supernode-auth
# (docker-compose's `register` service; natively the same with the flwr CLI). Registering is the
# operator's: CONNECTION must reach the SuperLink's own port (127.0.0.1:9093 on the SuperLink's
# host, or through an SSH tunnel to it); the SuperNodes' port (the fleet door, 8000) refuses it.
# A key that is already registered is left as it is, so running this again is harmless.
# (`flwr supernode register --format json` exits 0 even on failure: its "success" decides.)
#   deploy/register-supernodes.sh CONNECTION KEY.pub [KEY.pub ...]
set -euo pipefail
connection=$1
shift
for key in "$@"; do
    output=$(flwr supernode register "$key" "$connection" --format json)
    if grep -q '"success": true' <<<"$output"; then
        echo "registered $key: $(grep -o '"node-id": [0-9]*' <<<"$output")"
    elif grep -q "Public key already in use" <<<"$output"; then
        echo "already registered: $key"
    else
        echo "registering $key failed: $output" >&2
        exit 1
    fi
done
