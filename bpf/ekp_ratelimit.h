/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_ratelimit.h: the token bucket that limits the ICMP rejects the data path sends.
 *
 * kube-proxy's `-j REJECT` goes through the kernel's icmp_send, which limits ICMP errors
 * (net.ipv4.icmp_msgs_per_sec / icmp_msgs_burst, and per destination): a node must not answer a
 * flood of spoofed datagrams with as many ICMP messages. Here: one bucket per CPU (a per-CPU
 * array, no lock, no atomics), refilled at cfg.icmp_rate tokens per second up to cfg.icmp_burst;
 * the agent divides the node's sysctls among the CPUs. Over the limit the packet is dropped
 * unanswered and counted (EKP_DROP_ICMP_RATE). Credit is kept in nanoseconds: one message costs
 * 1e9 / rate ns, and time since the last refill adds its own length. Fragmentation-needed
 * messages are not limited (the kernel exempts them too: path-MTU discovery depends on them).
 */
#ifndef EKP_RATELIMIT_H
#define EKP_RATELIMIT_H

#include "ekp_ct.h"
#include "ekp_maps.h"

/* Used when ekp_config holds 0: the kernel's icmp_msgs_per_sec and icmp_msgs_burst. */
#define EKP_DEFAULT_ICMP_RATE 1000
#define EKP_DEFAULT_ICMP_BURST 50

/* Takes one token from this CPU's bucket; 1 when the reject may be sent. */
static __always_inline int ekp_icmp_allowed(const struct ekp_config *cfg, __u64 now)
{
	__u32 zero = 0;
	struct ekp_ratelimit *rl = ekp_icmprl_lookup(&zero);

	if (!rl)
		return 0;
	__u64 cost = EKP_NSEC / ekp_cfg_or(cfg->icmp_rate, EKP_DEFAULT_ICMP_RATE);
	__u64 cap = cost * ekp_cfg_or(cfg->icmp_burst, EKP_DEFAULT_ICMP_BURST);
	__u64 tokens = rl->tokens_ns;

	if (now > rl->last_ns)
		tokens += now - rl->last_ns;
	if (tokens > cap)
		tokens = cap;
	rl->last_ns = now;
	if (tokens < cost) {
		rl->tokens_ns = tokens;
		return 0;
	}
	rl->tokens_ns = tokens - cost;
	return 1;
}

#endif /* EKP_RATELIMIT_H */
