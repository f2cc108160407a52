/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc6.h: the tc programs' IPv6 path (ekp_from_pod6, ekp_from_net6), reached from
 * ekp_from_pod / ekp_from_net by a tail call (ekp_tc.c), so the IPv4 programs' verification and
 * per-packet work do not grow with it (Cilium splits its programs per family the same way).
 * This file is the path's skb half; the order of its checks, shared with XDP's IPv6 path, is
 * ekp_decide6.h's (ekp_main6 there).
 *
 *   parse (ekp_parse6.h) -> a fragment: its ports recorded or looked up, or held (ekp_frag6.h)
 *                        -> conntrack (ekp_ct6.h: IPv4's conntrack code for IPv6, FORWARD then
 *                           REPLY, ekp_ct6_tcp / ekp_ct6_any, early-drop rings ekp_ctq6_*)
 *                        -> new flow: frontend (ekp_fe6), refusal (ekp_lb.h, v6 = 1; answered or
 *                           dropped: ekp_tc6_refuse) and backend (ekp_lb.h),
 *                           source translation decided (ekp_tc6_wants_snat), or a direct
 *                           connection on a live flow's tuple (ekp_ct6_reclaim)
 *                        -> route (bpf_fib_lookup), entries and SNAT port (ekp_ct6_create: IPv4's
 *                           walk, ekp_snat_af.h), rewrite (ekp_nat6.h), hop limit - 1, redirect;
 *                           legacy host routing: the destination rewritten, the source left in
 *                           ekp_hostnat6 under a tag, TC_ACT_OK (ekp_host6.h: IPv4's ekp_host_af.h),
 *                           and ekp_egress6 (tail-called by ekp_egress) gives the source at egress
 *   an ICMPv6 error      -> conntrack of the quoted flow (ekp_tc6_related) -> route, outer and
 *                           quote rewritten, hop limit - 1, redirect (to a backend on the node's
 *                           own address: rewritten, TC_ACT_OK); one the node's stack sends about a
 *                           flow handed to it: its frontend back at egress (ekp_tc6_local_related)
 *
 * What it translates: TCP, UDP and SCTP flows to a frontend, with the source translated to the
 * node's IPv6 address (ekp_cfg6) where IPv4 would translate it (SNAT_ALL, SNAT_REMOTE with a remote
 * backend, a hairpin), their fragments and the ICMPv6 errors about them, as IPv4's path does:
 *   - SCTP as IPv4's: an INIT opens an association (ekp_ct6_any, IPv4's SCTP timeouts), the
 *     rewrite updates its CRC32c for the new ports (ekp_nat6.h, ekp_sctp.h: the CRC covers no
 *     pseudo header, so addresses are plain stores); its fragments go to the stack (the first
 *     holds the CRC but not the length the update needs: ekp_parse6 passes them). An association
 *     ip6tables translated before has no INIT to come: its chunks miss and go to the stack, whose
 *     nf_conntrack entry serves them, so nothing is carried at a restart (UDP's flows are);
 *   - fragments (ekp_frag6.h: IPv4's code, ekp_frag_af.h and ekp_tc_frag_af.h, for IPv6): the first
 *     fragment decides and records its ports under (addresses, fragment id); the later ones follow
 *     it (a hit translates their addresses; they never start a flow); one that comes before its
 *     first is held (ekp_frhold6) when a translated flow may use its addresses, and put back into
 *     its device when the first comes; else the stack reassembles it;
 *   - ICMPv6 errors quoting a packet of a flow of this path, TCP, UDP or SCTP (ekp_tc6_related);
 *   - UDP flows ip6tables translated before this path took UDP (a restart, an upgrade): the agent
 *     carries them from nf_conntrack into ekp_ct6_any before the programs attach
 *     (agent/takeover/into_ebpf.py, _carry6), so their next datagrams keep their backend rather
 *     than being decided again (a UDP datagram has no first packet to tell a new flow by).
 * And it refuses a new flow's first packet as IPv4's path does, decided by the same code
 * (ekp_lb_refusal_af, ekp_decide_refusal; ekp_tc6_refuse), counted under the same reasons: no
 * endpoints answered with an ICMPv6 port unreachable from the frontend (ip6tables' REJECT),
 * rate-limited as IPv4's rejects; no local endpoint and source ranges dropped (kube-proxy's
 * KUBE-MARK-DROP). A segment that opens no flow still goes to the stack (upstream's REJECT
 * matches new connections; a flow ip6tables translated keeps its nf_conntrack entry); the later
 * fragments of a refused UDP datagram are dropped under its reason, unanswered, as IPv4's are (a
 * TCP segment's go to the stack with it).
 * A frame to a link-layer broadcast or multicast address is never answered (ekp_icmp6_wanted).
 * Every other packet goes to the node's stack untouched, where the ip6tables proxier beside the
 * eBPF programs (agent/metaproxier.py, EbpfAndIp6tables) holds the rules of exactly the service
 * ports whose packets this path and the socket programs leave there (agent/model/tc6_leaves.py;
 * a port they serve whole has no rule there):
 *   - a frontend that would need ip6tables for some of its backends, left whole before the choice
 *     so that one proxier chooses among all its backends (and one owns its affinity): while the
 *     node's IPv6 address is not known (ekp_cfg6 zero), one that asks SNAT (EKP_FE_SNAT_ALL,
 *     EKP_FE_SNAT_REMOTE: its local backends too); then a hairpin as well (the client is its own
 *     backend: known only after the choice, see there);
 *   - a mid-flow TCP segment or SCTP chunk without an entry (a flow ip6tables translated before:
 *     nf_conntrack has it);
 *   - ICMPv6 but errors about a flow translated here (Packet Too Big, destination unreachable,
 *     time exceeded, parameter problem: ekp_tc6_related translates those back, as nf_nat does for
 *     the flows ip6tables translated), a new flow's first packet at its last hop (the stack
 *     answers it), no route. A packet of a flow of the path too big for its route or at its last
 *     hop is answered here (ekp_tc6_answer: Packet Too Big, time exceeded; nothing for a later
 *     fragment, whose quote would hold no ports), as IPv4's path answers one too big: the stack
 *     has no nf_conntrack entry for the flow. So is a new flow's first packet too big for its
 *     backend's route (Packet Too Big, before any entry is made): ip6tables may hold no rule for
 *     its frontend, and the stack would route it untranslated, the client never told.
 * Conntrack is IPv4's, the same code (ekp_ct_af.h): state and timeouts, twins rebuilt, orphaned
 * flows, closed flows reclaimed by a SYN, the early-drop ring, the SNAT port walk. A new flow whose
 * reply tuple a live flow of another frontend holds (one client port to one backend through two
 * frontends), and a direct connection on a live flow's tuple, keep the client's address with
 * another source port (EKP_CT_SNAT with the client's own address, EKP_STAT_PORT_REMAP), as
 * ip6tables' nf_nat would; not left to ip6tables, whose nf_conntrack knows nothing of the flow
 * holding the tuple.
 * The reply of a flow this path translated comes back through ekp_from_pod6 (a local backend) or
 * ekp_from_net6 (a remote one) and gets its frontend back from the REPLY entry (and its client, when
 * the source was translated).
 * A backend on the node's own address (EKP_BE_HOST, a host-network endpoint), either routing, as
 * IPv4's: its flows (EKP_CT_HOST) keep the client's address whatever the frontend's SNAT flags,
 * are rewritten at ingress and delivered by the node's stack (TC_ACT_OK, no route, no hop spent),
 * and the stack's replies leave through ekp_egress6 (ekp_tc6_local), which gives them their
 * frontend back from the REPLY entry, the fragments of a reply the stack fragmented too (their
 * first records their ports). An ICMPv6 error about such a flow's reply (to the node) is
 * rewritten and handed to the stack without a route (ekp_tc6_related); one the node's stack sends
 * about a flow it was handed (such a flow's, or under legacy host routing any flow's) goes to the
 * client through ekp_egress6 and gets its frontend back (ekp_tc6_local_related), a masqueraded
 * flow's through its tag-0 ekp_hostnat6_v2 entry (the stack's reply tuple, IPv4's code:
 * ekp_host_af.h), which gives a RST the stack sends about such a flow its frontend too.
 * Ahead of ekp_from_net6, XDP's IPv6 path (ekp_xdp6.h) runs the same order (ekp_decide6.h) on the
 * XDP buffer: it
 * carries out drops, new flows to a backend on another node and hits when the route leaves by the
 * device the packet came in by, and passes everything else here untouched, before any side
 * effect; an entry either hook wrote is the entry both read.
 */
#ifndef EKP_TC6_H
#define EKP_TC6_H

#include <linux/pkt_cls.h>

#include "ekp_act.h"
#include "ekp_ct6.h"
#include "ekp_decide.h"
#include "ekp_frag6.h"
#include "ekp_icmp6.h"
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
	struct bpf_fib_lookup fib;
	struct ekp_flow6 flow;
	struct ekp_ctq6_req queue; /* a flow that began or closed, for the early-drop ring */
	long rc;                   /* a new flow's route (ekp_tc6_route), kept across ekp_ct6_create */
	__u8 reopens;              /* a SYN on an ended flow's FORWARD entry, or a datagram of a UDP flow
				    * whose backend left its Service (ekp_ct_usable_forward): that flow's
				    * entries go if the packet goes to the stack (see ekp_main6's end) */
	struct ekp_icmp6_nat icmp; /* an ICMPv6 error's translation (ekp_tc6_related) */
	__be32 node[4];            /* the node's IPv6 address for a new flow (ekp_tc6_node_addr) */
	struct ekp_icmp6_work icmp6; /* the ICMPv6 error answering a segment (ekp_tc6_answer) */
	struct ekp_fraghold frag;  /* a fragment to hold, or a first fragment saved while the held go
				    * back (ekp_tc_frag6_hold, ekp_tc_frag6_release) */
	struct ekp_snat6_state snat; /* the SNAT port walk's (ekp_snat_af.h) */
};

static __always_inline struct ekp_tc6_scratch *ekp_scratch6_lookup(void);

#include "ekp_host6.h" /* its egress half parses into the scratch above */

/* The route of a tuple from the device `ifindex`, for either hook (`ctx`: the skb, or the XDP
 * buffer of ekp_xdp6.h). */
static __always_inline long ekp_fib6_from(void *ctx, __u32 ifindex, struct bpf_fib_lookup *fib,
					  const struct ekp_pkt6 *p, const __be32 *saddr, const __be32 *daddr,
					  __be16 sport, __be16 dport, __u16 tot_len)
{
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->tot_len = tot_len; /* ekp_seg_len: checked against the route's MTU (ekp_fib) */
	fib->family = AF_INET6;
	fib->l4_protocol = p->b.proto;
	fib->sport = sport;
	fib->dport = dport;
	__builtin_memcpy(fib->ipv6_src, saddr, 16);
	__builtin_memcpy(fib->ipv6_dst, daddr, 16);
	fib->ifindex = ifindex;
	return bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
}

static __always_inline long ekp_fib6(struct __sk_buff *skb, struct bpf_fib_lookup *fib, const struct ekp_pkt6 *p,
				     const __be32 *saddr, const __be32 *daddr, __be16 sport, __be16 dport,
				     __u16 tot_len)
{
	return ekp_fib6_from(skb, skb->ingress_ifindex, fib, p, saddr, daddr, sport, dport, tot_len);
}

/* ekp_source_routed_here for IPv6: the route back to the source leaves by the device the packet
 * came in on (or the bridge of its port, ekp_port_bridge), what the stack's reverse-path check would
 * ask. */
static __always_inline int ekp_source_routed_here6(struct __sk_buff *skb, const struct ekp_pkt6 *p,
						   struct bpf_fib_lookup *fib)
{
	long rc = ekp_fib6(skb, fib, p, p->daddr, p->saddr, p->b.dport, p->b.sport, 0);

	return (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH ||
		rc == BPF_FIB_LKUP_RET_FRAG_NEEDED) &&
	       (fib->ifindex == skb->ingress_ifindex || ekp_port_bridge(skb) == fib->ifindex);
}

/* The route of the translated tuple into w->fib: SUCCESS or NO_NEIGH; FRAG_NEEDED, too big for it
 * (w->fib.mtu_result: a new flow's first packet is answered with Packet Too Big, ekp_main6; an
 * ICMPv6 error goes to the stack); or -1 to hand the packet untouched to the stack (no route here).
 * Looked up before anything is written. */
static __always_inline long ekp_tc6_route(struct __sk_buff *skb, struct ekp_tc6_scratch *w, const __be32 *saddr,
					  __be16 sport, const __be32 *daddr, __be16 dport)
{
	long rc = ekp_fib6(skb, &w->fib, &w->pkt, saddr, daddr, sport, dport, ekp_seg_len(skb, &w->pkt.b));

	return rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED
		       ? rc
		       : -1;
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

/* Answers a segment of a flow of the path with an ICMPv6 error (ekp_icmp6.h: Packet Too Big with
 * `word` the MTU, or time exceeded), out of the device it came in by, as IPv4's path answers a
 * segment too big for the backend's device (ekp_tc_apply.h): the node's stack has no nf_conntrack
 * entry for the flow. Packet Too Big is not rate-limited (the kernel's icmpv6_xrlim_allow exempts
 * it, as IPv4's fragmentation needed: path-MTU discovery depends on it); time exceeded takes a
 * token of the rejects' bucket (ekp_ratelimit.h; the kernel limits both families' errors by one
 * global bucket too). The TC verdict; the segment itself is dropped. */
static __always_inline int ekp_tc6_answer(struct __sk_buff *skb, struct ekp_tc6_scratch *w,
					  const struct ekp_config *cfg, __u8 type, __u32 word, __u32 *outcome)
{
	*outcome = type == EKP_ICMPV6_PKT_TOOBIG ? EKP_DROP_FRAG_NEEDED : EKP_DROP_HOP_LIMIT;
	if (!ekp_icmp6_wanted(&w->pkt))
		return TC_ACT_SHOT;
	if (type != EKP_ICMPV6_PKT_TOOBIG && !ekp_icmp_allowed(cfg, bpf_ktime_get_ns())) {
		*outcome = EKP_DROP_ICMP_RATE;
		return TC_ACT_SHOT;
	}
	if (ekp_icmp6_error(skb, &w->pkt, type, 0, word, &w->icmp6) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* A new flow's first packet refused by its frontend (`refusal`, ekp_lb_refusal_af), decided as
 * IPv4's packet path decides it (ekp_decide_refusal): no endpoints answered with an ICMPv6 port
 * unreachable from the frontend, out of the device it came in by (ip6tables' `-j REJECT`), unless
 * unwanted (ekp_icmp6_wanted) or over the rejects' rate limit; source ranges and no local endpoint
 * dropped (kube-proxy's KUBE-MARK-DROP). Counted under IPv4's reasons. The TC verdict. */
static __always_inline int ekp_tc6_refuse(struct __sk_buff *skb, struct ekp_tc6_scratch *w,
					  const struct ekp_config *cfg, const struct ekp_frontend *fe, int refusal,
					  __u32 *outcome)
{
	int wanted = ekp_icmp6_wanted(&w->pkt) && w->pkt.b.frag != EKP_FRAG_LATER;

	if (ekp_decide_refusal(refusal, fe, wanted, cfg, bpf_ktime_get_ns(), outcome) != EKP_ACT_REJECT)
		return TC_ACT_SHOT;
	if (ekp_icmp6_error(skb, &w->pkt, EKP_ICMPV6_DEST_UNREACH, EKP_ICMPV6_PORT_UNREACH, 0, &w->icmp6) < 0)
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

/* Rewrites the packet to the translated tuple and forwards it (ekp_tc6_forward); under legacy host
 * routing (EKP_CFG_HOST_LEGACY) rewrites the destination alone and hands it to the stack, its
 * source left for egress (ekp_host6_hand_over, IPv4's code). The flag is read here, after the SNAT
 * walk: a value held across it would split the verifier's states. The TC verdict. */
static __always_inline int ekp_tc6_send(struct __sk_buff *skb, struct ekp_tc6_scratch *w, long rc,
					const __be32 *saddr, __be16 sport, const __be32 *daddr, __be16 dport,
					__u32 *outcome, int host)
{
	const struct ekp_config *cfg = ekp_config_get();

	/* A backend on the node's own address (EKP_CT_HOST), either routing: rewritten and delivered
	 * by the stack (no route to look up, no hop to spend); its replies leave through ekp_egress6,
	 * which gives them their frontend back (ekp_tc6_local), as IPv4's (ekp_tc_apply.h). */
	if (host) {
		if (ekp_rewrite6(skb, &w->pkt, saddr, sport, daddr, dport) < 0) {
			*outcome = EKP_DROP_MALFORMED;
			return TC_ACT_SHOT;
		}
		return TC_ACT_OK;
	}
	if (cfg && (cfg->flags & EKP_CFG_HOST_LEGACY))
		return ekp_host6_hand_over(skb, &w->pkt, saddr, sport, daddr, dport, outcome);
	if (ekp_rewrite6(skb, &w->pkt, saddr, sport, daddr, dport) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	return ekp_tc6_forward(skb, w, rc, outcome);
}

/* The translated tuple of a hit on `e` under the key w->key (read only: XDP routes it before the
 * hit moves the flow, ekp_xdp6.h): the backend (and the SNAT source of a remapped port) forward,
 * the frontend (and the client's own port) in reply. */
static __always_inline void ekp_tc6_hit_tuple(const struct ekp_tc6_scratch *w, const struct ekp_ct6_entry *e,
					      const __be32 **sa, __be16 *sp, const __be32 **da, __be16 *dp)
{
	const struct ekp_pkt6 *p = &w->pkt;
	int snat = e->flags & EKP_CT_SNAT;

	if (w->key.dir == EKP_CT_FORWARD) {
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

/* A usable conntrack hit (ekp_decide_hit for this path): the flow moves on (ekp_ct_advance: its
 * state, the early-drop ring when it closes, the refresh that rebuilds a lost twin), counted in
 * `counters` (enum ekp_counters). -1 when the refresh deleted the entry (nothing set), else 0 with
 * the translated tuple set (ekp_tc6_hit_tuple). */
static __always_inline int ekp_tc6_hit_in(struct ekp_tc6_scratch *w, struct ekp_ct6_entry *e, __u64 now,
					  __u8 counters, const __be32 **sa, __be16 *sp, const __be32 **da,
					  __be16 *dp)
{
	int advanced = ekp_ct6_advance(e, &w->key, &w->pkt.b, now, &w->queue);
	if (advanced < 0)
		return -1; /* the refresh deleted the entry: no hit (ekp_ct_refresh) */
	if (advanced)
		ekp_count_in(counters, EKP_STAT_CT_REBUILT);
	ekp_tc6_hit_tuple(w, e, sa, sp, da, dp);
	return 0;
}

static __always_inline int ekp_tc6_hit(struct ekp_tc6_scratch *w, struct ekp_ct6_entry *e, __u64 now,
				       const __be32 **sa, __be16 *sp, const __be32 **da, __be16 *dp)
{
	return ekp_tc6_hit_in(w, e, now, EKP_COUNT_TC, sa, sp, da, dp);
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

/* The frontend key of a packet among the frontends of `scope` (ekp_frontend_lookup's IPv6 twin):
 * the one both hooks build (ekp_main6, ekp_xdp6.h), into the caller's `k`. */
static __always_inline void ekp_fe6_key_of(struct ekp_frontend6_key *k, const struct ekp_pkt6 *p, __u8 scope)
{
	__builtin_memcpy(k->addr, p->daddr, 16);
	k->port = p->b.dport;
	k->proto = p->b.proto;
	k->scope = scope;
}

/* The node's IPv6 address, the source of IPv6 SNAT (ekp_cfg6, written by the agent from the IPv6
 * family's node address: the slot ekp_cfg6sel names, as ekp_config_get reads IPv4's), copied into
 * `out` (the scratch's `node`) once per packet, before the frontend's backend is chosen: the agent
 * rewrites a slot only after flipping the selector away from it, so a copy taken at once is one
 * address, where a pointer kept across the choice could read a slot rewritten meanwhile (two
 * writes during one packet). 0 when none is known: such flows are left to the stack, where
 * ip6tables masquerades them. */
static __always_inline int ekp_tc6_node_addr(__be32 *out)
{
	__u32 zero = 0;
	struct ekp_config_sel *sel = ekp_cfg6sel_lookup(&zero);
	__u32 slot = sel ? (sel->slot & 1) : 0;
	struct ekp_config6 *c = ekp_cfg6_lookup(&slot);

	if (!c)
		return 0;
	__builtin_memcpy(out, c->node_addr, 16);
	return (out[0] | out[1] | out[2] | out[3]) != 0;
}

/* Whether a new flow to the backend just chosen is source-translated (ekp_decide_new's rule): the
 * frontend asks it (EKP_FE_SNAT_ALL, kube-proxy's KUBE-MARK-MASQ; EKP_FE_SNAT_REMOTE and the
 * backend on another node: a NodePort, external IP or LB IP of policy Cluster reached from
 * outside), or a hairpin (the client is its own backend: its stack would drop a packet from its own
 * address). */
static __always_inline int ekp_tc6_wants_snat(__u16 fe_flags, __u8 be_flags, const __be32 *be6, const __be32 *client)
{
	if (be_flags & EKP_BE_HOST)
		return 0; /* a backend on the node's own address keeps the client's (the caller: why) */
	return (fe_flags & EKP_FE_SNAT_ALL) || ((fe_flags & EKP_FE_SNAT_REMOTE) && !(be_flags & EKP_BE_LOCAL)) ||
	       ekp_addr6_eq(be6, client);
}

/* The translation of the ICMPv6 error in w->pkt into w->icmp (ekp_tc6_related's comment): the
 * direction of the entry it was found by (EKP_CT_REPLY: the quoted packet went client -> backend,
 * the error goes to the client; EKP_CT_FORWARD: to the backend, `host` set for one on the node's
 * own address), or -1 for none (no live flow, or not addressed to the quoted packet's source). */
static __always_inline int ekp_tc6_related_nat(struct ekp_tc6_scratch *w, const struct ekp_config *cfg, __u64 now,
					       int *host)
{
	const struct ekp_pkt6 *p = &w->pkt;
	struct ekp_icmp6_nat *n = &w->icmp;
	struct ekp_ct6_key *k = &w->key;

	if (!ekp_addr6_eq(p->daddr, p->in_saddr))
		return -1;
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
	struct ekp_ct6_entry *e = ekp_ct6_lookup(k);
	if (e && ekp_ct6_life(e, k, cfg, now) == EKP_CT_LIVE) {
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
		e = ekp_ct6_lookup(k);
		if (!e || ekp_ct6_life(e, k, cfg, now) != EKP_CT_LIVE)
			return -1;
		*host = (e->flags & EKP_CT_HOST) != 0;
		__builtin_memcpy(n->in_saddr, e->nat_addr, 16);
		n->in_sport = e->nat_port;
		__builtin_memcpy(n->daddr, e->nat_addr, 16);
		if (e->flags & EKP_CT_SNAT) { /* the node's address and port the backend knows the flow by */
			__builtin_memcpy(n->in_daddr, e->snat_addr, 16);
			n->in_dport = e->snat_port;
			__builtin_memcpy(n->saddr, e->snat_addr, 16);
		}
	}
	return k->dir;
}

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
 * no live flow of this path, or with no route here, goes to the stack untouched, as before; so does
 * one not addressed to the quoted packet's source (the address the flow's entry knows that end by,
 * the key's destination), as nf_conntrack_inet_error gives it no conntrack (ekp_decide_related).
 * An error on its way to a backend on the node's own address (EKP_CT_HOST: Packet Too Big about
 * its reply through a NodePort) is rewritten and handed to the stack, whose route is only local. */
static __always_inline int ekp_tc6_related(struct __sk_buff *skb, struct ekp_tc6_scratch *w, __u8 scope,
					   const struct ekp_config *cfg, __u32 *outcome)
{
	const struct ekp_pkt6 *p = &w->pkt;
	struct ekp_icmp6_nat *n = &w->icmp;
	int host = 0;

	if (ekp_tc6_related_nat(w, cfg, bpf_ktime_get_ns(), &host) < 0)
		return TC_ACT_OK;
	if (scope == EKP_SCOPE_INTERNAL && !ekp_source_routed_here6(skb, p, &w->fib)) {
		*outcome = EKP_DROP_SPOOFED; /* redirected past the stack's reverse-path filter */
		return TC_ACT_SHOT;
	}
	/* A backend on the node's own address (EKP_CT_HOST): its route is local, so the error is
	 * rewritten and delivered by the stack, no hop spent, as ekp_tc6_send's host branch does */
	long rc = host ? BPF_FIB_LKUP_RET_SUCCESS : ekp_tc6_route(skb, w, n->saddr, 0, n->daddr, 0);
	if (rc < 0 || rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
		return TC_ACT_OK;
	if (ekp_rewrite_icmp6_err(skb, p, n) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	*outcome = EKP_STAT_CT_RELATED;
	return host ? TC_ACT_OK : ekp_tc6_forward(skb, w, rc, outcome);
}

/* Legacy host routing: the tag-0 entry (ekp_host6_note_stack_reply, IPv4's code) of an ICMPv6 error
 * the node's stack sends about a masqueraded flow, quoting the packet as the stack saw it
 * (client -> backend, or a reply's backend -> client), which no conntrack key holds: the outer
 * source and the quote's destination get the source that flow's replies get (the frontend, or the
 * node's SNAT address and port for an error about a reply), as IPv4's ekp_decide_stack_reply gives
 * them, into w->icmp. 0 when there is none. */
static __always_inline int ekp_tc6_stack_related(struct ekp_tc6_scratch *w, const struct ekp_config *cfg)
{
	const struct ekp_pkt6 *p = &w->pkt;
	struct ekp_icmp6_nat *n = &w->icmp;

	if (!(cfg->flags & EKP_CFG_HOST_LEGACY))
		return 0;
	struct ekp_hostnat6 *v = ekp_host6_stack_reply(p, 1);
	if (!v)
		return 0;
	__builtin_memcpy(n->saddr, v->saddr, 16);
	__builtin_memcpy(n->daddr, p->daddr, 16);
	__builtin_memcpy(n->in_saddr, p->in_saddr, 16);
	n->in_sport = p->b.in_sport;
	__builtin_memcpy(n->in_daddr, v->saddr, 16);
	n->in_dport = v->sport;
	return 1;
}

/* An ICMPv6 error the node's own stack sends about a flow handed to it (legacy host routing: an
 * ip6tables REJECT in FORWARD, address unreachable for a dead backend; either routing, a backend
 * on the node's own address: port unreachable from a closed UDP port), the egress twin of
 * ekp_tc6_related as IPv4's ekp_decide_local is of ekp_decide_related: it quotes client -> backend
 * and goes to the client, so the flow's REPLY entry gives the quote and the outer source their
 * frontend back (nf_nat's translation of a RELATED error), and the stack's route stands. A
 * masqueraded flow's (the stack saw the client, the REPLY entry knows the node's SNAT port) is
 * found, under legacy host routing, by its tag-0 ekp_hostnat6_v2 entry (ekp_tc6_stack_related), as
 * IPv4's. Left untranslated: an error toward the backend found through a FORWARD entry. Counted
 * only when translated. */
static __always_inline int ekp_tc6_local_related(struct __sk_buff *skb, struct ekp_tc6_scratch *w)
{
	const struct ekp_config *cfg = ekp_config_get();
	int host = 0;

	if (!cfg)
		return TC_ACT_OK;
	int dir = ekp_tc6_related_nat(w, cfg, bpf_ktime_get_ns(), &host);
	if (dir == EKP_CT_FORWARD || (dir < 0 && !ekp_tc6_stack_related(w, cfg)))
		return TC_ACT_OK;
	__u32 outcome = EKP_STAT_CT_RELATED;
	int verdict = TC_ACT_OK;
	if (ekp_rewrite_icmp6_err(skb, &w->pkt, &w->icmp) < 0) {
		outcome = EKP_DROP_MALFORMED;
		verdict = TC_ACT_SHOT;
	}
	ekp_count(EKP_STAT_PACKETS);
	ekp_count(outcome);
	return verdict;
}

/* Legacy host routing: a TCP RST or UDP datagram the node's stack sends about a masqueraded flow
 * (an ip6tables REJECT with tcp-reset in FORWARD), with the tuple the stack saw (backend -> client),
 * which no conntrack key holds: its tag-0 ekp_hostnat6_v2 entry gives it the source the flow's
 * replies get (the frontend), as IPv4's ekp_decide_stack_reply does, so the client's socket takes
 * it as the answer to what it sent. Counted (PACKETS, CT_REPLY) only when translated. */
static __always_inline int ekp_tc6_stack_reply(struct __sk_buff *skb, struct ekp_tc6_scratch *w,
					       const struct ekp_config *cfg)
{
	struct ekp_pkt6 *p = &w->pkt;

	if (!(cfg->flags & EKP_CFG_HOST_LEGACY))
		return TC_ACT_OK;
	struct ekp_hostnat6 *v = ekp_host6_stack_reply(p, 0);
	if (!v)
		return TC_ACT_OK;
	__be32 sa[4];
	__builtin_memcpy(sa, v->saddr, 16);
	__be16 sp = v->sport;
	__u32 outcome = EKP_STAT_CT_REPLY;
	int verdict = TC_ACT_OK;
	if (ekp_rewrite6(skb, p, sa, sp, p->daddr, p->b.dport) < 0) {
		outcome = EKP_DROP_MALFORMED;
		verdict = TC_ACT_SHOT;
	}
	ekp_count(EKP_STAT_PACKETS);
	ekp_count(outcome);
	return verdict;
}

/* The node's own IPv6 packets at tc egress (ekp_egress6; ekp_egress sends it those with no
 * ingress device): the replies of flows handed to its stack (a backend on the node's own address,
 * EKP_CT_HOST; a direct connection to it moved to another port) get their frontend back from the
 * REPLY entry (and the client's own port), as IPv4's (ekp_decide_local). The fragments of such a
 * reply the stack fragmented follow their first. Under legacy host routing, a RST or datagram the
 * stack sends about a masqueraded flow gets its frontend from the flow's tag-0 entry
 * (ekp_tc6_stack_reply). Counted only when translated (PACKETS and CT_REPLY): the node's own
 * traffic is not the data path's. Anything else leaves untouched, after the activity check. */
static __always_inline int ekp_tc6_local(struct __sk_buff *skb)
{
	struct ekp_tc6_scratch *w = ekp_scratch6_lookup();
	if (!w)
		return TC_ACT_OK; /* cannot happen: a one-element per-CPU array */
	struct ekp_pkt6 *p = &w->pkt;
	__builtin_memset(p, 0, sizeof(*p));
	int parsed = ekp_parse6(skb, p);
	if (parsed == EKP_PARSE_ICMP_ERR)
		return ekp_tc6_local_related(skb, w);
	if (parsed == EKP_PARSE_LATER) {
		if (!ekp_frag6_ports(p))
			return TC_ACT_OK;
	} else if (parsed != EKP_PARSE_OK) {
		return TC_ACT_OK;
	} else if (p->b.frag == EKP_FRAG_FIRST) {
		ekp_frag6_record(p);
	}
	const struct ekp_config *cfg = ekp_config_get();
	if (!cfg)
		return TC_ACT_OK;
	/* A reply's source is a flow's endpoint (the backend, or a host backend's port). Under legacy
	 * host routing so is the destination of the stack's own RST toward a backend about a
	 * masqueraded reply (client -> backend, the tuple the stack saw: ekp_tc6_stack_reply), whose
	 * source, the client, is no endpoint: checked too, or such a RST skipped the lookups. */
	if (ekp_act_armed()) {
		__u32 t = ekp_act_stamp_of(bpf_ktime_get_coarse_ns());
		__u32 span = ekp_ct_longest_stamps(cfg, p->b.proto);
		if (ekp_act_idle(ekp_fold6(p->saddr), p->b.sport, p->b.proto, t, span) &&
		    (!(cfg->flags & EKP_CFG_HOST_LEGACY) ||
		     ekp_act_idle(ekp_fold6(p->daddr), p->b.dport, p->b.proto, t, span)))
			return TC_ACT_OK;
	}
	__u64 now = bpf_ktime_get_ns();
	struct ekp_ct6_key *k = &w->key;
	__builtin_memset(k, 0, sizeof(*k));
	ekp_ct6_key_of(k, p, EKP_CT_REPLY);
	struct ekp_ct6_entry *e = ekp_ct6_lookup(k);
	if (!e || !ekp_ct6_alive(e, k, cfg, now) || !ekp_ct6_usable_reply(e, &p->b))
		return ekp_tc6_stack_reply(skb, w, cfg);
	const __be32 *sa, *da;
	__be16 sp, dp;
	w->queue.want = 0;
	if (ekp_tc6_hit(w, e, now, &sa, &sp, &da, &dp) < 0)
		return TC_ACT_OK;
	__u32 outcome = EKP_STAT_CT_REPLY;
	int verdict = TC_ACT_OK;
	if (ekp_rewrite6(skb, p, sa, sp, da, dp) < 0) {
		outcome = EKP_DROP_MALFORMED;
		verdict = TC_ACT_SHOT;
	}
	if (w->queue.want) {
		__u32 evicted = ekp_ctq6_push(&w->queue);
		if (evicted)
			ekp_count(evicted);
	}
	ekp_count(EKP_STAT_PACKETS);
	ekp_count(outcome);
	return verdict;
}

#endif /* EKP_TC6_H */
