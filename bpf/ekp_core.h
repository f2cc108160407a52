/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_core.h: the tc programs' per-packet flow. Ingress (ekp_main) is shared by both ingress
 * programs; `scope` is a compile-time constant at each call site (EKP_SCOPE_INTERNAL for pod
 * veths, EKP_SCOPE_EXTERNAL for the node's external devices) and only selects the frontend
 * entries. Egress (ekp_egress_main) sees what the node's own stack sends out of both kinds of
 * device.
 *
 *   parse (ekp_parse.h) -> decide (ekp_decide.h: lookups, policy, conntrack; no skb access)
 *                       -> apply (ekp_tc_apply.h: rewrite, route, redirect) -> count
 * with fragments that came before their first held instead of applied, and put back into their
 * device before their first fragment is applied (ekp_tc_frag.h).
 *
 * Each packet counts exactly one outcome (see ekp_stats.h): the decision's, or the drop its
 * application ran into.
 */
#ifndef EKP_CORE_H
#define EKP_CORE_H

#include "ekp_decide.h"
#include "ekp_parse.h"
#include "ekp_stats.h"
#include "ekp_tc_apply.h"
#include "ekp_tc_frag.h"
#include "ekp_tc_scratch.h"

/* What a tc program returns for a packet it leaves alone: to the stack (TC_ACT_OK), or, in front of
 * an older generation during an upgrade's hand-over (`handover`: enum ekp_handover_mode, nonzero),
 * on to the older program at the next priority (TC_ACT_UNSPEC: cls_bpf's "no verdict"). */
static __always_inline int ekp_tc_pass(__u32 handover)
{
	return handover ? TC_ACT_UNSPEC : TC_ACT_OK;
}

/* A decision that is a miss of this build's conntrack: nothing to translate (PASS), or a mid-flow
 * segment of a flow it has no entry for (NO_FLOW). In hand-over, the flow may be the older
 * generation's, whose program decides it (its conntrack is carried over into ours meanwhile). */
static __always_inline int ekp_handover_miss(const struct ekp_decision *d)
{
	return (d->action == EKP_ACT_PASS && !d->release) || d->outcome == EKP_DROP_NO_FLOW;
}

/* `handover`: enum ekp_handover_mode; the caller returned at once for EKP_HANDOVER_PASS. */
static __always_inline int ekp_main(struct __sk_buff *skb, __u8 scope, __u32 handover)
{
	struct ekp_tc_scratch *w = ekp_scratch_lookup();

	if (!w) { /* cannot happen: a one-element per-CPU array */
		/* As every ingress TC_ACT_OK: no legacy host routing tag for egress (ekp_host.h). Not
		 * cleared above: MISS mode's TC_ACT_UNSPEC leaves it to an older classid generation. */
		skb->tc_classid = 0;
		return TC_ACT_OK;
	}
	__builtin_memset(&w->work.pkt, 0, sizeof(w->work.pkt));
	int parsed = ekp_parse(skb, &w->work.pkt);

	ekp_decide(&w->work, parsed, scope, EKP_HOOK_TC);
	int verdict;
	struct ekp_decision *d = &w->work.dec;
	if (handover == EKP_HANDOVER_MISS && ekp_handover_miss(d)) {
		/* Counted as passed on: the older program counts what it makes of it. */
		d->outcome = EKP_STAT_PASS;
		verdict = TC_ACT_UNSPEC;
	} else if (d->action == EKP_ACT_HOLD) {
		verdict = ekp_tc_frag_hold(skb, &w->work.pkt, &w->frag, &d->outcome);
	} else if (d->release && ekp_tc_frag_release(skb, &w->work.pkt, &w->frag) < 0) {
		d->outcome = EKP_DROP_MALFORMED; /* the first fragment could not be put back together */
		verdict = TC_ACT_SHOT;
	} else {
		verdict = ekp_tc_apply(skb, w, scope);
	}

	ekp_count(EKP_STAT_PACKETS);
	ekp_count(w->work.dec.outcome);
	ekp_count_marks(w->work.dec.marks);
	return verdict;
}

/* tc egress (ekp_egress), one program for two kinds of packet:
 *   tagged (skb->tc_index, legacy host routing): a packet an ingress program handed to the stack
 *     gets the source it decided (ekp_host_egress); counted at ingress already;
 *   the node's own (no skb_iif): parsed and decided (ekp_decide_local): the replies of flows
 *     handed to its stack (a backend on the node's own address, either host routing) get their
 *     frontend back. Only the packets it translates are counted (PACKETS and their outcome): the
 *     node's own traffic is not the data path's.
 * Every other packet (forwarded, redirected: it carries the device it came in by) leaves at once,
 * after two loads. */
static __always_inline int ekp_egress_main(struct __sk_buff *skb, __u32 handover)
{
	__u16 tag = skb->tc_index;

	if (tag)
		return ekp_host_egress(skb, tag);
	if (skb->ingress_ifindex)
		return ekp_tc_pass(handover);
	struct ekp_tc_scratch *w = ekp_scratch_lookup();
	if (!w)
		return TC_ACT_OK; /* cannot happen: a one-element per-CPU array */
	__builtin_memset(&w->work.pkt, 0, sizeof(w->work.pkt));
	int parsed = ekp_parse(skb, &w->work.pkt);

	ekp_decide_local(&w->work, parsed);
	struct ekp_decision *d = &w->work.dec;
	if (d->action == EKP_ACT_PASS)
		return ekp_tc_pass(handover); /* in hand-over: the older egress program's reply, maybe */
	int verdict = ekp_tc_apply_local(skb, w);
	ekp_count(EKP_STAT_PACKETS);
	ekp_count(d->outcome);
	ekp_count_marks(d->marks);
	return verdict;
}

#endif /* EKP_CORE_H */
