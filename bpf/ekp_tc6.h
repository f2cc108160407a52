/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc6.h: the tc programs' IPv6 path (ekp_from_pod6, ekp_from_net6), reached from
 * ekp_from_pod / ekp_from_net by a tail call (ekp_tc.c), so the IPv4 programs' verification and
 * per-packet work do not grow with it (Cilium splits its programs per family the same way).
 *
 *   parse (ekp_parse6.h) -> conntrack (ekp_ct6_tcp / ekp_ct6_any: FORWARD, then REPLY)
 *                        -> new flow: frontend (ekp_fe6), refusal and backend (ekp_lb.h, v6 = 1),
 *                           SNAT source port (ekp_tc6_snat.h: IPv4's walk, ekp_snat.h)
 *                        -> route (bpf_fib_lookup), rewrite (ekp_nat6.h), hop limit - 1, redirect
 *   an ICMPv6 error      -> conntrack of the quoted flow (ekp_tc6_related) -> route, outer and
 *                           quote rewritten, hop limit - 1, redirect
 *
 * What it translates: TCP flows to a frontend, with the source translated to the node's IPv6
 * address where IPv4 would translate it (ekp_tc6_snat.h: SNAT_ALL, SNAT_REMOTE with a remote
 * backend, a hairpin), and the ICMPv6 errors about them. Every other packet goes to the node's
 * stack untouched, where the ip6tables proxier beside the eBPF programs (agent/metaproxier.py,
 * EbpfAndIp6tables) does what it did before this path existed:
 *   - UDP and SCTP: a UDP flow owned here would lose what the stack does for it (a backend's
 *     fragmented answers, ICMPv6 errors quoting the translated tuple: nf_conntrack knows neither
 *     flow, and ekp_tc6_related translates errors about TCP flows alone), and a UDP flow
 *     ip6tables started has no first packet to tell it from a new one, so tc would decide it again;
 *   - a frontend that would need ip6tables for some of its backends, left whole before the choice
 *     so that one proxier chooses among all its backends (and one owns its affinity): one with a
 *     backend on the node's own address (EKP_FE_HOST_BACKEND: that backend's replies leave by the
 *     node's stack), and, while the node's IPv6 address is not known (ekp_cfg6 zero), one that
 *     asks SNAT (EKP_FE_SNAT_ALL, EKP_FE_SNAT_REMOTE: its local backends too); then a hairpin as
 *     well (the client is its own backend: known only after the choice, see there); legacy host
 *     routing;
 *   - refusals: no endpoints (ip6tables' REJECT answers with ICMPv6), no local endpoint, source
 *     ranges;
 *   - a mid-flow TCP segment without an entry (a flow ip6tables translated before: nf_conntrack
 *     has it);
 *   - fragments, first and later: a translated first fragment would leave its later pieces to a
 *     stack that can never reassemble them, so the whole datagram goes to the stack, which
 *     reassembles and translates it;
 *   - ICMPv6 but errors about a flow translated here (Packet Too Big, destination unreachable,
 *     time exceeded, parameter problem: ekp_tc6_related translates those back, as nf_nat does for
 *     the flows ip6tables translated), a packet too big for the route (the stack and ip6tables
 *     answer it as they would without this path), no route, the last hop.
 * A new flow whose reply tuple a live flow of another frontend holds (one client port to one
 * backend through two frontends) is dropped (EKP_DROP_TUPLE_TAKEN), not left to ip6tables: its
 * nf_conntrack entry would have that tuple too, and the replies would get the other frontend here.
 * The reply of a flow this path translated comes back through ekp_from_pod6 (a local backend) or
 * ekp_from_net6 (a remote one) and gets its frontend back from the REPLY entry (and its client, when
 * the source was translated).
 */
#ifndef EKP_TC6_H
#define EKP_TC6_H

#include <linux/pkt_cls.h>

#include "ekp_act.h"
#include "ekp_ct.h"
#include "ekp_decide.h"
#include "ekp_lb.h"
#include "ekp_nat6.h"
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
	struct ekp_ct6_key rkey;
	struct ekp_ct6_entry fwd;
	struct ekp_ct6_entry rev;
	struct bpf_fib_lookup fib;
	struct ekp_flow flow;
	struct ekp_icmp6_nat icmp;
	__be32 be6[4];
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

/* The route of the translated tuple into w->fib: SUCCESS or NO_NEIGH, or -1 to hand the packet
 * untouched to the stack (no route here, too big for the route: the stack and ip6tables answer
 * those as they would without this path). Looked up before anything is written. */
static __always_inline long ekp_tc6_route(struct __sk_buff *skb, struct ekp_tc6_scratch *w, const __be32 *saddr,
					  __be16 sport, const __be32 *daddr, __be16 dport)
{
	long rc = ekp_fib6(skb, &w->fib, &w->pkt, saddr, daddr, sport, dport);

	return rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH ? rc : -1;
}

/* Spends a hop of the packet (rewritten already) and redirects it along the route `rc`
 * (ekp_tc6_route). The TC verdict. */
static __always_inline int ekp_tc6_forward(struct __sk_buff *skb, struct ekp_tc6_scratch *w, long rc, __u32 *outcome)
{
	struct bpf_fib_lookup *fib = &w->fib;
	__u8 hop = w->pkt.hop_limit - 1;

	/* no header checksum balances the hop limit: skb->csum (CHECKSUM_COMPLETE) follows it */
	if (bpf_skb_store_bytes(skb, EKP_IP6_HOPLIMIT_OFF, &hop, 1, BPF_F_RECOMPUTE_CSUM) < 0) {
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

/* Rewrites the packet to the translated tuple and forwards it (ekp_tc6_forward). The TC verdict. */
static __always_inline int ekp_tc6_send(struct __sk_buff *skb, struct ekp_tc6_scratch *w, long rc,
					const __be32 *saddr, __be16 sport, const __be32 *daddr, __be16 dport,
					__u32 *outcome)
{
	if (ekp_rewrite6(skb, &w->pkt, saddr, sport, daddr, dport) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	return ekp_tc6_forward(skb, w, rc, outcome);
}

static __always_inline struct ekp_ct6_entry *ekp_ct6_hit(struct ekp_ct6_key *k, const struct ekp_config *cfg, __u64 now)
{
	struct ekp_ct6_entry *e = ekp_ct6_lookup(k);

	if (e && ekp_age_ns(now, e->last_seen_ns) > (__s64)ekp_ct_timeout_ns(cfg, k->proto, e->flags))
		return NULL; /* expired: a new flow on the tuple decides again */
	return e;
}

/* The state a packet moves its flow to (ekp_ct_transition, IPv4's, reads only these two fields). */
static __always_inline __u16 ekp_ct6_transition(const struct ekp_ct6_entry *e, const struct ekp_pkt6 *p, __u8 dir,
						__u64 now)
{
	struct ekp_ct_entry view = {};

	view.flags = e->flags;
	view.created_s = e->created_s;
	return ekp_ct_transition(&view, &p->b, dir, now);
}

/* ekp_ct_usable_forward / ekp_ct_usable_reply (IPv4's) for this path's TCP: no SYN on a flow that
 * saw a FIN or RST (a new flow, decided again), and a TCP flow keeps a backend removed from its
 * service, as kube-proxy does. The forward test is its TCP half (ekp_ct_syn_reopens): its UDP half
 * reads IPv4's ekp_member, and UDP is not translated here (see the top). */
static __always_inline int ekp_ct6_usable(const struct ekp_ct6_entry *e, const struct ekp_pkt6 *p, __u8 dir)
{
	struct ekp_ct_entry view = {};

	if (dir == EKP_CT_FORWARD)
		return !ekp_ct_syn_reopens(e->flags, &p->b);
	view.flags = e->flags; /* all ekp_ct_usable_reply reads */
	return ekp_ct_usable_reply(&view, &p->b);
}

/* ekp_ct_is_twin for IPv6: `t`, found under the twin key of `e` (this packet's entry, direction
 * `dir`), is its twin and not another flow's entry that took the key: the same frontend, backend
 * and translation (EKP_CT_SAME_FLOW, IPv4's test), and the same client or backend: for a FORWARD
 * twin, this reply's source as its backend; for a REPLY twin of a source-translated flow, this
 * packet's source as its client. Without SNAT a REPLY twin's key holds this packet's source. */
static __always_inline int ekp_ct6_is_twin(const struct ekp_ct6_entry *t, const struct ekp_ct6_entry *e, __u8 dir,
					   const struct ekp_pkt6 *p)
{
	if (!EKP_CT_SAME_FLOW(t, e, ekp_addr6_eq(t->fe_addr, e->fe_addr)))
		return 0;
	if (dir == EKP_CT_FORWARD && !(t->flags & EKP_CT_SNAT))
		return 1; /* its key holds this packet's client and port */
	/* a FORWARD twin's nat_addr is its backend, this reply's source; a source-translated REPLY
	 * twin's is its client (another client's flow may hold the SNAT tuple since) */
	return ekp_addr6_eq(t->nat_addr, p->saddr) && t->nat_port == p->b.sport;
}

/* An IPv6 endpoint in the flow-activity array (ekp_act.h) is its address folded to 32 bits: a
 * stamp is a hint, and a slot shared with another endpoint (of either family) only costs the
 * lookups, never a wrong answer. */
static __always_inline __be32 ekp_fold6(const __be32 *a)
{
	return a[0] ^ a[1] ^ a[2] ^ a[3];
}

/* Stamps both endpoints of a flow: its frontend and its backend. */
static __always_inline void ekp_ct6_stamp_flow(const __be32 *fe, __be16 fe_port, const __be32 *be, __be16 be_port,
					       __u8 proto, __u64 now)
{
	__u32 t = ekp_act_stamp_of(now);

	ekp_act_stamp(ekp_fold6(fe), fe_port, proto, t);
	ekp_act_stamp(ekp_fold6(be), be_port, proto, t);
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

#include "ekp_tc6_snat.h"

/* An ICMPv6 error quoting a packet of a flow this path translated, as that packet left us
 * (translated): the node's stack has no nf_conntrack entry for the flow, so without this the error
 * would reach its destination about a tuple its sockets never used (a Packet Too Big about a
 * client's segment to the backend: the client's path MTU never lowered, the flow black-holed).
 * The quote reversed is the key of the flow's other direction, as in ekp_decide_related (IPv4's):
 *   a FORWARD packet (client -> backend) quoted: its REPLY entry; the error goes back to the
 *     client: quote to client -> frontend, outer source the frontend (nf_nat's outer manip); with
 *     SNAT the quote's source and the outer destination become the client (nat_addr, nat_port);
 *   a REPLY packet (frontend -> client) quoted: its FORWARD entry; the error goes on to the
 *     backend: quote to backend -> client, outer destination the backend; with SNAT the quote's
 *     destination and the outer source become the node's SNAT source (snat_addr, snat_port).
 * Routed and redirected as the flow's packets are; the entries are not refreshed. An error about
 * no live flow of this path, or with no route here, goes to the stack untouched, as before. */
static __always_inline int ekp_tc6_related(struct __sk_buff *skb, struct ekp_tc6_scratch *w, __u8 scope,
					   __u32 bridge, const struct ekp_config *cfg, __u32 *outcome)
{
	const struct ekp_pkt6 *p = &w->pkt;
	struct ekp_icmp6_nat *n = &w->icmp;
	struct ekp_ct6_key *k = &w->key;
	__u64 now = bpf_ktime_get_ns();

	__builtin_memset(k, 0, sizeof(*k));
	__builtin_memcpy(k->saddr, p->in_daddr, 16);
	__builtin_memcpy(k->daddr, p->in_saddr, 16);
	k->sport = p->b.in_dport;
	k->dport = p->b.in_sport;
	k->proto = p->b.in_proto;
	k->dir = EKP_CT_REPLY;
	__builtin_memcpy(n->saddr, p->saddr, 16);
	__builtin_memcpy(n->daddr, p->daddr, 16);
	__builtin_memcpy(n->in_saddr, p->in_saddr, 16);
	__builtin_memcpy(n->in_daddr, p->in_daddr, 16);
	n->in_sport = p->b.in_sport;
	n->in_dport = p->b.in_dport;
	struct ekp_ct6_entry *e = ekp_ct6_hit(k, cfg, now);
	if (e) {
		__builtin_memcpy(n->in_daddr, e->fe_addr, 16);
		n->in_dport = e->fe_port;
		__builtin_memcpy(n->saddr, e->fe_addr, 16);
		if (e->flags & EKP_CT_SNAT) { /* the client, which the flow's source was translated from */
			__builtin_memcpy(n->in_saddr, e->nat_addr, 16);
			n->in_sport = e->nat_port;
			__builtin_memcpy(n->daddr, e->nat_addr, 16);
		}
	} else {
		k->dir = EKP_CT_FORWARD;
		e = ekp_ct6_hit(k, cfg, now);
		if (!e)
			return TC_ACT_OK;
		__builtin_memcpy(n->in_saddr, e->nat_addr, 16);
		n->in_sport = e->nat_port;
		__builtin_memcpy(n->daddr, e->nat_addr, 16);
		if (e->flags & EKP_CT_SNAT) { /* the node's address and port the backend knows the flow by */
			__builtin_memcpy(n->in_daddr, e->snat_addr, 16);
			n->in_dport = e->snat_port;
			__builtin_memcpy(n->saddr, e->snat_addr, 16);
		}
	}
	if (scope == EKP_SCOPE_INTERNAL && !ekp_source_routed_here6(skb, p, &w->fib, bridge)) {
		*outcome = EKP_DROP_SPOOFED; /* redirected past the stack's reverse-path filter */
		return TC_ACT_SHOT;
	}
	long rc = ekp_tc6_route(skb, w, n->saddr, 0, n->daddr, 0);
	if (rc < 0)
		return TC_ACT_OK;
	if (ekp_rewrite_icmp6_err(skb, p, n) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	*outcome = EKP_STAT_CT_RELATED;
	return ekp_tc6_forward(skb, w, rc, outcome);
}

static __always_inline int ekp_main6(struct __sk_buff *skb, __u8 scope)
{
	struct ekp_tc6_scratch *w = ekp_scratch6_lookup();
	__u32 bridge = skb->tc_classid; /* the pod port's bridge (ekp_redirect.h) */

	skb->tc_classid = 0;
	if (!w)
		return TC_ACT_OK; /* cannot happen: a one-element per-CPU array */
	__builtin_memset(&w->pkt, 0, sizeof(w->pkt));
	struct ekp_pkt6 *p = &w->pkt;
	int parsed = ekp_parse6(skb, p);
	__u32 outcome = EKP_STAT_PASS;
	int verdict = TC_ACT_OK;
	const struct ekp_config *cfg = ekp_config_get();

	ekp_count(EKP_STAT_PACKETS);
	/* the last hop: the stack sends the time exceeded (or, for an error, drops it) */
	if (parsed == EKP_PARSE_ICMP_ERR && p->hop_limit > 1 && cfg && !(cfg->flags & EKP_CFG_HOST_LEGACY)) {
		verdict = ekp_tc6_related(skb, w, scope, bridge, cfg, &outcome);
		goto out;
	}
	/* TCP alone (UDP and SCTP: ip6tables') */
	if (parsed != EKP_PARSE_OK || p->b.proto != IPPROTO_TCP || p->b.frag != EKP_FRAG_NONE ||
	    p->hop_limit <= 1 || !cfg ||
	    (cfg->flags & EKP_CFG_HOST_LEGACY) || !ekp_tc6_may_translate(p, scope, cfg))
		goto out;

	__u64 now = bpf_ktime_get_ns();
	struct ekp_ct6_key *k = &w->key;
	struct ekp_ct6_key *rk = &w->rkey;
	__builtin_memset(k, 0, sizeof(*k));
	__builtin_memcpy(k->saddr, p->saddr, 16);
	__builtin_memcpy(k->daddr, p->daddr, 16);
	k->sport = p->b.sport;
	k->dport = p->b.dport;
	k->proto = p->b.proto;
	k->dir = EKP_CT_FORWARD;

	__builtin_memset(rk, 0, sizeof(*rk));
	rk->proto = p->b.proto;
	rk->dir = EKP_CT_REPLY;
	struct ekp_ct6_entry *e = ekp_ct6_hit(k, cfg, now);
	__u8 dir = EKP_CT_FORWARD;
	if (e && !ekp_ct6_usable(e, p, EKP_CT_FORWARD))
		e = NULL; /* a SYN reusing an ended flow's port: the new-flow path below */
	if (!e) {
		k->dir = EKP_CT_REPLY;
		e = ekp_ct6_hit(k, cfg, now);
		if (e && !ekp_ct6_usable(e, p, EKP_CT_REPLY))
			e = NULL; /* a SYN-ACK answering something else on an ended flow's tuple */
		if (e)
			dir = EKP_CT_REPLY;
	}
	if (e) {
		ekp_ct6_twin_key(rk, k, e); /* the flow's other entry */
		__u16 set = ekp_ct6_transition(e, p, dir, now);
		/* both entries move alike, as IPv4's; the clock once a second (a write per packet
		 * would bounce the entry between CPUs) */
		if (set || ekp_age_ns(now, e->last_seen_ns) > (__s64)EKP_NSEC) {
			e->flags |= set;
			e->last_seen_ns = now;
			struct ekp_ct6_entry *t = set ? ekp_ct6_lookup(rk) : NULL;
			if (t && ekp_ct6_is_twin(t, e, dir, p))
				t->flags |= set;
			/* the backend: the FORWARD entry's nat_addr, the REPLY key's source */
			if (dir == EKP_CT_FORWARD)
				ekp_ct6_stamp_flow(e->fe_addr, e->fe_port, e->nat_addr, e->nat_port, p->b.proto, now);
			else
				ekp_ct6_stamp_flow(e->fe_addr, e->fe_port, p->saddr, p->b.sport, p->b.proto, now);
		}
		int snat = e->flags & EKP_CT_SNAT;
		const __be32 *sa = snat ? e->snat_addr : p->saddr, *da = e->nat_addr;
		__be16 sp = snat ? e->snat_port : p->b.sport, dp = e->nat_port;
		if (dir == EKP_CT_REPLY) {
			sa = e->fe_addr;
			sp = e->fe_port;
			da = snat ? e->nat_addr : p->daddr; /* back to the client */
			dp = snat ? e->nat_port : p->b.dport;
		}
		if (scope == EKP_SCOPE_INTERNAL && !ekp_source_routed_here6(skb, p, &w->fib, bridge)) {
			outcome = EKP_DROP_SPOOFED; /* redirected past the stack's reverse-path filter */
			verdict = TC_ACT_SHOT;
			goto out;
		}
		long rc = ekp_tc6_route(skb, w, sa, sp, da, dp);
		if (rc < 0)
			goto out;
		outcome = dir == EKP_CT_FORWARD ? EKP_STAT_CT_FORWARD : EKP_STAT_CT_REPLY;
		verdict = ekp_tc6_send(skb, w, rc, sa, sp, da, dp, &outcome);
		goto out;
	}

	/* A new flow: only its first packet starts one (a TCP segment without an entry belongs to a
	 * flow ip6tables translated, whose nf_conntrack entry the stack has). */
	if (p->b.proto == IPPROTO_TCP && !ekp_pure_syn(&p->b))
		goto out;
	struct ekp_frontend6_key fk = {};
	__builtin_memcpy(fk.addr, p->daddr, 16);
	fk.port = p->b.dport;
	fk.proto = p->b.proto;
	fk.scope = scope;
	struct ekp_frontend *fe = ekp_fe6_lookup(&fk);
	if (!fe)
		goto out;
	/* Whatever would take ip6tables for some of its backends takes it for all, decided before the
	 * choice: a flow this path chose a backend for and then left to ip6tables would be chosen for
	 * again there, and the backends that path reaches twice would get more than their share. A
	 * source translation is ip6tables' only while the node's IPv6 address is not known. */
	__u16 flags = fe->flags;
	const __be32 *node = ekp_tc6_node_addr(); /* the SNAT source (ekp_tc6_snat.h) */
	if (ekp_lb_refusal_af(1, fe, p->saddr) || (flags & EKP_FE_HOST_BACKEND) ||
	    (!node && (flags & (EKP_FE_SNAT_ALL | EKP_FE_SNAT_REMOTE))))
		goto out;
	/* A source not routed back by this device: not ours to translate past the stack, and not ours
	 * to drop either (IPv6 has no rp_filter: the stack and ip6tables do what they would without
	 * this path). A hit's packet is dropped instead (above): it would be redirected. */
	if (scope == EKP_SCOPE_INTERNAL && !ekp_source_routed_here6(skb, p, &w->fib, bridge))
		goto out;
	struct ekp_flow *f = &w->flow;
	__u32 aff_hit = 0;
	__builtin_memset(f, 0, sizeof(*f));
	if (ekp_pick_backend_af(1, fe, p->saddr, bpf_get_prandom_u32(), NULL, now, f, w->be6, &aff_hit))
		goto out;
	/* Without the node's IPv6 address, a hairpin (the client chose itself) needs ip6tables'
	 * source translation, and ip6tables chooses again, as no map says before the choice which
	 * clients are backends of this frontend: a client that is one of n backends of the Service
	 * then reaches itself with 1/n^2, and the others with more than 1/n. A host backend the
	 * planner did not flag yet (EKP_FE_HOST_BACKEND, a frontend written before it knew the flag)
	 * goes to the stack too. */
	int snat = ekp_tc6_wants_snat(flags, f->be_flags, w->be6, p->saddr);
	if ((f->be_flags & EKP_BE_HOST) || (snat && !node))
		goto out;

	/* The reply tuple {backend, client or node, bport, cport or SNAT port}: its port is found
	 * before anything is written (the walk only looks up). */
	const __be32 *sa = p->saddr;
	__be16 sp = p->b.sport;
	__builtin_memcpy(rk->saddr, w->be6, 16);
	rk->sport = f->be_port;
	if (snat) {
		int reason = ekp_tc6_snat_port(w, node, cfg, now);
		if (reason) {
			outcome = reason;
			verdict = TC_ACT_SHOT;
			goto out;
		}
		sa = node;
		sp = f->snat_port;
	} else {
		__builtin_memcpy(rk->daddr, p->saddr, 16);
		rk->dport = p->b.sport;
	}
	long rc = ekp_tc6_route(skb, w, sa, sp, w->be6, f->be_port);
	if (rc < 0)
		goto out;

	/* The reply entry first: a reply can never beat its entry. */
	struct ekp_ct6_entry *fwd = &w->fwd, *rev = &w->rev;
	__builtin_memset(rev, 0, sizeof(*rev));
	rev->last_seen_ns = now;
	__builtin_memcpy(rev->fe_addr, p->daddr, 16);
	rev->fe_port = p->b.dport;
	rev->svc_id = fe->svc_id;
	rev->backend_id = f->backend_id;
	rev->created_s = now / EKP_NSEC;
	if (snat) {
		rev->flags = EKP_CT_SNAT;
		__builtin_memcpy(rev->nat_addr, p->saddr, 16);
		rev->nat_port = p->b.sport;
	}
	__builtin_memcpy(fwd, rev, sizeof(*fwd));
	__builtin_memcpy(fwd->nat_addr, w->be6, 16);
	fwd->nat_port = f->be_port;
	if (snat) {
		__builtin_memcpy(fwd->snat_addr, sa, 16);
		fwd->snat_port = sp;
	}
	k->dir = EKP_CT_FORWARD;
	if (snat) {
		int reason = ekp_ct6_place(rk, rev);
		if (reason) {
			outcome = reason;
			verdict = TC_ACT_SHOT;
			goto out;
		}
	} else if (ekp_ct6_insert(rk, rev) < 0) {
		/* this tuple's earlier flow (same frontend), a dead one, or a closed one (this packet is a
		 * SYN: ekp_ct_reusable's rule, as the kernel's NAT takes a TIME_WAIT tuple): replaced; a
		 * live flow of another frontend: dropped, not left to ip6tables, which would pick the
		 * same tuple and see its replies rewritten to that frontend here (IPv4 moves the port
		 * instead) */
		struct ekp_ct6_entry *held = ekp_ct6_hit(rk, cfg, now);
		if (held && !ekp_ct_closed(held->flags) &&
		    (!ekp_addr6_eq(held->fe_addr, p->daddr) || held->fe_port != p->b.dport)) {
			outcome = EKP_DROP_TUPLE_TAKEN;
			verdict = TC_ACT_SHOT;
			goto out;
		}
		if (ekp_ct6_update(rk, rev) < 0) {
			outcome = EKP_DROP_CT_FULL;
			verdict = TC_ACT_SHOT;
			goto out;
		}
	}
	if (ekp_ct6_update(k, fwd) < 0) {
		ekp_ct6_delete(rk); /* no reply entry without its flow, as IPv4's ekp_ct_create */
		outcome = EKP_DROP_CT_FULL;
		verdict = TC_ACT_SHOT;
		goto out;
	}
	ekp_ct6_stamp_flow(p->daddr, p->b.dport, w->be6, f->be_port, p->b.proto, now);
	outcome = EKP_STAT_NEW_FLOWS;
	if (aff_hit)
		ekp_count(EKP_STAT_AFFINITY_HIT);
	if (snat)
		ekp_count(EKP_STAT_SNAT);
	if (f->early_drop)
		ekp_count(EKP_STAT_EARLY_DROP);
	verdict = ekp_tc6_send(skb, w, rc, sa, sp, w->be6, f->be_port, &outcome);
out:
	ekp_count(outcome);
	return verdict;
}

#endif /* EKP_TC6_H */
