/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_decide.h: what to do with a packet, decided from its parsed tuple alone (no skb): the
 * lookups, the backend and slot choice, conntrack, policy. The result (struct ekp_decision) is
 * applied by the hook that runs it: ekp_tc_apply.h for the tc programs; an XDP program or a
 * cgroup socket program shares this file and differs only in how it applies a decision.
 *
 *   ICMP error quoting TCP/UDP/SCTP -> conntrack of the quoted flow -> RELATED (translate it back)
 *   later fragment             -> ports of its first fragment (ekp_frag); none: HOLD when a
 *                                 translated flow may use its addresses (ekp_addr), else PASS
 *   first fragment             -> its ports recorded; `release` set when later ones are held
 *   TTL <= 1                   -> PASS (the stack answers with time exceeded, quoting the packet
 *                                 as its sender sent it)
 *   conntrack FORWARD hit      -> TRANSLATE to the backend (and the SNAT source); PASS while a
 *                                 flow taken over from nf_conntrack is still its (NFPASS), DROP
 *                                 HANDOVER while it is handed over (ekp_ct_af.h, nf_held)
 *   conntrack REPLY hit        -> TRANSLATE from the frontend (and back to the client if SNAT);
 *                                 PASS while NFPASS
 *   frontend hit               -> policy (source ranges, no endpoints: REJECT or DROP, mid-flow
 *                                 TCP: DROP NO_FLOW), backend, SNAT, conntrack -> TRANSLATE
 *   nothing                    -> PASS (a TCP SYN or a UDP datagram first checks that its reverse
 *                                 tuple is not a translated flow's, ekp_ct_reclaim)
 * Under XDP (enum ekp_hook) fragments, ICMP errors, misses, rejects and new flows to local
 * backends PASS before any side effect: the tc program decides them as above.
 *
 * A packet that cannot belong to a translated flow leaves as early as its kind allows: anything
 * but IPv4 TCP/UDP/SCTP/ICMP errors after the parse, without a map lookup; a whole datagram whose
 * endpoints no live flow stamped and whose destination is no frontend after two array loads and
 * one hash lookup (ekp_act.h); one that may belong to a flow after the three lookups that could
 * claim it (FORWARD, REPLY, frontend); the FORWARD and REPLY tables are apart only by the key's
 * direction byte, so a flow's original tuple can never match its reply.
 *
 * ekp_decide_local decides for a packet the node's own stack sends (tc egress): the replies of
 * flows handed to the stack (a backend on the node's own address) get their frontend back.
 */
#ifndef EKP_DECIDE_H
#define EKP_DECIDE_H

#include "ekp_abi.h"
#include "ekp_act.h"
#include "ekp_ct.h"
#include "ekp_ctq.h"
#include "ekp_frag.h"
#include "ekp_icmp.h"
#include "ekp_lb.h"
#include "ekp_maps.h"
#include "ekp_parse.h"
#include "ekp_ratelimit.h"

enum ekp_action {
	EKP_ACT_PASS = 0,  /* hand the packet to the stack unchanged */
	EKP_ACT_DROP,      /* drop it (outcome: the reason) */
	EKP_ACT_TRANSLATE, /* rewrite it to the decided tuple and deliver it */
	EKP_ACT_REJECT,    /* answer it with an ICMP port unreachable from its destination */
	EKP_ACT_RELATED,   /* an ICMP error: rewrite outer and quoted tuples, deliver it */
	EKP_ACT_HOLD,      /* a later fragment before its first: keep it, put it back when the first
			    * comes (the hook's business: ekp_tc_frag.h for tc) */
};

/* The hook that runs a decision, a compile-time constant at each call site. XDP carries out only
 * what it can before the skb exists; it leaves the rest, untouched and before any side effect
 * (conntrack, affinity, rate limit), to the tc program behind it: fragments and ICMP errors,
 * packets that claim no flow and no frontend, rejects, and new flows to a local backend (delivered
 * into a pod's veth, which native XDP cannot do). What it does decide is this very code, on the
 * same maps: an entry XDP created is the entry tc finds. */
enum ekp_hook {
	EKP_HOOK_TC = 0,
	EKP_HOOK_XDP = 1,
};

struct ekp_decision {
	__u32 outcome;    /* enum ekp_stat the packet counts under (apply may turn it into a drop) */
	__u64 marks;      /* 1ULL << EKP_STAT_* of the marks to count (SNAT, AFFINITY_HIT, ...) */
	__be32 saddr;     /* the packet after translation (an ICMP error: its outer header) */
	__be32 daddr;
	__be16 sport;
	__be16 dport;
	__be16 in_sport;  /* ICMP errors: the quoted packet after translation */
	__be16 in_dport;
	__be32 in_saddr;
	__be32 in_daddr;
	__u8 action;      /* enum ekp_action */
	__u8 release;     /* a first fragment whose later fragments are held: put them back first */
	__u8 host;        /* TRANSLATE or RELATED to a backend on this node's own address (EKP_CT_HOST):
			   * hand the packet to the node's stack, whose replies leave by tc egress */
	__u8 pad;
};

/* Everything a decision works on, kept by the caller in a per-CPU array rather than on the stack:
 * the verifier does not track the contents of map memory, so values set on one path (an
 * affinity hit, a remapped port, the fragment kind) do not split its states where the paths
 * meet, which the SNAT port walk would otherwise be explored once for each of (it exceeded the
 * verifier's million instructions). It also keeps the 512-byte stack for the rest. */
struct ekp_work {
	struct ekp_pkt pkt;
	struct ekp_decision dec;
	struct ekp_flow flow;
	struct ekp_ctq_req queue; /* a flow that began or closed, for the early-drop queue */
};

static __always_inline void ekp_verdict(struct ekp_decision *d, __u8 action, __u32 outcome)
{
	d->action = action;
	d->outcome = outcome;
}

/* The live config: the slot ekp_cfgsel_v2 names (see struct ekp_config_sel). */
static __always_inline const struct ekp_config *ekp_config_get(void)
{
	__u32 zero = 0;
	struct ekp_config_sel *sel = ekp_cfgsel_lookup(&zero);
	__u32 slot = sel ? (sel->slot & 1) : 0;

	return ekp_cfg_lookup(&slot);
}

/* A usable conntrack hit: move the flow's state, refresh, and translate. A flow that closes
 * here is queued for early drop (ekp_ctq.h) under its FORWARD key. */
static __always_inline void ekp_decide_hit(struct ekp_ct_entry *ep, struct ekp_ct_key *k, const struct ekp_pkt *p,
					   __u64 now, struct ekp_decision *d, struct ekp_ctq_req *q)
{
	int advanced = ekp_ct_advance(ep, k, p, now, q);
	if (advanced < 0) {
		/* The refresh deleted the entry (another flow holds its twin key): a miss, as the flow's
		 * next packet will be; for a mid-flow segment that is NO_FLOW. */
		ekp_verdict(d, EKP_ACT_DROP, EKP_DROP_NO_FLOW);
		return;
	}
	if (advanced)
		d->marks |= 1ULL << EKP_STAT_CT_REBUILT;
	const struct ekp_ct_entry *e = ep;
	int snat = e->flags & EKP_CT_SNAT;

	if (k->dir == EKP_CT_FORWARD) {
		/* The entry holds the backend's address: a flow keeps it while its Service, slots and
		 * backend entries come and go (a Service deleted and recreated, a restart), as kube-proxy's
		 * DNAT in nf_conntrack does. UDP flows move off a backend that left the service
		 * (ekp_ct_usable_forward), as kube-proxy clears their conntrack entries. */
		d->saddr = snat ? e->snat_addr : p->saddr;
		d->sport = snat ? e->snat_port : p->sport;
		d->daddr = e->nat_addr;
		d->dport = e->nat_port;
		d->host = (e->flags & EKP_CT_HOST) != 0;
		ekp_verdict(d, EKP_ACT_TRANSLATE, EKP_STAT_CT_FORWARD);
	} else {
		d->saddr = e->fe_addr;
		d->sport = e->fe_port;
		d->daddr = snat ? e->nat_addr : p->daddr;
		d->dport = snat ? e->nat_port : p->dport;
		ekp_verdict(d, EKP_ACT_TRANSLATE, EKP_STAT_CT_REPLY);
	}
	if (p->frag == EKP_FRAG_LATER)
		d->marks |= 1ULL << EKP_STAT_FRAGMENTS;
}

/* A refusal (ekp_lb_refusal_af's reason) of either family's packet path: EKP_ACT_REJECT for a
 * frontend whose service has no endpoints (EKP_FE_NO_ENDPOINTS, count == 0): kube-proxy's
 * `-j REJECT`, an ICMP (ICMPv6) port unreachable from the frontend to the client, rate-limited
 * per CPU as the kernel's icmp_send; counted DROP_NO_ENDPOINTS, the flow is refused. `wanted`
 * says whether the packet is worth an answer (ekp_icmp_wanted, ekp_icmp6_wanted; never a later
 * fragment, whose quote would hold no ports): one that is not drops under the same counter, a
 * reject over the rate limit under DROP_ICMP_RATE. The other refusals drop, as kube-proxy's
 * KUBE-MARK-DROP does (source ranges; no local endpoint, whose reason stays that of the flag).
 * Sets *reason, returns EKP_ACT_REJECT or EKP_ACT_DROP. */
static __always_inline int ekp_decide_refusal(int refusal, const struct ekp_frontend *fe, int wanted,
					      const struct ekp_config *cfg, __u64 now, __u32 *reason)
{
	*reason = refusal;
	if (refusal != EKP_DROP_NO_ENDPOINTS || !(fe->flags & EKP_FE_NO_ENDPOINTS) || !wanted)
		return EKP_ACT_DROP;
	if (!ekp_icmp_allowed(cfg, now)) {
		*reason = EKP_DROP_ICMP_RATE;
		return EKP_ACT_DROP;
	}
	return EKP_ACT_REJECT;
}

/* Writes the flow `f` (conntrack), queues it for early drop and decides its first packet's
 * translation. */
static __always_inline void ekp_decide_create(const struct ekp_pkt *p, struct ekp_flow *f,
					      const struct ekp_config *cfg, __u64 now, struct ekp_decision *d,
					      struct ekp_ctq_req *q)
{
	int reason = ekp_ct_create(p, f, cfg, now);

	/* Counted whether the flow was made or not: the holder was deleted either way. */
	if (f->early_drop)
		d->marks |= 1ULL << EKP_STAT_EARLY_DROP;
	if (reason) {
		ekp_verdict(d, EKP_ACT_DROP, reason);
		return;
	}
	struct ekp_ct_key fkey = {};
	ekp_ct_key_of(&fkey, p, EKP_CT_FORWARD);
	ekp_ctq_want(q, &fkey, now / EKP_NSEC);
	d->saddr = (f->ct_flags & EKP_CT_SNAT) ? f->snat_addr : p->saddr;
	d->sport = (f->ct_flags & EKP_CT_SNAT) ? f->snat_port : p->sport;
	d->daddr = f->be_addr;
	d->dport = f->be_port;
	d->host = (f->ct_flags & EKP_CT_HOST) != 0;
	if (f->remapped)
		d->marks |= 1ULL << EKP_STAT_PORT_REMAP;
	else if (f->ct_flags & EKP_CT_SNAT)
		d->marks |= 1ULL << EKP_STAT_SNAT;
	ekp_verdict(d, EKP_ACT_TRANSLATE, EKP_STAT_NEW_FLOWS);
}

/* A packet to a frontend, without a usable conntrack entry. Returns 1 with `f` filled when it
 * starts a flow (the caller creates it), 0 when `d` already holds the verdict. */
static __always_inline int ekp_decide_new(const struct ekp_pkt *p, const struct ekp_frontend *fe,
					  const struct ekp_config *cfg, __u64 now, struct ekp_flow *f,
					  struct ekp_decision *d, __u8 hook)
{
	__u32 aff_hit = 0;

	int refusal = ekp_lb_refusal(fe, p->saddr);

	if (refusal == EKP_DROP_NO_ENDPOINTS && (fe->flags & EKP_FE_NO_ENDPOINTS) && hook == EKP_HOOK_XDP) {
		ekp_verdict(d, EKP_ACT_PASS, EKP_STAT_TO_TC); /* the reject is built on the skb */
		return 0;
	}
	if (refusal) {
		__u32 reason = refusal;
		int act = EKP_ACT_DROP; /* XDP's: its rejects went to tc above, and no reject code is in it */
		if (hook != EKP_HOOK_XDP)
			act = ekp_decide_refusal(refusal, fe, ekp_icmp_wanted(p) && p->frag != EKP_FRAG_LATER, cfg,
						 now, &reason);
		ekp_verdict(d, act, reason);
		return 0;
	}
	/* Only a SYN starts a TCP flow, only an INIT an SCTP one. Any other segment to a frontend
	 * without conntrack belongs to a flow we no longer have (evicted, expired): never sent to a
	 * newly chosen backend, which could only reset (or ABORT) it; dropped and counted while the
	 * flow may still come back (the surviving entry rebuilds its twin within a second). Later
	 * fragments never start flows. Under Maglev the backend is not newly chosen: the table names
	 * the one the flow had (on this node or any other with the same backends), so a TCP flow
	 * resumes there. */
	int resumes = p->proto == IPPROTO_TCP && !ekp_pure_syn(p);
	if (p->frag == EKP_FRAG_LATER || (resumes && !(fe->flags & EKP_FE_MAGLEV)) ||
	    (p->proto == IPPROTO_SCTP && p->chunk != EKP_SCTP_CID_INIT)) {
		ekp_verdict(d, EKP_ACT_DROP, EKP_DROP_NO_FLOW);
		return 0;
	}
	int reason = ekp_pick_backend(fe, p->saddr, bpf_get_prandom_u32(), p, now, f, &aff_hit);
	if (reason) {
		ekp_verdict(d, EKP_ACT_DROP, reason);
		return 0;
	}
	if (hook == EKP_HOOK_XDP && (f->be_flags & EKP_BE_LOCAL)) {
		ekp_verdict(d, EKP_ACT_PASS, EKP_STAT_TO_TC); /* into a pod's veth: tc's to deliver */
		return 0;
	}
	if (resumes)
		d->marks |= 1ULL << EKP_STAT_CT_RESUMED;
	d->marks |= (__u64)aff_hit << EKP_STAT_AFFINITY_HIT;
	f->svc_id = fe->svc_id;
	f->fe_addr = p->daddr;
	f->fe_port = p->dport;
	/* A backend on this node's own address (a host-network endpoint: the API server behind
	 * `kubernetes`) is reached through the node's stack, and its flows keep the client's address:
	 * kube-proxy's DNAT in PREROUTING delivers them locally, where no POSTROUTING masquerade runs
	 * (and a source translated to the node's own address would be a martian). */
	if (f->be_flags & EKP_BE_HOST) {
		f->ct_flags |= EKP_CT_HOST;
		return 1;
	}
	/* Masquerade: always (SNAT_ALL, kube-proxy's KUBE-MARK-MASQ), or toward backends on other
	 * nodes only (SNAT_REMOTE: the client address kept for local backends). Hairpin: a pod
	 * reaching itself through its service would get a packet from its own address, which its
	 * stack drops; like kube-proxy, translate the source to the node so the reply comes back. */
	if ((fe->flags & EKP_FE_SNAT_ALL) || ((fe->flags & EKP_FE_SNAT_REMOTE) && !(f->be_flags & EKP_BE_LOCAL)) ||
	    p->saddr == f->be_addr)
		f->ct_flags |= EKP_CT_SNAT;
	return 1;
}

/* A TCP SYN or a UDP datagram to no frontend whose reverse tuple is a live translated flow's
 * (`held_by`: its flags): the server already has a flow on this 4-tuple. The newcomer keeps its addresses and gets
 * another source port (a flow of its own, translated to itself), as nf_conntrack's NAT does; a
 * server on the node's own address (a host flow held it) is reached through the node's stack. */
static __always_inline void ekp_flow_direct(struct ekp_flow *f, const struct ekp_pkt *p, __u16 held_by)
{
	f->be_addr = p->daddr;
	f->be_port = p->dport;
	f->fe_addr = p->daddr;
	f->fe_port = p->dport;
	f->ct_flags = EKP_CT_SNAT | (held_by & EKP_CT_HOST); /* the server is the node's, as the flow's */
	f->remapped = 1;
	f->snat_addr = p->saddr;
}

/* An ICMP error quoting a packet of a translated flow, as that packet left us (translated). The
 * quote reversed is the key of the flow's other direction:
 *   a FORWARD packet (client -> backend) quoted: its REPLY entry; the error goes back to the
 *     client: quote to client -> frontend, outer source the frontend, destination the client;
 *   a REPLY packet (frontend -> client) quoted: its FORWARD entry; the error goes on to the
 *     backend: quote to backend -> client (or the SNAT source), outer destination the backend
 *     (`host` when that is the node's own address: the node's stack delivers it).
 * As nf_nat_icmp_reply_translation does; the entries are not refreshed.
 * Only an error addressed to the quoted packet's source, the address the flow's entry knows that
 * end by (the key's destination), is the flow's: as nf_conntrack_inet_error, which gives any other
 * no conntrack (NF_ACCEPT untracked), this one goes on untranslated, as no flow's. Otherwise anyone
 * could quote a flow's tuple in an error to any address and have it translated and delivered to
 * the client or the backend. */
static __always_inline void ekp_decide_related(const struct ekp_pkt *p, const struct ekp_config *cfg, __u64 now,
					       struct ekp_decision *d)
{
	struct ekp_ct_key k = {};

	if (p->daddr != p->in_saddr)
		return;
	k.saddr = p->in_daddr;
	k.daddr = p->in_saddr;
	k.sport = p->in_dport;
	k.dport = p->in_sport;
	k.proto = p->in_proto;
	k.dir = EKP_CT_REPLY;
	struct ekp_ct_entry *ep = ekp_ct_lookup(&k);
	if (ep && ekp_ct_life(ep, &k, cfg, now) == EKP_CT_LIVE) {
		int snat = ep->flags & EKP_CT_SNAT;
		d->in_saddr = snat ? ep->nat_addr : p->in_saddr;
		d->in_sport = snat ? ep->nat_port : p->in_sport;
		d->in_daddr = ep->fe_addr;
		d->in_dport = ep->fe_port;
		d->saddr = ep->fe_addr;
		d->daddr = snat ? ep->nat_addr : p->daddr;
		ekp_verdict(d, EKP_ACT_RELATED, EKP_STAT_CT_RELATED);
		return;
	}
	k.dir = EKP_CT_FORWARD;
	ep = ekp_ct_lookup(&k);
	if (ep && ekp_ct_life(ep, &k, cfg, now) == EKP_CT_LIVE) {
		int snat = ep->flags & EKP_CT_SNAT;
		d->in_saddr = ep->nat_addr;
		d->in_sport = ep->nat_port;
		d->in_daddr = snat ? ep->snat_addr : p->in_daddr;
		d->in_dport = snat ? ep->snat_port : p->in_dport;
		d->saddr = snat ? ep->snat_addr : p->saddr;
		d->daddr = ep->nat_addr;
		/* To a backend on the node's own address (a host-network endpoint): the node's stack
		 * is its destination, as for the flow's own packets (a fragmentation needed about its
		 * reply is what its path-MTU discovery waits for). */
		d->host = (ep->flags & EKP_CT_HOST) != 0;
		ekp_verdict(d, EKP_ACT_RELATED, EKP_STAT_CT_RELATED);
	}
}

/* The frontends' scope of a packet: kube-proxy's local-traffic detector. By source (ClusterCIDR,
 * NodeCIDR): INTERNAL when the source is in the detector's CIDR, EXTERNAL otherwise, whichever hook
 * it entered by; otherwise the hook's (the agent attaches ekp_from_pod where traffic is local). */
static __always_inline __u8 ekp_local_scope(const struct ekp_config *cfg, __be32 saddr, __u8 hook_scope)
{
	if (!(cfg->flags & EKP_CFG_LOCAL_BY_SRC))
		return hook_scope;
	__u32 plen = cfg->local_plen;
	__be32 mask = plen == 0 ? 0 : htonl(0xffffffffU << (32 - (plen > 32 ? 32 : plen)));
	return (saddr & mask) == cfg->local_net ? EKP_SCOPE_INTERNAL : EKP_SCOPE_EXTERNAL;
}

/* Whether a whole datagram (no fragment, no ICMP error: those take the full path) may belong to a
 * translated flow, by the cheapest checks there are: when no live flow stamped either of its
 * endpoints in ekp_act (two array loads) and its destination is no frontend of this scope
 * (ekp_addr, one hash lookup), it cannot, and leaves without a conntrack lookup. */
static __always_inline int ekp_decide_may_translate(const struct ekp_pkt *p, __u8 scope, const struct ekp_config *cfg)
{
	if (!ekp_act_armed())
		return 1;
	__u32 t = ekp_act_stamp_of(bpf_ktime_get_coarse_ns()); /* lags the stamps' clock: errs "maybe" */
	__u32 span = ekp_ct_longest_stamps(cfg, p->proto);
	if (!ekp_act_idle(p->daddr, p->dport, p->proto, t, span) || !ekp_act_idle(p->saddr, p->sport, p->proto, t, span))
		return 1;
	struct ekp_addr_key k = {};
	k.addr = p->daddr;
	struct ekp_addr *a = ekp_addr_lookup(&k);
	return a && (a->flags & (1 << scope));
}

/* Decides w->dec for the packet parsed into w->pkt (`parsed`: enum ekp_parse_result); a flow it
 * starts or closes is left in w->queue. */
static __always_inline void ekp_decide_packet(struct ekp_work *w, int parsed, __u8 scope, __u8 hook)
{
	struct ekp_pkt *p = &w->pkt;
	struct ekp_decision *d = &w->dec;
	struct ekp_flow *f = &w->flow;
	struct ekp_ctq_req *q = &w->queue;

	d->saddr = p->saddr;
	d->daddr = p->daddr;
	d->sport = p->sport;
	d->dport = p->dport;
	ekp_verdict(d, EKP_ACT_PASS, EKP_STAT_PASS);
	if (parsed == EKP_PARSE_PASS)
		return;
	if (parsed == EKP_PARSE_MALFORMED) {
		ekp_verdict(d, EKP_ACT_DROP, EKP_DROP_MALFORMED);
		return;
	}
	if (p->ttl <= 1)
		return;
	/* XDP leaves fragments and ICMP errors to tc: holding a fragment needs an skb, and a first
	 * fragment's record must be written where its later fragments are decided. And SCTP: its
	 * CRC32c is updated by tc's rewrite (ekp_nat.h), not by XDP's. */
	if (hook == EKP_HOOK_XDP && (parsed != EKP_PARSE_OK || p->frag != EKP_FRAG_NONE || p->proto == IPPROTO_SCTP))
		return;
	const struct ekp_config *cfg = ekp_config_get();
	if (!cfg)
		return;
	scope = ekp_local_scope(cfg, p->saddr, scope); /* the frontends this packet may use */
	if (parsed == EKP_PARSE_OK && p->frag == EKP_FRAG_NONE && !ekp_decide_may_translate(p, scope, cfg))
		return;
	__u64 now = bpf_ktime_get_ns();

	if (parsed == EKP_PARSE_ICMP_ERR) {
		ekp_decide_related(p, cfg, now, d);
		return;
	}
	if (parsed == EKP_PARSE_LATER) {
		if (!ekp_frag_ports(p)) {
			/* Before its first fragment: held when a translated flow may use these addresses
			 * (it goes back into the path when the first comes), else left to the stack,
			 * which reassembles it whatever the order. */
			if (ekp_frag_may_translate(p, scope, cfg->node_addr))
				ekp_verdict(d, EKP_ACT_HOLD, EKP_STAT_FRAG_HELD);
			return;
		}
		d->sport = p->sport;
		d->dport = p->dport;
	} else if (p->frag == EKP_FRAG_FIRST) {
		ekp_frag_record(p);
		d->release = ekp_frag_held(p, now);
	}

	struct ekp_ct_key key = {};
	ekp_ct_key_of(&key, p, EKP_CT_FORWARD);
	struct ekp_ct_entry *ct = ekp_ct_lookup(&key);
	if (ct && ekp_ct_alive(ct, &key, cfg, now) && ekp_ct_usable_forward(ct, p)) {
		__u16 held = ekp_ct_nf_held(ct, now);
		if (held & EKP_CT_NFPASS)
			return; /* PASS: nf_conntrack's NAT entry translates it */
		if (held)
			ekp_verdict(d, EKP_ACT_DROP, EKP_DROP_HANDOVER);
		else
			ekp_decide_hit(ct, &key, p, now, d, q);
		return;
	}
	key.dir = EKP_CT_REPLY;
	ct = ekp_ct_lookup(&key);
	if (ct && ekp_ct_alive(ct, &key, cfg, now) && ekp_ct_usable_reply(ct, p)) {
		if (!(ekp_ct_nf_held(ct, now) & EKP_CT_NFPASS))
			ekp_decide_hit(ct, &key, p, now, d, q);
		return;
	}

	struct ekp_frontend *fe = ekp_frontend_lookup(p, scope);
	if (fe) {
		if (!ekp_decide_new(p, fe, cfg, now, f, d, hook))
			return;
	} else {
		if (hook == EKP_HOOK_XDP) /* no flow of ours: tc looks for a direct flow's reclaim */
			return;
		__u16 held_by = 0;
		if (!ekp_opens_flow(p) || ekp_ct_reclaim(p, cfg, now, &held_by) != EKP_RECLAIM_LIVE)
			return;
		ekp_flow_direct(f, p, held_by);
	}
	ekp_decide_create(p, f, cfg, now, d, q);
}

/* A packet the node's own stack sends (tc egress, ekp_egress): the replies of flows handed to it
 * (EKP_CT_HOST: a backend on the node's own address; a direct connection to it moved to another
 * port around one) get their frontend back as their source, as a REPLY hit at ingress would give
 * them; an ICMP error the stack sends about such a flow is translated back as one from a router
 * would be; the fragments of a reply the stack fragmented follow their first. Anything else is the
 * node's own business: PASS, after the activity check (ekp_act.h) for all but ICMP errors. */
static __always_inline void ekp_hostnat_key_of(struct ekp_hostnat_key *k, __be32 saddr, __be32 daddr, __be16 sport,
					       __be16 dport, __u8 proto, __u16 tag)
{
	k->saddr = saddr;
	k->daddr = daddr;
	k->sport = sport;
	k->dport = dport;
	k->proto = proto;
	k->tag = tag;
}

/* ekp_host_af.h's IPv4 instance (both families' code), defined once ekp_host.h is included. */
static __always_inline struct ekp_hostnat *ekp_host_stack_reply(const struct ekp_pkt *p, int related);

/* Legacy host routing: a packet the node's stack sends about a flow whose both addresses the
 * ingress program translated (ekp_host_note_stack_reply), which no conntrack entry claims: a TCP
 * RST or UDP datagram with the tuple the stack saw (backend -> client), or an ICMP error quoting
 * the packet as the stack saw it (client -> backend). Gets the source the flow's replies get, so
 * the client's socket takes it as the answer to what it sent (nf_conntrack's RELATED in iptables
 * mode: the REJECT of a NetworkPolicy engine fails the connect() at once, not after a timeout). */
static __always_inline void ekp_decide_stack_reply(const struct ekp_pkt *p, int parsed, struct ekp_decision *d)
{
	int related = parsed == EKP_PARSE_ICMP_ERR;
	struct ekp_hostnat *v = ekp_host_stack_reply(p, related); /* ekp_host_af.h, both families' */
	if (!v)
		return;
	d->saddr = v->saddr;
	if (!related) {
		d->sport = v->sport;
		ekp_verdict(d, EKP_ACT_TRANSLATE, EKP_STAT_CT_REPLY);
		return;
	}
	d->daddr = p->daddr;
	d->in_saddr = p->in_saddr;
	d->in_sport = p->in_sport;
	d->in_daddr = v->saddr;
	d->in_dport = v->sport;
	ekp_verdict(d, EKP_ACT_RELATED, EKP_STAT_CT_RELATED);
}

static __always_inline void ekp_decide_local_packet(struct ekp_work *w, int parsed)
{
	struct ekp_pkt *p = &w->pkt;
	struct ekp_decision *d = &w->dec;

	d->saddr = p->saddr;
	d->daddr = p->daddr;
	d->sport = p->sport;
	d->dport = p->dport;
	ekp_verdict(d, EKP_ACT_PASS, EKP_STAT_PASS);
	if (parsed != EKP_PARSE_OK && parsed != EKP_PARSE_ICMP_ERR && parsed != EKP_PARSE_LATER)
		return;
	/* A datagram the stack fragments leaves first fragment first (ip_do_fragment): the first
	 * records its ports for the later ones, which find them under the same addresses and id. */
	if (parsed == EKP_PARSE_LATER) {
		if (!ekp_frag_ports(p))
			return;
	} else if (p->frag == EKP_FRAG_FIRST) {
		ekp_frag_record(p);
	}
	const struct ekp_config *cfg = ekp_config_get();
	if (!cfg)
		return;
	/* A reply's source is a flow's endpoint (the backend, or a host backend's port). Under legacy
	 * host routing so is the destination of the stack's own RST toward a backend about a SNAT
	 * flow's reply (client -> backend, the tuple the stack saw: ekp_decide_stack_reply), whose
	 * source, the client, is no endpoint: checked too, or such a RST skipped the lookups. */
	if (parsed != EKP_PARSE_ICMP_ERR && ekp_act_armed()) {
		__u32 t = ekp_act_stamp_of(bpf_ktime_get_coarse_ns());
		__u32 span = ekp_ct_longest_stamps(cfg, p->proto);
		if (ekp_act_idle(p->saddr, p->sport, p->proto, t, span) &&
		    (!(cfg->flags & EKP_CFG_HOST_LEGACY) || ekp_act_idle(p->daddr, p->dport, p->proto, t, span)))
			return;
	}
	__u64 now = bpf_ktime_get_ns();
	if (parsed == EKP_PARSE_ICMP_ERR) {
		ekp_decide_related(p, cfg, now, d);
	} else {
		struct ekp_ct_key key = {};
		ekp_ct_key_of(&key, p, EKP_CT_REPLY);
		struct ekp_ct_entry *ct = ekp_ct_lookup(&key);
		if (ct && ekp_ct_alive(ct, &key, cfg, now) && ekp_ct_usable_reply(ct, p) &&
		    !(ekp_ct_nf_held(ct, now) & EKP_CT_NFPASS))
			ekp_decide_hit(ct, &key, p, now, d, &w->queue);
	}
	if (d->action == EKP_ACT_PASS && (cfg->flags & EKP_CFG_HOST_LEGACY))
		ekp_decide_stack_reply(p, parsed, d);
}

/* Queues the flow a decision started or closed (ekp_ctq.h: written once, here, rather than on each
 * path). */
static __always_inline void ekp_decide_queue(struct ekp_work *w)
{
	if (w->queue.want) {
		__u32 evicted = ekp_ctq_push(&w->queue);
		if (evicted)
			w->dec.marks |= 1ULL << evicted;
	}
}

static __always_inline void ekp_decide_reset(struct ekp_work *w)
{
	__builtin_memset(&w->dec, 0, sizeof(w->dec));
	__builtin_memset(&w->flow, 0, sizeof(w->flow));
	w->queue.want = 0;
}

/* Decides w->dec for the packet parsed into w->pkt (`parsed`: enum ekp_parse_result) as `hook`
 * runs it (enum ekp_hook), then queues the flow it started or closed. */
static __always_inline void ekp_decide(struct ekp_work *w, int parsed, __u8 scope, __u8 hook)
{
	ekp_decide_reset(w);
	ekp_decide_packet(w, parsed, scope, hook);
	ekp_decide_queue(w);
}

/* Decides w->dec for a packet the node's own stack sends (ekp_decide_local_packet). */
static __always_inline void ekp_decide_local(struct ekp_work *w, int parsed)
{
	ekp_decide_reset(w);
	ekp_decide_local_packet(w, parsed);
	ekp_decide_queue(w);
}

#endif /* EKP_DECIDE_H */
