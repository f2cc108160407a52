# The ebpf-kube-proxy agent image: Debian 12 (bookworm) slim, bcc from Debian (python3-bpfcc,
# LLVM inside libbcc), bpftool, iptables with both backends (iptables-nft and iptables-legacy),
# nftables, conntrack, iproute2, procps (sysctl), and the agent from this repository in a
# virtualenv that also sees Debian's bcc module.
#
#   docker build -t REGISTRY/ebpf-kube-proxy:0.1.0 .
#
# Kernel headers are not in the image: bcc compiles the data path at start against the running
# kernel's headers, which it looks for at /lib/modules/$(uname -r)/build (and .../source). The
# Helm chart mounts the host's /lib/modules and /usr/src read-only, which is where distributions
# install them (linux-headers-*: build -> /usr/src/linux-headers-<release>). Install the headers
# package of the node's kernel on every node. When they are missing the agent refuses to start
# in eBPF mode with one line saying so ("no kernel headers at /lib/modules/<release>/build: ...
# install linux-headers ... or run --mode=iptables"); iptables mode needs no headers.
#
# Reproducible: the base image is pinned to a Debian point release (replace the tag with its
# digest, debian:12.11-slim@sha256:..., when publishing), apt installs without recommends and
# leaves no lists or caches, and pip installs requirements/agent.lock (exact versions and hashes,
# the ones `make test` ran: `make lock` writes it) without a cache, then the agent without resolving
# anything.
ARG DEBIAN_IMAGE=debian:12.11-slim
FROM ${DEBIAN_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-venv python3-bpfcc \
      bpftool iptables nftables conntrack iproute2 procps util-linux \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/* /var/log/apt /var/log/dpkg.log

# --system-site-packages: bcc is Debian's (/usr/lib/python3/dist-packages/bcc), not on PyPI.
COPY pyproject.toml README.md requirements/agent.lock /src/
COPY agent /src/agent
RUN python3 -m venv --system-site-packages /opt/ebpf-kube-proxy/venv \
 && /opt/ebpf-kube-proxy/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
      --require-hashes -r /src/agent.lock \
 && /opt/ebpf-kube-proxy/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
      --no-deps --no-build-isolation /src \
 && rm -rf /src /root/.cache

# The C of the data path, compiled by bcc at start (agent/ebpf/loader.py reads EKP_BPF_DIR).
COPY bpf /opt/ebpf-kube-proxy/bpf

ENV PATH=/opt/ebpf-kube-proxy/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    EKP_BPF_DIR=/opt/ebpf-kube-proxy/bpf \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

ENTRYPOINT ["agent"]
CMD ["--help"]
