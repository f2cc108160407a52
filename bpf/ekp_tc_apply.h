/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc_apply.h: carrying out a decision (ekp_decide.h) on a tc skb.
 *
 *   PASS      TC_ACT_OK
 *   DROP      TC_ACT_SHOT
 *   REJECT    the skb becomes an ICMP port unreachable (ekp_icmp.h), redirected out of the device
 *             it came in on
 *   TRANSLATE route the translated tuple (bpf_fib_lookup, before any byte changes), then
 *             bpf host routing: rewrite, TTL - 1, redirect (ekp_redirect.h);
 *             legacy host routing (EKP_CFG_HOST_LEGACY): the destination now, the source at
 *             egress, through the node's stack (ekp_host.h);
 *             either routing, to a backend on the node's own address (d->host): rewrite, and the
 *             node's stack delivers it (its replies leave through ekp_egress)
 *   RELATED   an ICMP error: outer and quoted headers rewritten and redirected, with either host
 *             routing (the stack's conntrack would not know the quoted flow); one going to a
 *             backend on the node's own address (d->host) is rewritten and delivered by the stack
 *
 * The only difference between the two host routings is here, in the apply step: decide is shared.
 * A packet from a pod that this step redirects skips the node's reverse-path filter, so it first
 * passes the same check (ekp_source_routed_here: the route back to its source leaves by the pod's
 * device); one that fails drops as EKP_DROP_SPOOFED. Packets handed to the stack (legacy host
 * routing, d->host) meet the node's own rp_filter instead.
 *
 * The route lookup says "fragmentation needed" when the packet, or each segment of a GSO skb, is
 * too big for the route's MTU (ekp_seg_len). With DF set the sender is told with an ICMP fragmentation needed carrying the MTU
 * (EKP_DROP_FRAG_NEEDED), quoting the packet before translation, so path-MTU discovery works
 * through a ClusterIP or NodePort exactly as through a router. Without DF the packet is
 * translated and handed to the stack, which fragments it on its way (a packet source-translated
 * to the node's own address is then dropped by the stack as a martian: such a sender is lost as
 * it would be behind a router that cannot fragment).
 */
#ifndef EKP_TC_APPLY_H
#define EKP_TC_APPLY_H

#include <linux/pkt_cls.h>

#include "ekp_decide.h"
#include "ekp_host.h"
#include "ekp_icmp.h"
#include "ekp_nat.h"
#include "ekp_redirect.h"
#include "ekp_tc_scratch.h"

static __always_inline int ekp_tc_drop(struct ekp_decision *d, __u32 reason)
{
	d->outcome = reason;
	return TC_ACT_SHOT;
}

static __always_inline int ekp_tc_apply(struct __sk_buff *skb, struct ekp_tc_scratch *w, __u8 scope)
{
	const struct ekp_pkt *p = &w->work.pkt;
	struct ekp_decision *d = &w->work.dec;

	skb->tc_classid = 0; /* no tag for egress unless the host routing sets one (ekp_host.h) */
	if (d->action == EKP_ACT_PASS)
		return TC_ACT_OK;
	if (d->action == EKP_ACT_DROP)
		return TC_ACT_SHOT;
	if (d->action == EKP_ACT_REJECT) {
		if (ekp_icmp_unreach(skb, p, ICMP_PORT_UNREACH, 0, &w->icmp) < 0)
			return TC_ACT_SHOT;
		return bpf_redirect(skb->ifindex, 0);
	}

	int related = d->action == EKP_ACT_RELATED;
	if (d->host) {
		/* A backend on this node's own address: the stack delivers it (no route to look up,
		 * no TTL to spend) and its replies leave through ekp_egress, which translates them; an
		 * ICMP error about the flow goes to the same stack, which finds the backend's socket by
		 * the quote (a route lookup would only say "local" and drop it). */
		int rewritten = related ? ekp_rewrite_icmp_err(skb, p, d->saddr, d->daddr, d->in_saddr, d->in_sport,
							       d->in_daddr, d->in_dport)
					: ekp_rewrite(skb, p, d->saddr, d->sport, d->daddr, d->dport);
		if (rewritten < 0)
			return ekp_tc_drop(d, EKP_DROP_MALFORMED);
		return TC_ACT_OK;
	}
	const struct ekp_config *cfg = ekp_config_get();
	int legacy = !related && cfg && (cfg->flags & EKP_CFG_HOST_LEGACY);
	struct bpf_fib_lookup *fib = &w->fib;
	if (scope == EKP_SCOPE_INTERNAL && !legacy && !ekp_source_routed_here(skb, p, fib))
		return ekp_tc_drop(d, EKP_DROP_SPOOFED);
	__builtin_memset(fib, 0, sizeof(*fib));
	/* An ICMP error about a flow is not checked against the route's MTU (tot_len 0): nothing
	 * answers it when too big, and a router forwards it whole, so one between a learnt path MTU
	 * (552 at least) and the 576 bytes Linux sends would be dropped here. */
	long rc = related ? ekp_fib(skb, fib, IPPROTO_ICMP, p->tos, d->saddr, d->daddr, 0, 0, 0)
			  : ekp_fib(skb, fib, p->proto, p->tos, d->saddr, d->daddr, d->sport, d->dport,
				    ekp_seg_len(skb, p));

	if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED && !related) {
		if (p->df) {
			__u16 mtu = fib->mtu_result;
			if (!ekp_icmp_wanted(p) || ekp_icmp_unreach(skb, p, ICMP_FRAG_NEEDED, mtu, &w->icmp) < 0)
				return ekp_tc_drop(d, EKP_DROP_FRAG_NEEDED);
			d->outcome = EKP_DROP_FRAG_NEEDED;
			return bpf_redirect(skb->ifindex, 0);
		}
		if (legacy)
			/* the stack fragments it on its way */
			return ekp_host_hand_over(skb, p, d->saddr, d->sport, d->daddr, d->dport, &d->outcome);
		if (ekp_rewrite(skb, p, d->saddr, d->sport, d->daddr, d->dport) < 0)
			return ekp_tc_drop(d, EKP_DROP_MALFORMED);
		return TC_ACT_OK; /* the stack fragments it */
	}
	if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH) {
		/* NOT_FWDED means no route or a local destination (a backend on a node address that the
		 * agent did not mark EKP_BE_HOST: an address it does not know as the node's); also
		 * unreachable, blackhole, forwarding disabled on the ingress device. */
		return ekp_tc_drop(d, EKP_DROP_FIB);
	}
	if (legacy)
		return ekp_host_hand_over(skb, p, d->saddr, d->sport, d->daddr, d->dport, &d->outcome);
	int rewritten = related ? ekp_rewrite_icmp_err(skb, p, d->saddr, d->daddr, d->in_saddr, d->in_sport,
						       d->in_daddr, d->in_dport)
				: ekp_rewrite(skb, p, d->saddr, d->sport, d->daddr, d->dport);
	if (rewritten < 0)
		return ekp_tc_drop(d, EKP_DROP_MALFORMED);
	return ekp_redirect(skb, p, fib, rc, &d->outcome);
}

/* Carries out a decision about a packet the node's own stack sends (ekp_decide_local) at tc egress:
 * rewritten where it is, the stack has routed it already. */
static __always_inline int ekp_tc_apply_local(struct __sk_buff *skb, struct ekp_tc_scratch *w)
{
	const struct ekp_pkt *p = &w->work.pkt;
	struct ekp_decision *d = &w->work.dec;
	int rewritten;

	if (d->action == EKP_ACT_TRANSLATE)
		rewritten = ekp_rewrite(skb, p, d->saddr, d->sport, d->daddr, d->dport);
	else if (d->action == EKP_ACT_RELATED)
		rewritten = ekp_rewrite_icmp_err(skb, p, d->saddr, d->daddr, d->in_saddr, d->in_sport, d->in_daddr,
						 d->in_dport);
	else
		return d->action == EKP_ACT_DROP ? TC_ACT_SHOT : TC_ACT_OK;
	if (rewritten < 0)
		return ekp_tc_drop(d, EKP_DROP_MALFORMED);
	return TC_ACT_OK;
}

#endif /* EKP_TC_APPLY_H */
