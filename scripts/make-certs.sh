#!/usr/bin/env bash
# Create everything a TLS deployment with SuperNode authentication needs (no hand steps):
#   ca.crt / ca.key              a private certificate authority (the CLI and every SuperNode trust it)
#   superlink.crt / .key         the SuperLink's server certificate, signed by the CA, with SANs for
#                                127.0.0.1, localhost, the multi-host test's 10.200.0.1 and the
#                                docker-compose service name `superlink` (add more: EXTRA_SANS)
#   supernode-<i> / .pub         one ECDSA P-384 key pair per SuperNode, OpenSSH format: the private
#                                key goes to `flower-supernode --auth-supernode-private-key`, the
#                                public key is registered with `flwr supernode register` (Flower
#                                1.42 dropped the SuperLink's `--auth-list-public-keys` CSV)
#
# Usage: scripts/make-certs.sh [OUT_DIR (default deploy/certs)] [NUM_SUPERNODES (default 2)]
#        EXTRA_SANS="DNS:link.example.org,IP:192.0.2.10" scripts/make-certs.sh ...
# Existing files in OUT_DIR are replaced. Needs openssl and ssh-keygen (openssh-client).
set -euo pipefail

out=${1:-deploy/certs}
num_supernodes=${2:-2}
days=${DAYS:-365}
sans="IP:127.0.0.1,DNS:localhost,IP:10.200.0.1,DNS:superlink${EXTRA_SANS:+,$EXTRA_SANS}"

for tool in openssl ssh-keygen; do
    command -v "$tool" >/dev/null || { echo "make-certs.sh: $tool not found" >&2; exit 1; }
done
mkdir -p "$out"
cd "$out"

# Certificate authority.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-384 -sha384 -nodes -days "$days" \
    -keyout ca.key -out ca.crt -subj "/CN=concatfl CA" 2>/dev/null

# SuperLink certificate: a CSR, then signed by the CA with the SANs and server usage.
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-384 -sha384 -nodes -keyout superlink.key -out superlink.csr \
    -subj "/CN=superlink" 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
    "$sans" > superlink.ext
openssl x509 -req -in superlink.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
    -sha384 -extfile superlink.ext -out superlink.crt 2>/dev/null
rm -f superlink.csr superlink.ext ca.srl

# SuperNode authentication keys (Flower wants a NIST EC curve; P-384 as in Flower's guide).
for ((i = 0; i < num_supernodes; i++)); do
    rm -f "supernode-$i" "supernode-$i.pub"
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "concatfl supernode-$i" -f "supernode-$i"
    chmod 600 "supernode-$i"
done

# Private keys readable by their owner only (SuperNode keys above); the containers' user (uid 49999 in Flower's
# images, `app` in concatfl's Dockerfile) must own the mounted copies.
chmod 600 ca.key superlink.key
openssl verify -CAfile ca.crt superlink.crt >/dev/null
echo "make-certs.sh: CA, SuperLink certificate ($sans) and $num_supernodes SuperNode key pairs in $PWD"
