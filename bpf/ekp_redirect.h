/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_redirect.h: delivering a translated packet without the node's IP stack.
 *
 * Handing a half-translated packet to the stack runs into martian / rp_filter checks and
 * netfilter's INVALID state (see ENVIRONMENT.md), so we route it ourselves: bpf_fib_lookup from
 * the ingress device (needs forwarding enabled on it), then bpf_redirect with the neighbour's
 * MAC, or bpf_redirect_neigh when the neighbour is not resolved yet.
 */
#ifndef EKP_REDIRECT_H
#define EKP_REDIRECT_H

#include <linux/pkt_cls.h>

#include "ekp_nat.h"
#include "ekp_parse.h"

#ifndef AF_INET
#define AF_INET 2
#endif

/* bcc 0.26 declares bpf_redirect_neigh with 3 arguments; the kernel's helper takes 4. */
static long (*ekp_redirect_neigh)(__u32 ifindex, struct bpf_redir_neigh *params, int plen,
				  __u64 flags) = (void *)BPF_FUNC_redirect_neigh;

/* Returns the TC verdict; turns *outcome into EKP_DROP_FIB (or MALFORMED) on failure. */
static __always_inline int ekp_deliver(struct __sk_buff *skb, struct ekp_pkt *p, __u32 *outcome)
{
	struct bpf_fib_lookup fib = {};

	fib.family = AF_INET;
	fib.tos = p->tos;
	fib.l4_protocol = p->proto;
	fib.sport = p->sport;
	fib.dport = p->dport;
	/* tot_len stays 0: the kernel then checks the skb against the egress MTU the GSO-aware way;
	 * a non-zero tot_len compares it with the route MTU and fails every GRO-merged packet. */
	fib.ipv4_src = p->saddr;
	fib.ipv4_dst = p->daddr;
	fib.ifindex = skb->ingress_ifindex;

	long rc = bpf_fib_lookup(skb, &fib, sizeof(fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH) {
		/* NOT_FWDED means no route *or* a local destination (a backend on the node's own
		 * address); the stack could deliver the latter, but its reply would leave without
		 * reverse NAT, so both drop until host-network backends are handled. Also
		 * unreachable, blackhole, forwarding disabled on the ingress device, MTU. */
		*outcome = EKP_DROP_FIB;
		return TC_ACT_SHOT;
	}
	if (ekp_dec_ttl(skb, p) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {};
		nh.nh_family = AF_INET;
		nh.ipv4_nh = fib.ipv4_dst; /* the gateway when the route has one */
		return ekp_redirect_neigh(fib.ifindex, &nh, sizeof(nh), 0);
	}
	if (bpf_skb_store_bytes(skb, 0, fib.dmac, ETH_ALEN, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, fib.smac, ETH_ALEN, 0) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	return bpf_redirect(fib.ifindex, 0);
}

#endif /* EKP_REDIRECT_H */
