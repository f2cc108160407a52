"""Errors that decide how the agent reacts: retry, or stop with one message.

`FatalError`: a condition no retry can fix (a pin path that is not on bpffs, iptables mode without
root, another agent holding the node's lock, a pin directory owned by someone else). The agent logs
the message once and exits non-zero; the message says what is wrong and what to do. Anything else
raised by a sync is transient: the runner retries it with backoff.
"""

from __future__ import annotations


class FatalError(RuntimeError):
    """The agent cannot run until an operator acts; `str(exc)` says what to do."""
