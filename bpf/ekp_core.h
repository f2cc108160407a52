/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_core.h: the per-packet logic shared by both tc programs; `scope` is a compile-time
 * constant at each call site (EKP_SCOPE_INTERNAL for pod veths, EKP_SCOPE_EXTERNAL for the
 * node's external devices) and only selects the frontend entries.
 *
 *   parse -> conntrack hit?  FORWARD: DNAT (+SNAT)   REPLY: reverse NAT (+un-SNAT)
 *         -> frontend hit?   source ranges, endpoints, backend, SNAT, conntrack, DNAT
 *         -> deliver (fib lookup + redirect)
 *   no endpoints: ICMP port unreachable back out of the ingress device (ekp_icmp.h)
 * Each path sets exactly one outcome stat (see ekp_stats.h).
 */
#ifndef EKP_CORE_H
#define EKP_CORE_H

#include <linux/pkt_cls.h>

#include "ekp_abi.h"
#include "ekp_ct.h"
#include "ekp_icmp.h"
#include "ekp_lb.h"
#include "ekp_maps.h"
#include "ekp_nat.h"
#include "ekp_parse.h"
#include "ekp_redirect.h"
#include "ekp_stats.h"

static __always_inline int ekp_drop(__u32 *outcome, __u32 reason)
{
	*outcome = reason;
	return TC_ACT_SHOT;
}

static __always_inline int ekp_ct_forward(struct __sk_buff *skb, struct ekp_pkt *p,
					  const struct ekp_ct_entry *e, __u32 *outcome)
{
	if (ekp_nat_dst(skb, p, e->nat_addr, e->nat_port) < 0)
		return ekp_drop(outcome, EKP_DROP_MALFORMED);
	if ((e->flags & EKP_CT_SNAT) && ekp_nat_src(skb, p, e->snat_addr, e->snat_port) < 0)
		return ekp_drop(outcome, EKP_DROP_MALFORMED);
	*outcome = EKP_STAT_CT_FORWARD;
	return ekp_deliver(skb, p, outcome);
}

static __always_inline int ekp_ct_reply(struct __sk_buff *skb, struct ekp_pkt *p, const struct ekp_ct_entry *e,
					__u32 *outcome)
{
	struct ekp_revnat_key rk = {};

	rk.id = e->rev_nat_id;
	struct ekp_revnat *rn = ekp_rnat_lookup(&rk);
	if (!rn)
		return ekp_drop(outcome, EKP_DROP_REVNAT_MISSING);
	__be32 fe_addr = rn->addr;
	__be16 fe_port = rn->port;

	if (ekp_nat_src(skb, p, fe_addr, fe_port) < 0)
		return ekp_drop(outcome, EKP_DROP_MALFORMED);
	if ((e->flags & EKP_CT_SNAT) && ekp_nat_dst(skb, p, e->nat_addr, e->nat_port) < 0)
		return ekp_drop(outcome, EKP_DROP_MALFORMED);
	*outcome = EKP_STAT_CT_REPLY;
	return ekp_deliver(skb, p, outcome);
}

/* A frontend with no usable backend (count == 0). NO_ENDPOINTS: kube-proxy's `-j REJECT`, an ICMP
 * port unreachable from the frontend to the client, sent back out of the device the packet came
 * in on (its egress: the pod's veth, or the external wire); counted DROP_NO_ENDPOINTS, the flow
 * is refused. Packets not worth an answer (ekp_icmp_wanted) and skbs that could not be reshaped
 * are dropped under the same counter. LOCAL alone (endpoints exist on other nodes, Local traffic
 * policy): drop, as kube-proxy does. Neither flag (not written by the agent): drop. */
static __always_inline int ekp_no_endpoints(struct __sk_buff *skb, const struct ekp_pkt *p,
					    const struct ekp_frontend *fe, __u32 *outcome)
{
	if (!(fe->flags & EKP_FE_NO_ENDPOINTS)) {
		if (fe->flags & EKP_FE_LOCAL)
			return ekp_drop(outcome, EKP_DROP_NO_LOCAL); /* Local policy: none on this node */
		return ekp_drop(outcome, EKP_DROP_NO_ENDPOINTS);
	}
	if (!ekp_icmp_wanted(p) || ekp_icmp_port_unreach(skb, p) < 0)
		return ekp_drop(outcome, EKP_DROP_NO_ENDPOINTS);
	*outcome = EKP_DROP_NO_ENDPOINTS;
	return bpf_redirect(skb->ifindex, 0);
}

static __always_inline int ekp_new_flow(struct __sk_buff *skb, struct ekp_pkt *p, const struct ekp_frontend *fe,
					const struct ekp_config *cfg, __u64 now, __u32 *outcome)
{
	struct ekp_flow f = {};
	__u32 aff_hit = 0;
	int reason;

	if ((fe->flags & EKP_FE_SOURCE_RANGES) && !ekp_source_allowed(fe->rev_nat_id, p->saddr))
		return ekp_drop(outcome, EKP_DROP_SOURCE_RANGE);
	if (fe->count == 0)
		return ekp_no_endpoints(skb, p, fe, outcome);

	reason = ekp_pick_backend(fe, p, now, &f, &aff_hit);
	if (reason)
		return ekp_drop(outcome, reason);

	f.rev_nat_id = fe->rev_nat_id;
	if ((fe->flags & EKP_FE_SNAT_REMOTE) && !(f.be_flags & EKP_BE_LOCAL))
		f.ct_flags |= EKP_CT_SNAT;
	/* Hairpin: a pod reaching itself through its service would get a packet from its own
	 * address, which its stack drops; like kube-proxy (KUBE-MARK-MASQ for the endpoint's own
	 * source), translate the source to the node so the reply comes back through us. */
	if (p->saddr == f.be_addr)
		f.ct_flags |= EKP_CT_SNAT;
	if (p->tcp_flags & (EKP_TCP_FIN | EKP_TCP_RST))
		f.ct_flags |= EKP_CT_CLOSING;

	reason = ekp_ct_create(p, &f, cfg, now);
	if (reason)
		return ekp_drop(outcome, reason);

	if (ekp_nat_dst(skb, p, f.be_addr, f.be_port) < 0)
		return ekp_drop(outcome, EKP_DROP_MALFORMED);
	if ((f.ct_flags & EKP_CT_SNAT) && ekp_nat_src(skb, p, f.snat_addr, f.snat_port) < 0)
		return ekp_drop(outcome, EKP_DROP_MALFORMED);

	*outcome = EKP_STAT_NEW_FLOWS;
	if (f.ct_flags & EKP_CT_SNAT)
		ekp_count(EKP_STAT_SNAT);
	if (aff_hit)
		ekp_count(EKP_STAT_AFFINITY_HIT);
	return ekp_deliver(skb, p, outcome);
}

static __always_inline int ekp_handle(struct __sk_buff *skb, __u8 scope, __u32 *outcome)
{
	struct ekp_pkt p = {};
	int parsed = ekp_parse(skb, &p);

	*outcome = EKP_STAT_PASS;
	if (parsed == EKP_PARSE_PASS)
		return TC_ACT_OK;
	if (parsed == EKP_PARSE_MALFORMED)
		return ekp_drop(outcome, EKP_DROP_MALFORMED);
	if (parsed == EKP_PARSE_FRAG) /* later fragments could not follow a translation */
		return ekp_frontend_lookup(&p, scope) ? ekp_drop(outcome, EKP_DROP_FRAGMENT) : TC_ACT_OK;
	if (p.ttl <= 1)
		return TC_ACT_OK; /* the stack answers with ICMP time exceeded */

	__u32 zero = 0;
	struct ekp_config *cfgp = ekp_cfg_lookup(&zero);
	if (!cfgp)
		return TC_ACT_OK;
	struct ekp_config cfg = *cfgp;
	__u64 now = bpf_ktime_get_ns();

	struct ekp_ct_key key = {};
	ekp_ct_key_of(&key, &p);
	struct ekp_ct_entry *ct = ekp_ct_lookup(&key);
	if (ct && ekp_ct_usable(ct, &p, &cfg, now)) {
		ekp_ct_touch(ct, &p, now);
		struct ekp_ct_entry e = *ct;
		if (e.dir == EKP_CT_FORWARD)
			return ekp_ct_forward(skb, &p, &e, outcome);
		return ekp_ct_reply(skb, &p, &e, outcome);
	}

	struct ekp_frontend *fep = ekp_frontend_lookup(&p, scope);
	if (!fep) {
		if (p.proto == IPPROTO_TCP && (p.tcp_flags & (EKP_TCP_SYN | EKP_TCP_ACK)) == EKP_TCP_SYN)
			ekp_ct_reclaim(&p, &cfg, now); /* a new direct flow: clear an ended flow's tuple */
		return TC_ACT_OK;
	}
	struct ekp_frontend fe = *fep;
	return ekp_new_flow(skb, &p, &fe, &cfg, now, outcome);
}

static __always_inline int ekp_main(struct __sk_buff *skb, __u8 scope)
{
	__u32 outcome = EKP_STAT_PASS;
	int verdict = ekp_handle(skb, scope, &outcome);

	ekp_count(EKP_STAT_PACKETS);
	ekp_count(outcome);
	return verdict;
}

#endif /* EKP_CORE_H */
