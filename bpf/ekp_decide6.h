/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_decide6.h: the IPv6 path's order of checks, written once for both hooks that run it: the tc
 * programs (ekp_from_pod6, ekp_from_net6: ekp_main6) and XDP's (ekp_xdp_net6: ekp_xdp_main6), as
 * IPv4's ekp_decide.h is for ekp_tc_apply.h and ekp_xdp_apply.h. `hook` (enum ekp_hook) is a
 * compile-time constant at each entry, so each program holds only its own hook's branches.
 *
 *   an ICMPv6 error         -> not addressed to its quote's source: PASS (no flow's); XDP: to tc;
 *                              tc: the last hop PASS, else conntrack of the quoted flow
 *                              (ekp_tc6_related)
 *   not TCP/UDP/SCTP        -> PASS
 *   the activity check      -> a whole packet no live flow stamped, to no frontend: PASS
 *   XDP: a fragment, SCTP, the last hop, an L4 header out of reach -> to tc
 *   fragments               -> a later one's ports from its first, or held; a first one recorded,
 *                              the held ones put back (ekp_frag6.h, ekp_tc_frag_af.h)
 *   conntrack FORWARD       -> an ended flow's tuple reopened by this packet: on to REPLY (tc; XDP:
 *                              to tc), else a hit
 *   conntrack REPLY         -> a hit
 *   a hit                   -> handed back to nf_conntrack: NFPASS passed, HANDOVER's forward
 *                              packets dropped (ekp_ct6_nf_held, both hooks, as IPv4's);
 *                              XDP: legacy host routing to tc; tc: a source not routed here
 *                              dropped (SPOOFED), the last hop answered (time exceeded);
 *                              XDP: routed before the state moves (to tc unless it leaves by the
 *                              device it came in by); the state moved (ekp_ct_advance; refreshed
 *                              away: NO_FLOW); tc: routed (too big: Packet Too Big); sent
 *   no opening packet, the last hop -> PASS (a UDP datagram's later fragment: its refusal only)
 *   a frontend              -> refusal (tc answers it, XDP drops it or leaves a reject to tc);
 *                              left to ip6tables without the node's address for SNAT; XDP: legacy
 *                              host routing, a host backend to tc
 *   no frontend             -> XDP: PASS; tc: a direct connection on a live flow's tuple
 *                              (ekp_ct6_reclaim) or PASS
 *   tc: a source not routed here -> PASS
 *   the backend             -> chosen (XDP: not remembered yet); SNAT decided; XDP: a local or
 *                              host backend to tc
 *   the route               -> before anything is written (tc: too big answered; XDP: to tc
 *                              unless it leaves by the device it came in by)
 *   the entries             -> ekp_ct6_create (its SNAT port), the early-drop ring; XDP: the
 *                              affinity remembered; sent
 *
 * What XDP cannot finish it hands to tc (XDP_PASS, counted TO_TC) before any side effect (no entry,
 * state, ring or rate-limit token moved), and tc decides it again from the top, in this same order.
 * The application stays at the two places a packet is sent (a hit, a new flow), not after one
 * return: one send site for both made ekp_from_pod6 841,000 instructions (tests/ebpf/
 * test_verifier_cost.py), their states not merging there.
 */
#ifndef EKP_DECIDE6_H
#define EKP_DECIDE6_H

#include "ekp_tc6.h"
#include "ekp_xdp6.h"

/* The verdict that hands a packet on untouched: to the node's stack (tc), to tc (XDP). */
static __always_inline int ekp6_pass(__u8 hook)
{
	return hook == EKP_HOOK_XDP ? XDP_PASS : TC_ACT_OK;
}

static __always_inline int ekp6_drop(__u8 hook)
{
	return hook == EKP_HOOK_XDP ? XDP_DROP : TC_ACT_SHOT;
}

/* A packet the path leaves: tc's to the stack (its outcome as it is), XDP's to tc (TO_TC). */
static __always_inline int ekp6_leave(__u8 hook, __u32 *outcome)
{
	if (hook == EKP_HOOK_XDP)
		*outcome = EKP_STAT_TO_TC;
	return ekp6_pass(hook);
}

static __always_inline __u8 ekp6_counters(__u8 hook)
{
	return hook == EKP_HOOK_XDP ? EKP_COUNT_XDP : EKP_COUNT_TC;
}

#define EKP6_HOOK EKP_HOOK_TC
#define EKP6_DECIDE ekp_decide6_tc
#include "ekp_decide6_hook.h"
#undef EKP6_HOOK
#undef EKP6_DECIDE
#define EKP6_HOOK EKP_HOOK_XDP
#define EKP6_DECIDE ekp_decide6_xdp
#include "ekp_decide6_hook.h"
#undef EKP6_HOOK
#undef EKP6_DECIDE

/* The tc programs' IPv6 path (ekp_from_pod6, ekp_from_net6). */
static __always_inline int ekp_main6(struct __sk_buff *skb, __u8 scope)
{
	return ekp_decide6_tc(skb, scope);
}

/* XDP's IPv6 path (ekp_xdp_net6): the external devices' packets, as ekp_from_net6 sees them. */
static __always_inline int ekp_xdp_main6(struct xdp_md *ctx)
{
	return ekp_decide6_xdp(ctx, EKP_SCOPE_EXTERNAL);
}

#endif /* EKP_DECIDE6_H */
