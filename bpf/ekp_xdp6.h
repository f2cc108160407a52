/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_xdp6.h: the XDP program's IPv6 path (ekp_xdp_net6), reached from ekp_xdp_net by a tail call
 * (ekp_xcalls6, ekp_tc.c) as the tc programs reach theirs, so IPv4's XDP verification and
 * per-packet work stay as they were. Loaded and filled only where the tc programs' IPv6 path is
 * (MapSizes.ipv6_tc): what it leaves to tc, ekp_from_net6 must be there to take; and only where
 * XDP attaches and the kernel has bpf_xdp_load_bytes (5.18: agent/ebpf/programs.py XDP6_NEEDS).
 *
 *   parse (ekp_parse6.h, from the XDP buffer) -> decide (ekp_tc6.h's pieces: the activity check,
 *   conntrack FORWARD then REPLY, the frontend's refusal, the backend, the source translation, the
 *   entries and SNAT port of ekp_ct6_create) -> route -> rewrite and XDP_TX -> count (ekp_xstats_v3)
 *
 * What it finishes itself, as IPv4's XDP (ekp_xdp.h): drops (source ranges, no local endpoint, a
 * full SNAT range or table), and the flows between an outside client and a backend on another
 * node, both ways, whenever the route of the translated tuple leaves by the device the packet
 * came in by with its neighbour known (BPF_FIB_LKUP_RET_SUCCESS). The rewrite: addresses and ports,
 * the L4 checksum (RFC 1624, on the bytes: see ekp_xdp_apply.h for why a lab's links must compute
 * theirs), hop limit - 1 (IPv6 has no header checksum), the route's MACs.
 * Everything else passes to ekp_from_net6 untouched, BEFORE any side effect (no conntrack entry,
 * state or early-drop ring moved, no rate-limit token), counted TO_TC: fragments, ICMPv6 errors,
 * SCTP, the last hop (hop limit 1: the answer is built on the skb), a refusal tc answers with an
 * ICMPv6 error (no endpoints), a frontend with a backend on the node's own address or asking a
 * source translation while the node's IPv6 address is not known, a chosen backend that is local
 * (a pod's veth) or the node's, legacy host routing's translations, a SYN reopening an ended
 * flow's tuple, any other route result, an L4 header past the buffer's linear part. The backend's
 * choice is remembered (affinity) only past the route, where XDP will carry the flow out (IPv4's
 * XDP writes it at the choice, also for a local backend it leaves to tc).
 * A packet of no live flow and no frontend (a direct connection's reclaim is tc's) and a mid-flow
 * segment without an entry (ip6tables' flow) leave as PASS.
 */
#ifndef EKP_XDP6_H
#define EKP_XDP6_H

#include "ekp_stats.h"
#include "ekp_tc6.h"
#include "ekp_xdp_apply.h"

/* The furthest L4 header XDP rewrites: four extension headers of 64 bytes past the IPv6 header
 * (the rewrite needs a bound the verifier can check; a longer chain goes to tc). */
#define EKP_XDP6_L4_MAX (ETH_HLEN + sizeof(struct ipv6hdr) + 256)

static __always_inline int ekp_xdp6_to_tc(__u32 *outcome)
{
	*outcome = EKP_STAT_TO_TC;
	return XDP_PASS;
}

/* Whether the rewrite can reach the packet's IPv6 and L4 headers in the buffer's linear part:
 * asked before any side effect, so the rewrite after the entries are written cannot fail. */
static __always_inline int ekp_xdp6_reachable(struct xdp_md *ctx, const struct ekp_pkt6 *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 off = p->b.l4_off;
	__u32 need = p->b.proto == IPPROTO_TCP ? sizeof(struct tcphdr) : sizeof(struct udphdr);

	return off >= ETH_HLEN + sizeof(struct ipv6hdr) && off <= EKP_XDP6_L4_MAX && data + off + need <= data_end;
}

/* The route of the translated tuple from the ingress device: 1 when it goes back out of that
 * device with its neighbour resolved (w->fib holds the MACs), else 0 (tc's: NO_NEIGH, another
 * device, too big, no route). */
static __always_inline int ekp_xdp6_route(struct xdp_md *ctx, struct ekp_tc6_scratch *w, const __be32 *sa,
					  __be16 sp, const __be32 *da, __be16 dp)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ipv6hdr *ip = data + ETH_HLEN;

	if ((void *)(ip + 1) > data_end)
		return 0;
	/* XDP frames are never GRO-merged: the header's length is the packet's (the MTU check) */
	__u16 tot_len = sizeof(*ip) + ntohs(ip->payload_len);
	long rc = ekp_fib6_from(ctx, ctx->ingress_ifindex, &w->fib, &w->pkt, sa, da, sp, dp, tot_len);

	return rc == BPF_FIB_LKUP_RET_SUCCESS && w->fib.ifindex == ctx->ingress_ifindex;
}

/* Rewrites the packet to the translated tuple along the route in w->fib and sends it back out.
 * XDP_TX, or XDP_PASS (TO_TC) when a header is out of reach (ekp_xdp6_reachable said it is not). */
static __always_inline int ekp_xdp6_send(struct xdp_md *ctx, struct ekp_tc6_scratch *w, const __be32 *sa,
					 __be16 sp, const __be32 *da, __be16 dp, __u32 *outcome)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct ipv6hdr *ip = data + ETH_HLEN;

	if ((void *)(ip + 1) > data_end)
		return ekp_xdp6_to_tc(outcome);
	__u64 off = w->pkt.b.l4_off;
	asm volatile("" : "+r"(off)); /* keeps LLVM from reading it again after the test */
	if (off < ETH_HLEN + sizeof(*ip) || off > EKP_XDP6_L4_MAX)
		return ekp_xdp6_to_tc(outcome);
	__u8 *l4 = data + off;
	if ((void *)(l4 + sizeof(struct udphdr)) > data_end)
		return ekp_xdp6_to_tc(outcome);

	__be32 old_addr[8], new_addr[8];
	__builtin_memcpy(old_addr, &ip->saddr, 16);
	__builtin_memcpy(old_addr + 4, &ip->daddr, 16);
	__builtin_memcpy(new_addr, sa, 16);
	__builtin_memcpy(new_addr + 4, da, 16);
	__be16 old_port[2] = {w->pkt.b.sport, w->pkt.b.dport};
	__be16 new_port[2] = {sp, dp};
	__s64 addr_diff = bpf_csum_diff(old_addr, sizeof(old_addr), new_addr, sizeof(new_addr), 0);
	__s64 l4_diff = bpf_csum_diff((__be32 *)old_port, sizeof(old_port), (__be32 *)new_port, sizeof(new_port),
				      (__u32)addr_diff);
	if (addr_diff < 0 || l4_diff < 0 ||
	    ekp_xdp_rewrite_l4(l4, data_end, w->pkt.b.proto, (__u32)l4_diff, sp, dp) < 0)
		return ekp_xdp6_to_tc(outcome);
	ip->hop_limit -= 1; /* no header checksum to follow it */
	__builtin_memcpy(&ip->saddr, new_addr, 16);
	__builtin_memcpy(&ip->daddr, new_addr + 4, 16);
	__builtin_memcpy(eth->h_dest, w->fib.dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, w->fib.smac, ETH_ALEN);
	return XDP_TX;
}

/* A conntrack hit on w->key: routed first (read only), moved on and sent only on this device. */
static __always_inline int ekp_xdp6_hit(struct xdp_md *ctx, struct ekp_tc6_scratch *w, struct ekp_ct6_entry *e,
					__u64 now, __u32 *outcome)
{
	const __be32 *sa, *da;
	__be16 sp, dp;

	ekp_tc6_hit_tuple(w, e, &sa, &sp, &da, &dp);
	if (!ekp_xdp6_route(ctx, w, sa, sp, da, dp))
		return ekp_xdp6_to_tc(outcome);
	if (ekp_tc6_hit_in(w, e, now, EKP_COUNT_XDP, &sa, &sp, &da, &dp) < 0) {
		*outcome = EKP_DROP_NO_FLOW; /* the refresh deleted the entry, as ekp_main6 drops it */
		return XDP_DROP;
	}
	*outcome = w->key.dir == EKP_CT_FORWARD ? EKP_STAT_CT_FORWARD : EKP_STAT_CT_REPLY;
	return ekp_xdp6_send(ctx, w, sa, sp, da, dp, outcome);
}

/* A new flow's first packet to the frontend `fe` (ekp_main6's new-flow path, with what XDP cannot
 * carry out left to tc before anything is written). */
static __always_inline int ekp_xdp6_new(struct xdp_md *ctx, struct ekp_tc6_scratch *w,
					const struct ekp_frontend *fe, const struct ekp_config *cfg, __u64 now,
					__u32 *outcome)
{
	const struct ekp_pkt6 *p = &w->pkt;
	struct ekp_flow6 *f = &w->flow;
	__u16 flags = fe->flags;
	__u32 aff_hit = 0;

	int refusal = ekp_lb_refusal_af(1, fe, p->saddr);
	if (refusal == EKP_DROP_NO_ENDPOINTS && (flags & EKP_FE_NO_ENDPOINTS))
		return ekp_xdp6_to_tc(outcome); /* the reject is built on the skb (ekp_tc6_refuse) */
	if (refusal) {
		*outcome = refusal; /* source ranges, no local endpoint: dropped as tc drops them */
		return XDP_DROP;
	}
	int node = ekp_tc6_node_addr(w->node);
	if ((cfg->flags & EKP_CFG_HOST_LEGACY) || (flags & EKP_FE_HOST_BACKEND) ||
	    (!node && (flags & (EKP_FE_SNAT_ALL | EKP_FE_SNAT_REMOTE))))
		return ekp_xdp6_to_tc(outcome);
	__builtin_memset(f, 0, sizeof(*f));
	/* The choice is remembered (affinity) only once XDP will carry the flow out: one left to tc is
	 * chosen there afresh, its first choice counted as such (no AFFINITY_HIT of XDP's making). */
	if (ekp_pick_backend_in(1, fe, p->saddr, bpf_get_prandom_u32(), NULL, now, &f->b, f->be_addr, &aff_hit, 0))
		return ekp_xdp6_to_tc(outcome);
	int snat = ekp_tc6_wants_snat(flags, f->b.be_flags, f->be_addr, p->saddr);
	if ((f->b.be_flags & (EKP_BE_LOCAL | EKP_BE_HOST)) || (snat && !node))
		return ekp_xdp6_to_tc(outcome); /* into a pod's veth, or the node's stack: tc's */
	if (snat) {
		f->b.ct_flags = EKP_CT_SNAT;
		__builtin_memcpy(f->snat_addr, w->node, 16);
	}
	f->b.svc_id = fe->svc_id;
	__builtin_memcpy(f->fe_addr, p->daddr, 16);
	f->b.fe_port = p->b.dport;
	/* The route before the entries, from the source the walk will not change (its port matters to
	 * no route), as ekp_main6's. */
	if (!ekp_xdp6_route(ctx, w, snat ? f->snat_addr : p->saddr, p->b.sport, f->be_addr, f->b.be_port))
		return ekp_xdp6_to_tc(outcome);
	if (aff_hit)
		ekp_count_in(EKP_COUNT_XDP, EKP_STAT_AFFINITY_HIT);
	int reason = ekp_ct6_create(p, f, cfg, now);
	if (f->b.early_drop)
		ekp_count_in(EKP_COUNT_XDP, EKP_STAT_EARLY_DROP);
	if (reason) {
		*outcome = reason;
		return XDP_DROP;
	}
	w->key.dir = EKP_CT_FORWARD;
	ekp_ctq6_want(&w->queue, &w->key, now / EKP_NSEC);
	if (ekp_fe_affinity(fe)) { /* after the entries: one branch less for the verifier to walk twice */
		struct ekp_affinity6_key ak6 = {};
		__builtin_memcpy(ak6.client, p->saddr, 16);
		ak6.svc_id = fe->svc_id;
		ekp_aff_remember_af(1, NULL, &ak6, f->b.backend_id, now);
	}
	if (f->b.remapped)
		ekp_count_in(EKP_COUNT_XDP, EKP_STAT_PORT_REMAP);
	else if (f->b.ct_flags & EKP_CT_SNAT)
		ekp_count_in(EKP_COUNT_XDP, EKP_STAT_SNAT);
	*outcome = EKP_STAT_NEW_FLOWS;
	return ekp_xdp6_send(ctx, w, (f->b.ct_flags & EKP_CT_SNAT) ? f->snat_addr : p->saddr,
			     (f->b.ct_flags & EKP_CT_SNAT) ? f->b.snat_port : p->b.sport, f->be_addr, f->b.be_port,
			     outcome);
}

static __always_inline int ekp_xdp6_decide(struct xdp_md *ctx, struct ekp_tc6_scratch *w, __u32 *outcome)
{
	struct ekp_pkt6 *p = &w->pkt;
	int parsed = ekp_parse6_xdp(ctx, p);
	const struct ekp_config *cfg = ekp_config_get();

	if (parsed == EKP_PARSE_PASS || parsed == EKP_PARSE_MALFORMED || !cfg)
		return XDP_PASS; /* none of ours (ekp_main6 passes a malformed one to the stack too) */
	/* The skb path's: ICMPv6 errors (an error not addressed to its quote's source is no flow's,
	 * ekp_tc6_related), holding and recording fragments, SCTP's CRC32c. What may be a service
	 * packet by the activity check counts TO_TC, the rest PASS, as a whole packet's. */
	if (parsed == EKP_PARSE_ICMP_ERR)
		return ekp_addr6_eq(p->daddr, p->in_saddr) ? ekp_xdp6_to_tc(outcome) : XDP_PASS;
	if (!ekp_tc6_may_translate(p, EKP_SCOPE_EXTERNAL, cfg))
		return XDP_PASS;
	if (parsed != EKP_PARSE_OK || p->b.frag != EKP_FRAG_NONE || p->b.proto == IPPROTO_SCTP)
		return ekp_xdp6_to_tc(outcome);
	if (p->hop_limit <= 1 || !ekp_xdp6_reachable(ctx, p))
		return ekp_xdp6_to_tc(outcome); /* the last hop's answer is tc's */

	__u64 now = bpf_ktime_get_ns();
	struct ekp_ct6_key *k = &w->key;
	__builtin_memset(k, 0, sizeof(*k));
	ekp_ct6_key_of(k, p, EKP_CT_FORWARD);
	struct ekp_ct6_entry *e = ekp_ct6_lookup(k);
	if (e && !ekp_ct6_alive(e, k, cfg, now))
		e = NULL;
	if (e && !ekp_ct6_usable_forward(e, &p->b))
		return ekp_xdp6_to_tc(outcome); /* a SYN on an ended flow's tuple: tc reopens it */
	if (!e) {
		k->dir = EKP_CT_REPLY;
		e = ekp_ct6_lookup(k);
		if (e && !(ekp_ct6_alive(e, k, cfg, now) && ekp_ct6_usable_reply(e, &p->b)))
			e = NULL;
	}
	if (e) {
		if (cfg->flags & EKP_CFG_HOST_LEGACY)
			return ekp_xdp6_to_tc(outcome); /* the node's stack must see it (ekp_xdp_apply.h) */
		return ekp_xdp6_hit(ctx, w, e, now, outcome);
	}
	if (!ekp_opens_flow(&p->b))
		return XDP_PASS; /* a flow ip6tables translated: its nf_conntrack entry is the stack's */
	struct ekp_frontend6_key fk = {};
	ekp_fe6_key_of(&fk, p, EKP_SCOPE_EXTERNAL);
	struct ekp_frontend *fe = ekp_fe6_lookup(&fk);
	if (!fe)
		return XDP_PASS; /* no flow of ours: a direct connection's reclaim is tc's */
	return ekp_xdp6_new(ctx, w, fe, cfg, now, outcome);
}

static __always_inline int ekp_xdp_main6(struct xdp_md *ctx)
{
	struct ekp_tc6_scratch *w = ekp_scratch6_lookup();
	__u32 outcome = EKP_STAT_PASS;

	if (!w)
		return XDP_PASS; /* cannot happen: a one-element per-CPU array */
	w->queue.want = 0;
	__builtin_memset(&w->pkt, 0, sizeof(w->pkt));
	int verdict = ekp_xdp6_decide(ctx, w, &outcome);

	/* the flow that began or closed goes in its ring (ekp_ctq.h); the one there a ring ago may go */
	if (w->queue.want) {
		__u32 evicted = ekp_ctq6_push(&w->queue);
		if (evicted)
			ekp_count_in(EKP_COUNT_XDP, evicted);
	}
	ekp_count_in(EKP_COUNT_XDP, EKP_STAT_PACKETS);
	ekp_count_in(EKP_COUNT_XDP, outcome);
	return verdict;
}

#endif /* EKP_XDP6_H */
