#!/usr/bin/env bash
# Build concatfl's Docker image on a machine that reaches the package registries but maybe not
# Docker Hub. Idempotent and cached: a second run only rebuilds what changed (seconds).
#
#   deploy/build-images.sh            # image concatfl:0.1.0 (override: IMAGE=name:tag)
#
# 1. Base image: BASE_IMAGE (default python:3.11-slim) if it is present or can be pulled; else a
#    Debian bookworm root file system made with debootstrap from Debian's own packages
#    (python3 3.11, python3-venv, ca-certificates, haproxy for the fleet door) and imported as
#    concatfl-base:bookworm-<hash of that package list> (built once per list; `docker rmi` it to
#    rebuild). Needs debootstrap and root.
# 2. Wheelhouse: every wheel the image installs, downloaded on this host with its own pip
#    configuration (index, certificates, find-links) into deploy/wheelhouse/, once per list of
#    dependencies in pyproject.toml. The image build then installs from it with --no-index: no network inside the
#    build at all.
# 3. `docker build --build-arg BASE_IMAGE=...` (layers cached by Docker: the environment is one
#    layer, rebuilt only when pyproject.toml changes; the project's source another).
set -euo pipefail
cd "$(dirname "$0")/.."
image=${IMAGE:-concatfl:0.1.0}
base=${BASE_IMAGE:-python:3.11-slim}
torch_version=${TORCH_VERSION:-2.13.0}
debian_mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# haproxy: the fleet door in front of the SuperLink (deploy/haproxy.cfg); the Dockerfile installs it
# with apt on a base image that lacks it.
base_packages=python3,python3-venv,ca-certificates,haproxy
local_base=concatfl-base:bookworm-$(echo "$base_packages" | sha256sum | cut -c1-8)
python=${PYTHON:-python3}
say() { echo "build-images.sh: $*"; }

docker info >/dev/null 2>&1 || { say "no Docker engine answers (start dockerd)" >&2; exit 1; }

# 1. Base image.
if docker image inspect "$base" >/dev/null 2>&1 || docker pull -q "$base" >/dev/null 2>&1; then
    say "base image $base"
else
    if ! docker image inspect "$local_base" >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || { say "$base cannot be pulled and debootstrap is not installed" >&2; exit 1; }
        say "$base cannot be pulled: building $local_base with debootstrap from $debian_mirror"
        rootfs=$(mktemp -d)
        trap 'rm -rf "$rootfs"' EXIT
        debootstrap --variant=minbase --include="$base_packages" bookworm "$rootfs" "$debian_mirror" >/dev/null
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
            "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
        tar -C "$rootfs" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["bash"]' - "$local_base" >/dev/null
        rm -rf "$rootfs"
        trap - EXIT
    fi
    say "base image $local_base (debootstrap)"
    base=$local_base
fi

# 2. Wheelhouse: the dependencies pyproject.toml declares (test extra and Ray excluded), torch pinned.
wheelhouse=deploy/wheelhouse
stamp=$wheelhouse/.complete
# The same list as the Dockerfile's requirements stage (no Ray): the wheels the image installs.
mapfile -t requirements < <("$python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
    | sed 's/^flwr\[simulation\]/flwr/')
key="$({ printf '%s\n' "${requirements[@]}"; echo "torch==$torch_version"; "$python" --version; } | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$key" ]; then
    say "downloading wheels into $wheelhouse"
    find "$wheelhouse" -name '*.whl' -delete
    "$python" -m pip download --quiet --only-binary=:all: --dest "$wheelhouse" \
        "torch==$torch_version" "${requirements[@]}"
    echo "$key" > "$stamp"
fi
say "$(find "$wheelhouse" -name '*.whl' | wc -l) wheels in $wheelhouse ($(du -sh "$wheelhouse" | cut -f1))"

# 3. The image.
docker build --quiet --build-arg "BASE_IMAGE=$base" --build-arg "TORCH_VERSION=$torch_version" -t "$image" . >/dev/null
say "image $image ($(docker image inspect -f '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}'))"
