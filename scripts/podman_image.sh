#!/usr/bin/env bash
# Builds a local podman image that can run mirage workloads, without any container registry:
# a Debian 12 rootfs (debootstrap --variant=minbase bookworm) with the image's own Python 3.11,
# CPU torch (the same wheel this machine's pip installs) and a C++ toolchain, imported with
# `podman import`. mirage itself is NOT in the image: it is bind-mounted from the host checkout.
#
#   scripts/podman_image.sh [NAME] [--rebuild]      (NAME defaults to localhost/mirage-node:test)
#   scripts/podman_image.sh --install-only          podman and runc from Debian, no image (tests/test_image.py's
#                                                   refusals use the real podman; ~30 MB, ~20 s)
#
# Env: TORCH_VERSION (2.13.0), TORCH_WHEEL (a .whl path; else looked up in pip's find-links),
#      DEBIAN_MIRROR (else the host's apt source, else http://deb.debian.org/debian),
#      MIRAGE_IMAGE_CACHE (~/.cache/mirage/images; the rootfs tarball is cached there).
# Idempotent: does nothing if NAME exists (unless --rebuild); re-imports the cached tarball if
# only the image is missing. Needs root (debootstrap, chroot, podman's root storage).
#
# Why the image has g++, python3-dev and ninja: mirage's shim and NCCL backend are built with
# torch.utils.cpp_extension, keyed by the torch install path and sys.version, which differ from
# the host's venv (Debian's 3.11.2, /usr/local/lib/python3.11/dist-packages/torch), so the
# container builds its own copies (once, into the bind-mounted ~/.cache/mirage, next to the
# host's). The host's libraries cannot be reused: they are linked (rpath) to the host's libtorch.
#
# Findings on this sandbox (Debian 12, podman 4.3.1 from Debian, kernel 6.18, cgroup v1 "hybrid",
# root without CAP_SYS_RESOURCE, no systemd) -- details and measurements in docs/podman-notes.md:
#   * Storage: the default overlay driver (kernel overlayfs, /var/lib/containers/storage) works
#     as root; no storage.conf, no --storage-driver vfs, no fuse-overlayfs needed.
#   * Runtime: crun fails ("cgroups in hybrid mode not supported", even with --cgroups=disabled);
#     runc works (install it: Debian's podman does not pull it in) with podman's default
#     cgroupfs manager; runc refuses --cgroups=disabled, so leave cgroups alone.
#   * Rlimits: podman's default nofile/nproc (1048576) are above this host's hard limits and root
#     cannot raise them (no CAP_SYS_RESOURCE): give --ulimit nofile=H:H --ulimit nproc=P:P with
#     H = `ulimit -Hn`, P = min(`ulimit -Hu`, 32768) (podman lowers its own nproc to 32768);
#     `--ulimit host` and `-1` fail the same way in 4.3.1.
#   * The argv that joins a namespace holder's node (PID) and works for mirage:
#       podman --runtime runc run --rm -i --ulimit nofile=H:H --ulimit nproc=P:P \
#         --pid host --cap-add SYS_PTRACE \
#         --network ns:/proc/PID/ns/net --uts ns:/proc/PID/ns/uts --ipc ns:/proc/PID/ns/ipc \
#         -v NODE_SHM_DIR:/dev/shm -v HOSTS_FILE:/etc/hosts:ro -v MIRAGE:MIRAGE:ro \
#         -v ~/.cache/mirage:~/.cache/mirage -v SESSION_DIR:SESSION_DIR -v CWD:CWD -w CWD \
#         --env-file FILE -e PYTHONPATH=MIRAGE IMAGE argv...
#     SYS_PTRACE: without it /proc/<host pid>/fd/<n> (memfds of processes outside) gives EACCES.
#     The mount namespace cannot be joined, and `-v /proc/PID/root/dev/shm:/dev/shm` fails
#     (EINVAL: a mount of another mount namespace): /dev/shm must be a host path.
#   * Exit codes are the workload's (SIGKILL -> 137); SIGTERM to `podman run` reaches the
#     workload; SIGKILL to `podman run` does not (kill the workload's host pid). Start: ~0.15 s.
set -euo pipefail

NAME=localhost/mirage-node:test
REBUILD=0
INSTALL_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --rebuild) REBUILD=1 ;;
        --install-only) INSTALL_ONLY=1 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "unknown option: $arg" >&2; exit 2 ;;
        *) NAME=$arg ;;
    esac
done

TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CACHE=${MIRAGE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mirage/images}
TARBALL=$CACHE/mirage-node-bookworm-torch$TORCH_VERSION.tar
START=$SECONDS

if [ "$(id -u)" != 0 ]; then
    echo "podman_image.sh: needs root (debootstrap, chroot, root podman storage)" >&2
    exit 1
fi

need_pkgs=()
command -v podman >/dev/null || need_pkgs+=(podman conmon catatonit)
command -v runc >/dev/null || need_pkgs+=(runc)   # crun refuses this host's hybrid cgroups
[ "$INSTALL_ONLY" = 1 ] || command -v debootstrap >/dev/null || need_pkgs+=(debootstrap)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    echo "== installing ${need_pkgs[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi
[ "$INSTALL_ONLY" = 0 ] || exit 0

if [ "$REBUILD" = 0 ] && podman image exists "$NAME"; then
    echo "== image $NAME exists (use --rebuild to build it again)"
    exit 0
fi

find_torch_wheel() {
    if [ -n "${TORCH_WHEEL:-}" ]; then echo "$TORCH_WHEEL"; return; fi
    local dirs=() pip
    pip=$(command -v pip3 || command -v pip || true)
    # pip's find-links, from the environment and pip's config files (global/user/site)
    for link in ${PIP_FIND_LINKS:-} $( [ -n "$pip" ] && "$pip" config list 2>/dev/null \
            | sed -n "s/^[^=]*find-links='\(.*\)'$/\1/p" ) /opt/wheels; do
        dirs+=("${link#file://}")
    done
    for dir in "${dirs[@]}"; do
        for whl in "$dir"/torch-"$TORCH_VERSION"*cpu*-cp311-cp311-*linux*x86_64.whl \
                   "$dir"/torch-"$TORCH_VERSION"-cp311-cp311-*linux*x86_64.whl; do
            if [ -f "$whl" ]; then echo "$whl"; return; fi
        done
    done
}

if [ "$REBUILD" = 1 ] || [ ! -f "$TARBALL" ]; then
    mkdir -p "$CACHE"
    MIRROR=${DEBIAN_MIRROR:-$(sed -n 's/^URIs: *\(http[^ ]*debian\)\/\{0,1\} *$/\1/p' \
        /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)}
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
    WHEEL=$(find_torch_wheel)
    if [ -z "$WHEEL" ]; then
        # Not on disk: fetch the CPU wheel from PyTorch's index (a plain `torch` from PyPI would
        # be the multi-GB CUDA build).
        WHEEL_DIR=$(mktemp -d)
        pip3 download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
            --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH_VERSION" -d "$WHEEL_DIR"
        WHEEL=$(ls "$WHEEL_DIR"/torch-*.whl)
    fi
    echo "== torch wheel: $WHEEL"
    echo "== debian mirror: $MIRROR"
    WORK=$(mktemp -d /var/tmp/mirage-rootfs.XXXXXX)
    trap 'rm -rf "$WORK"' EXIT
    ROOT=$WORK/rootfs
    # Everything runs in a private mount namespace: the /proc, /sys and wheel bind mounts made
    # by debootstrap and by us vanish with it, even if the build fails half-way.
    unshare --mount --propagation private bash -euo pipefail -s "$ROOT" "$MIRROR" "$WHEEL" "$TORCH_VERSION" "$CACHE/debs" <<'BUILD'
ROOT=$1 MIRROR=$2 WHEEL=$3 TORCH_VERSION=$4 DEBS=$5
t0=$SECONDS
echo "== debootstrap bookworm (minbase) into $ROOT"
mkdir -p "$DEBS"
debootstrap --variant=minbase --cache-dir="$DEBS" \
    --include=python3,python3-pip,python3-dev,g++,ninja-build,ca-certificates \
    bookworm "$ROOT" "$MIRROR" > "$ROOT.debootstrap.log" 2>&1 \
    || { tail -n 30 "$ROOT.debootstrap.log"; exit 1; }
echo "   debootstrap: $((SECONDS - t0)) s"
t0=$SECONDS
mkdir -p "$ROOT/wheels"
mount --bind "$(dirname "$WHEEL")" "$ROOT/wheels"
mount -t proc proc "$ROOT/proc"
cp /etc/resolv.conf "$ROOT/etc/resolv.conf"   # pip fetches torch's pure-Python deps from PyPI
# ... through the host's CA bundle (this sandbox's HTTPS proxy signs with its own CA) and proxy
cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$ROOT/tmp/host-ca.crt"
echo "== pip install torch==$TORCH_VERSION (wheel from $(dirname "$WHEEL"))"
chroot "$ROOT" env -i PATH=/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/tmp/host-ca.crt \
    ${http_proxy:+http_proxy=$http_proxy} ${https_proxy:+https_proxy=$https_proxy} \
    ${HTTP_PROXY:+HTTP_PROXY=$HTTP_PROXY} ${HTTPS_PROXY:+HTTPS_PROXY=$HTTPS_PROXY} \
    python3 -m pip install --quiet --no-cache-dir --break-system-packages --root-user-action=ignore \
    "/wheels/$(basename "$WHEEL")" numpy
chroot "$ROOT" python3 -c 'import torch; print("   torch", torch.__version__, "imports in the rootfs")'
umount "$ROOT/proc" "$ROOT/wheels"
rmdir "$ROOT/wheels"
rm -f "$ROOT/tmp/host-ca.crt"
echo "   pip: $((SECONDS - t0)) s"
# Slimming: apt's caches and lists, docs, man pages, locales other than C. Bytecode stays: each
# container starts from the image, so .pyc files written at run time are lost with it (without
# them `import torch` takes ~3.7 s instead of ~2 s).
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/debconf/*-old "$ROOT"/usr/share/doc/* \
    "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* "$ROOT"/var/log/*.log "$ROOT"/root/.cache
find "$ROOT/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} +
: > "$ROOT/etc/resolv.conf"   # podman writes the container's own
echo "mirage-node" > "$ROOT/etc/hostname"
BUILD
    echo "== packing the rootfs into $TARBALL"
    tar --numeric-owner --xattrs -C "$ROOT" -cf "$TARBALL.partial" .
    mv "$TARBALL.partial" "$TARBALL"
    rm -rf "$WORK"
    trap - EXIT
fi

echo "== podman import $TARBALL $NAME"
OLD_ID=$(podman image inspect --format '{{.Id}}' "$NAME" 2>/dev/null || true)
podman import --change 'CMD ["/bin/bash"]' --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' "$TARBALL" "$NAME" >/dev/null
# The old image lost its name to the new one; drop it unless a container still uses it.
[ -n "$OLD_ID" ] && podman rmi "$OLD_ID" >/dev/null 2>&1 || true
# The flags every `podman run` needs here (see the header): runc, and rlimits no higher than
# podman's own (it lowers its RLIMIT_NPROC to 32768; no CAP_SYS_RESOURCE to raise them back).
hard() { local v; v=$(ulimit -H "$1"); [ "$v" = unlimited ] && v=$2; [ "$v" -gt "$2" ] && v=$2; echo "$v"; }
NOFILE=$(hard -n 1048576) NPROC=$(hard -u 32768)
podman --runtime runc run --rm --network none --ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC" \
    "$NAME" python3 -c 'import torch; print("== torch", torch.__version__, "runs in the image")'
echo "== built $NAME: $(podman image inspect --format '{{.Size}}' "$NAME" | awk '{printf "%.0f MB", $1/1e6}'), in $((SECONDS - START)) s"
