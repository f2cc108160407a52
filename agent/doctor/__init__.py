"""`agent doctor`: a pre-flight of the node for the chosen mode, as a checklist.

    agent doctor [the agent's own flags]

It takes the flags the agent would run with (`--mode`, `--netns`, `--bpf-pin-path`, `--devices`,
`--kubeconfig` / `--master` or `--services-file`, `--config`, ...), looks at the node without
changing anything, and prints one line per check: `ok`, `warn` or `FAIL`, what it found, and for
anything not ok what to do. The exit status is 1 when a line says FAIL, else 0.

The checks (agent/doctor/checks.py, pure) and what they read (agent/doctor/facts.py):

* privileges: the capabilities the mode needs;
* eBPF mode: the kernel release, the BPF program types, map kinds and helpers the data path uses
  (`bpftool feature probe kernel`), BTF, bcc and the kernel headers, the pin path on bpffs,
  cgroup2; iptables mode: the iptables binaries;
* both: IPv4 forwarding in the node's namespace, kube-proxy's rules (either iptables backend) or
  nftables tables still on the node;
* eBPF mode: another program on the tc ingress or XDP hook of the devices the agent attaches to;
* with an API server: reachable, and not through the `kubernetes` Service the agent itself
  programs; eBPF mode: the map entries the API's Services and EndpointSlices need (planned as the
  agent would plan them) against the map sizes;
* the node's nf_conntrack fill against its limit.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from agent.doctor.checks import Verdict, checklist, render


def main(argv: Sequence[str]) -> int:
    from agent.cli import UsageError, resolve

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    try:
        resolved = resolve(argv)
    except UsageError as exc:
        for line in exc.lines:
            print(f"agent doctor: {line}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.ERROR, stream=sys.stderr, format="%(levelname).1s %(name)s: %(message)s"
    )
    from agent.doctor.facts import gather

    facts = gather(resolved.config)
    lines = checklist(facts)
    sys.stdout.write(render(facts, lines))
    return 1 if any(line.verdict is Verdict.FAIL for line in lines) else 0
