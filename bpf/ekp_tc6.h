/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc6.h: the tc programs' IPv6 path (ekp_from_pod6, ekp_from_net6), reached from
 * ekp_from_pod / ekp_from_net by a tail call (ekp_tc.c), so the IPv4 programs' verification and
 * per-packet work do not grow with it (Cilium splits its programs per family the same way).
 *
 *   parse (ekp_parse6.h) -> conntrack (ekp_ct6.h: IPv4's conntrack code for IPv6, FORWARD then
 *                           REPLY, ekp_ct6_tcp / ekp_ct6_any, early-drop rings ekp_ctq6_*)
 *                        -> new flow: frontend (ekp_fe6), refusal and backend (ekp_lb.h, v6 = 1),
 *                           or a direct connection on a live flow's tuple (ekp_ct6_reclaim)
 *                        -> route (bpf_fib_lookup), entries (ekp_ct6_create), rewrite, hop limit - 1,
 *                           redirect
 *
 * What it translates: TCP flows that need no source translation, which is every flow whose backend
 * is on this node, and the remote ones of frontends that ask no SNAT (a pod to a ClusterIP). Every
 * other packet goes to the node's stack untouched, where the ip6tables proxier beside the eBPF
 * programs (agent/metaproxier.py, EbpfAndIp6tables) does what it did before this path existed:
 *   - UDP and SCTP: a UDP flow owned here would lose what the stack does for it (a backend's
 *     fragmented answers, ICMPv6 errors quoting the translated tuple: nf_conntrack knows neither
 *     flow), and a UDP flow ip6tables started has no first packet to tell it from a new one, so
 *     tc would decide it again;
 *   - a frontend that asks SNAT (EKP_FE_SNAT_ALL; EKP_FE_SNAT_REMOTE with a remote backend), a
 *     hairpin (the client is its own backend), a backend on the node's own address (EKP_BE_HOST:
 *     its replies leave by the node's stack), affinity with SNAT_REMOTE (one owner of the
 *     service's affinity), legacy host routing;
 *   - refusals: no endpoints (ip6tables' REJECT answers with ICMPv6), no local endpoint, source
 *     ranges;
 *   - a mid-flow TCP segment without an entry (a flow ip6tables translated before: nf_conntrack
 *     has it);
 *   - fragments, first and later: a translated first fragment would leave its later pieces to a
 *     stack that can never reassemble them, so the whole datagram goes to the stack, which
 *     reassembles and translates it;
 *   - ICMPv6 (errors about translated flows included, Packet Too Big: not yet translated here),
 *     a packet too big for the route, no route, the last hop.
 * Conntrack is IPv4's, the same code (ekp_ct_af.h): state and timeouts, twins rebuilt, orphaned
 * flows, closed flows reclaimed by a SYN, the early-drop ring. A new flow whose reply tuple a live
 * flow of another frontend holds (one client port to one backend through two frontends), and a
 * direct connection on a live flow's tuple, keep the client's address with another source port
 * (EKP_CT_SNAT with the client's own address, EKP_STAT_PORT_REMAP), as ip6tables' nf_nat would;
 * not left to ip6tables, whose nf_conntrack knows nothing of the flow holding the tuple.
 * The reply of a flow this path translated comes back through ekp_from_pod6 (a local backend) or
 * ekp_from_net6 (a remote one) and gets its frontend back from the REPLY entry.
 */
#ifndef EKP_TC6_H
#define EKP_TC6_H

#include <linux/pkt_cls.h>

#include "ekp_act.h"
#include "ekp_ct6.h"
#include "ekp_decide.h"
#include "ekp_lb.h"
#include "ekp_parse6.h"
#include "ekp_redirect.h"
#include "ekp_stats.h"

#ifndef AF_INET6
#define AF_INET6 10
#endif

/* Working memory of one packet (a per-CPU array of ekp_tc.c): more than the 512-byte stack. */
struct ekp_tc6_scratch {
	struct ekp_pkt6 pkt;
	struct ekp_ct6_key key;
	struct bpf_fib_lookup fib;
	struct ekp_flow6 flow;
	struct ekp_ctq6_req queue; /* a flow that began or closed, for the early-drop ring */
	long rc;                   /* a new flow's route (ekp_tc6_route), kept across ekp_ct6_create */
};

static __always_inline struct ekp_tc6_scratch *ekp_scratch6_lookup(void);

static __always_inline long ekp_fib6(struct __sk_buff *skb, struct bpf_fib_lookup *fib, const struct ekp_pkt6 *p,
				     const __be32 *saddr, const __be32 *daddr, __be16 sport, __be16 dport)
{
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = AF_INET6;
	fib->l4_protocol = p->b.proto;
	fib->sport = sport;
	fib->dport = dport;
	__builtin_memcpy(fib->ipv6_src, saddr, 16);
	__builtin_memcpy(fib->ipv6_dst, daddr, 16);
	fib->ifindex = skb->ingress_ifindex;
	return bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
}

/* ekp_source_routed_here for IPv6: the route back to the source leaves by the device the packet
 * came in on (or the bridge of its port), what the stack's reverse-path check would ask. */
static __always_inline int ekp_source_routed_here6(struct __sk_buff *skb, const struct ekp_pkt6 *p,
						   struct bpf_fib_lookup *fib, __u32 bridge)
{
	long rc = ekp_fib6(skb, fib, p, p->daddr, p->saddr, p->b.dport, p->b.sport);

	return (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH ||
		rc == BPF_FIB_LKUP_RET_FRAG_NEEDED) &&
	       (fib->ifindex == skb->ingress_ifindex || (bridge && fib->ifindex == bridge));
}

/* Replaces the 16-byte address at `off` and fixes the L4 checksum for it (its pseudo header: IPv6
 * has no header checksum). 0 or -1.
 * skb->csum of a CHECKSUM_COMPLETE packet: BPF_F_PSEUDO_HDR takes the address change out of it, as
 * the checksum field's own change asks, which for IPv4 is all (the IPv4 header's checksum
 * balances its address); here the address is in the data skb->csum covers, so the store puts it
 * back (BPF_F_RECOMPUTE_CSUM: skb->csum minus the old 16 bytes, plus the new ones; a no-op for any
 * other ip_summed). BPF_F_IPV6 on the csum replace does the same by leaving skb->csum alone, but
 * only kernels from mid-2025 know it (older ones refuse the call). */
static __always_inline int ekp_set_addr6(struct __sk_buff *skb, const struct ekp_pkt6 *p, __u32 off,
					 const __be32 *old, const __be32 *new)
{
	__s64 diff = bpf_csum_diff((__be32 *)old, 16, (__be32 *)new, 16, 0);

	if (diff < 0)
		return -1;
	if (bpf_l4_csum_replace(skb, ekp_l4_csum_off(&p->b), 0, diff, ekp_l4_csum_flags(&p->b) | BPF_F_PSEUDO_HDR) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, (void *)new, 16, BPF_F_RECOMPUTE_CSUM) < 0 ? -1 : 0;
}

/* Rewrites the packet to saddr:sport -> daddr:dport. 0 or -1. */
static __always_inline int ekp_rewrite6(struct __sk_buff *skb, const struct ekp_pkt6 *p, const __be32 *saddr,
					__be16 sport, const __be32 *daddr, __be16 dport)
{
	if (!ekp_addr6_eq(saddr, p->saddr) && ekp_set_addr6(skb, p, EKP_IP6_SADDR_OFF, p->saddr, saddr) < 0)
		return -1;
	if (!ekp_addr6_eq(daddr, p->daddr) && ekp_set_addr6(skb, p, EKP_IP6_DADDR_OFF, p->daddr, daddr) < 0)
		return -1;
	if (ekp_set_port(skb, &p->b, 0, p->b.sport, sport) < 0 || ekp_set_port(skb, &p->b, 2, p->b.dport, dport) < 0)
		return -1;
	return 0;
}

/* The route of the translated tuple into w->fib: SUCCESS or NO_NEIGH, or -1 to hand the packet
 * untouched to the stack (no route here, too big for the route: the stack and ip6tables answer
 * those as they would without this path). Looked up before anything is written. */
static __always_inline long ekp_tc6_route(struct __sk_buff *skb, struct ekp_tc6_scratch *w, const __be32 *saddr,
					  __be16 sport, const __be32 *daddr, __be16 dport)
{
	long rc = ekp_fib6(skb, &w->fib, &w->pkt, saddr, daddr, sport, dport);

	return rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH ? rc : -1;
}

/* Rewrites the packet to the translated tuple, spends a hop and redirects it along the route `rc`
 * (ekp_tc6_route). The TC verdict. */
static __always_inline int ekp_tc6_send(struct __sk_buff *skb, struct ekp_tc6_scratch *w, long rc,
					const __be32 *saddr, __be16 sport, const __be32 *daddr, __be16 dport,
					__u32 *outcome)
{
	const struct ekp_pkt6 *p = &w->pkt;
	struct bpf_fib_lookup *fib = &w->fib;
	__u8 hop = p->hop_limit - 1;

	if (ekp_rewrite6(skb, p, saddr, sport, daddr, dport) < 0 ||
	    /* no header checksum balances the hop limit: skb->csum (CHECKSUM_COMPLETE) follows it */
	    bpf_skb_store_bytes(skb, EKP_IP6_HOPLIMIT_OFF, &hop, 1, BPF_F_RECOMPUTE_CSUM) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {};
		nh.nh_family = AF_INET6;
		__builtin_memcpy(nh.ipv6_nh, fib->ipv6_dst, 16); /* the gateway when the route has one */
		return ekp_redirect_neigh(fib->ifindex, &nh, sizeof(nh), 0);
	}
	if (bpf_skb_store_bytes(skb, 0, fib->dmac, ETH_ALEN, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, fib->smac, ETH_ALEN, 0) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	return bpf_redirect(fib->ifindex, 0);
}

/* A usable conntrack hit (ekp_decide_hit for this path): the flow moves on (ekp_ct_advance: its
 * state, the early-drop ring when it closes, the refresh that rebuilds a lost twin). Sets the
 * translated tuple: the backend (and the SNAT source of a remapped port) forward, the frontend (and the
 * client's own port) in reply. */
static __always_inline void ekp_tc6_hit(struct ekp_tc6_scratch *w, struct ekp_ct6_entry *e, __u64 now,
					const __be32 **sa, __be16 *sp, const __be32 **da, __be16 *dp)
{
	const struct ekp_pkt6 *p = &w->pkt;
	struct ekp_ct6_key *k = &w->key;
	if (ekp_ct6_advance(e, k, &p->b, now, &w->queue))
		ekp_count(EKP_STAT_CT_REBUILT);
	int snat = e->flags & EKP_CT_SNAT;

	if (k->dir == EKP_CT_FORWARD) {
		*sa = snat ? e->snat_addr : p->saddr;
		*sp = snat ? e->snat_port : p->b.sport;
		*da = e->nat_addr;
		*dp = e->nat_port;
	} else {
		*sa = e->fe_addr;
		*sp = e->fe_port;
		*da = snat ? e->nat_addr : p->daddr;
		*dp = snat ? e->nat_port : p->b.dport;
	}
}

/* ekp_decide_may_translate for IPv6: when no live flow stamped either endpoint of the packet and
 * its destination is no frontend of this scope (ekp_addr6), it belongs to no flow of ours and
 * leaves without the conntrack lookups (traffic between pods pays two array loads and a hash
 * lookup, not two LRU lookups of 40-byte keys). */
static __always_inline int ekp_tc6_may_translate(const struct ekp_pkt6 *p, __u8 scope, const struct ekp_config *cfg)
{
	if (!ekp_act_armed())
		return 1;
	__u32 t = ekp_act_stamp_of(bpf_ktime_get_coarse_ns()); /* lags the stamps' clock: errs "maybe" */
	__u32 span = ekp_ct_longest_stamps(cfg, p->b.proto);
	if (!ekp_act_idle(ekp_fold6(p->daddr), p->b.dport, p->b.proto, t, span) ||
	    !ekp_act_idle(ekp_fold6(p->saddr), p->b.sport, p->b.proto, t, span))
		return 1;
	struct ekp_addr6_key k = {};
	__builtin_memcpy(k.addr, p->daddr, 16);
	struct ekp_addr *a = ekp_addr6_lookup(&k);
	return a && (a->flags & (1 << scope));
}

static __always_inline int ekp_main6(struct __sk_buff *skb, __u8 scope)
{
	struct ekp_tc6_scratch *w = ekp_scratch6_lookup();
	__u32 bridge = skb->tc_classid; /* the pod port's bridge (ekp_redirect.h) */

	skb->tc_classid = 0;
	if (!w)
		return TC_ACT_OK; /* cannot happen: a one-element per-CPU array */
	w->queue.want = 0;
	__builtin_memset(&w->pkt, 0, sizeof(w->pkt));
	struct ekp_pkt6 *p = &w->pkt;
	int parsed = ekp_parse6(skb, p);
	__u32 outcome = EKP_STAT_PASS;
	int verdict = TC_ACT_OK;
	const struct ekp_config *cfg = ekp_config_get();

	ekp_count(EKP_STAT_PACKETS);
	/* TCP alone (UDP and SCTP: ip6tables'); the last hop: the stack sends the time exceeded */
	if (parsed != EKP_PARSE_OK || p->b.proto != IPPROTO_TCP || p->b.frag != EKP_FRAG_NONE ||
	    p->hop_limit <= 1 || !cfg ||
	    (cfg->flags & EKP_CFG_HOST_LEGACY) || !ekp_tc6_may_translate(p, scope, cfg))
		goto out;

	__u64 now = bpf_ktime_get_ns();
	struct ekp_ct6_key *k = &w->key;
	const __be32 *sa, *da;
	__be16 sp, dp;
	long rc;

	__builtin_memset(k, 0, sizeof(*k));
	ekp_ct6_key_of(k, p, EKP_CT_FORWARD);
	struct ekp_ct6_entry *e = ekp_ct6_lookup(k);
	if (e && !(ekp_ct6_alive(e, k, cfg, now) && ekp_ct6_usable_forward(e, &p->b)))
		e = NULL; /* dead, or a SYN reusing an ended flow's port: the new-flow path below */
	if (!e) {
		k->dir = EKP_CT_REPLY;
		e = ekp_ct6_lookup(k);
		if (e && !(ekp_ct6_alive(e, k, cfg, now) && ekp_ct6_usable_reply(e, &p->b)))
			e = NULL; /* a SYN-ACK answering something else on an ended flow's tuple */
	}
	if (e) {
		if (scope == EKP_SCOPE_INTERNAL && !ekp_source_routed_here6(skb, p, &w->fib, bridge)) {
			outcome = EKP_DROP_SPOOFED; /* redirected past the stack's reverse-path filter */
			verdict = TC_ACT_SHOT;
			goto out;
		}
		ekp_tc6_hit(w, e, now, &sa, &sp, &da, &dp);
		rc = ekp_tc6_route(skb, w, sa, sp, da, dp);
		if (rc < 0)
			goto out;
		outcome = k->dir == EKP_CT_FORWARD ? EKP_STAT_CT_FORWARD : EKP_STAT_CT_REPLY;
		verdict = ekp_tc6_send(skb, w, rc, sa, sp, da, dp, &outcome);
		goto out;
	}

	/* A new flow: only its first packet starts one (a TCP segment without an entry belongs to a
	 * flow ip6tables translated, whose nf_conntrack entry the stack has). */
	if (!ekp_opens_flow(&p->b))
		goto out;
	struct ekp_flow6 *f = &w->flow;
	__u32 aff_hit = 0;
	__builtin_memset(f, 0, sizeof(*f));
	struct ekp_frontend6_key fk = {};
	__builtin_memcpy(fk.addr, p->daddr, 16);
	fk.port = p->b.dport;
	fk.proto = p->b.proto;
	fk.scope = scope;
	struct ekp_frontend *fe = ekp_fe6_lookup(&fk);
	if (fe) {
		__u16 flags = fe->flags;
		if (ekp_lb_refusal_af(1, fe, p->saddr) || (flags & EKP_FE_SNAT_ALL) ||
		    ((flags & EKP_FE_AFFINITY) && (flags & EKP_FE_SNAT_REMOTE)))
			goto out;
		if (ekp_pick_backend_af(1, fe, p->saddr, bpf_get_prandom_u32(), NULL, now, &f->b, f->be_addr,
					&aff_hit))
			goto out;
		if (aff_hit) /* counted now, as IPv4's marks: a value held across the walk splits its states */
			ekp_count(EKP_STAT_AFFINITY_HIT);
		if ((f->b.be_flags & EKP_BE_HOST) || (!(f->b.be_flags & EKP_BE_LOCAL) && (flags & EKP_FE_SNAT_REMOTE)) ||
		    ekp_addr6_eq(f->be_addr, p->saddr))
			goto out; /* a source translation: ip6tables' */
		f->b.svc_id = fe->svc_id;
		__builtin_memcpy(f->fe_addr, p->daddr, 16);
		f->b.fe_port = p->b.dport;
	} else {
		/* No frontend: a connection of its own, client:P -> server:port, whose reverse tuple a
		 * live flow this path translated may hold (ekp_ct_reclaim): it keeps its addresses and
		 * gets another source port, translated to itself (ekp_flow_direct, IPv4's). A stale
		 * holder is cleared and the packet goes on untouched. */
		__u16 held_by = 0;
		if (ekp_ct6_reclaim(p, cfg, now, &held_by) != EKP_RECLAIM_LIVE)
			goto out;
		__builtin_memcpy(f->be_addr, p->daddr, 16);
		__builtin_memcpy(f->fe_addr, p->daddr, 16);
		__builtin_memcpy(f->snat_addr, p->saddr, 16);
		f->b.be_port = p->b.dport;
		f->b.fe_port = p->b.dport;
		f->b.ct_flags = EKP_CT_SNAT;
		f->b.remapped = 1;
	}
	if (scope == EKP_SCOPE_INTERNAL && !ekp_source_routed_here6(skb, p, &w->fib, bridge)) {
		outcome = EKP_DROP_SPOOFED;
		verdict = TC_ACT_SHOT;
		goto out;
	}
	/* The route before anything is written (the source port a remap picks matters to no route),
	 * kept in memory across the entries' creation: in a register its two values (SUCCESS,
	 * NO_NEIGH) would have the verifier walk the SNAT port walk once for each (ekp_snat.h). */
	w->rc = ekp_tc6_route(skb, w, p->saddr, p->b.sport, f->be_addr, f->b.be_port);
	if (w->rc < 0)
		goto out;
	/* The entries (ekp_ct_create, IPv4's): the reply one first, on a reply tuple a live flow of
	 * another frontend holds with another source port (EKP_STAT_PORT_REMAP), as ip6tables'
	 * nf_nat would. */
	int reason = ekp_ct6_create(p, f, cfg, now);
	if (reason) {
		outcome = reason;
		verdict = TC_ACT_SHOT;
		goto out;
	}
	k->dir = EKP_CT_FORWARD;
	ekp_ctq6_want(&w->queue, k, now / EKP_NSEC);
	if (f->b.remapped)
		ekp_count(EKP_STAT_PORT_REMAP);
	if (f->b.early_drop)
		ekp_count(EKP_STAT_EARLY_DROP);
	sa = (f->b.ct_flags & EKP_CT_SNAT) ? f->snat_addr : p->saddr;
	sp = (f->b.ct_flags & EKP_CT_SNAT) ? f->b.snat_port : p->b.sport;
	outcome = EKP_STAT_NEW_FLOWS;
	verdict = ekp_tc6_send(skb, w, w->rc, sa, sp, f->be_addr, f->b.be_port, &outcome);
out:
	/* the flow that began or closed goes in its ring (ekp_ctq.h); the one there a ring ago may go */
	if (w->queue.want) {
		__u32 evicted = ekp_ctq6_push(&w->queue);
		if (evicted)
			ekp_count(evicted);
	}
	ekp_count(outcome);
	return verdict;
}

#endif /* EKP_TC6_H */
