/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_decide6_hook.h: ekp_decide6.h's order of checks, instantiated once per hook: EKP6_HOOK
 * (enum ekp_hook) names it, EKP6_DECIDE the function. A constant from the function's first line
 * rather than an argument: each hook's copy loses the other's branches before it is inlined, so
 * the tc programs compile to the instructions of the path written for tc alone (an argument left
 * ekp_from_pod6 at 513,000 verified instructions, 423,000 before). No include guard.
 */
#if !defined(EKP6_HOOK) || !defined(EKP6_DECIDE)
#error "ekp_decide6_hook.h is included with EKP6_HOOK and EKP6_DECIDE defined (ekp_decide6.h)"
#endif

/* Parses and decides the packet and applies the decision as EKP6_HOOK does; the hook's verdict,
 * the packet counted. `ctx`: the skb (tc) or the XDP buffer. One function from the scratch lookup
 * to the count, as ekp_main6 was before the hooks shared it: a body split at the parse compiled
 * ekp_from_pod6 to other registers and spills, and 509,000 verified instructions. */
static __always_inline int EKP6_DECIDE(void *ctx, __u8 scope)
{
	const __u8 hook = EKP6_HOOK;
	struct ekp_tc6_scratch *w = ekp_scratch6_lookup();

	if (hook == EKP_HOOK_TC) {
		struct __sk_buff *skb = ctx;
		skb->tc_classid = 0; /* no tag for egress unless the host routing sets one (ekp_host.h) */
	}
	if (!w)
		return ekp6_pass(hook); /* cannot happen: a one-element per-CPU array */
	w->queue.want = 0;
	w->reopens = 0;
	__builtin_memset(&w->pkt, 0, sizeof(w->pkt));
	struct ekp_pkt6 *p = &w->pkt;
	int parsed = hook == EKP_HOOK_XDP ? ekp_parse6_xdp(ctx, p) : ekp_parse6(ctx, p);
	__u32 outcome = EKP_STAT_PASS;
	int verdict = ekp6_pass(hook);
	const struct ekp_config *cfg = ekp_config_get();

	ekp_count_in(ekp6_counters(hook), EKP_STAT_PACKETS);
	/* An ICMPv6 error: rewriting its quote is the skb path's. XDP leaves one to tc only when it may
	 * be a flow's, addressed to its quote's source (ekp_tc6_related says why). */
	if (hook == EKP_HOOK_XDP && parsed == EKP_PARSE_ICMP_ERR && cfg) {
		if (ekp_addr6_eq(p->daddr, p->in_saddr))
			verdict = ekp6_leave(hook, &outcome);
		goto out;
	}
	/* the last hop: the stack sends the time exceeded (or, for an error, drops it) */
	if (hook == EKP_HOOK_TC && parsed == EKP_PARSE_ICMP_ERR && p->hop_limit > 1 && cfg) {
		verdict = ekp_tc6_related(ctx, w, scope, cfg, &outcome);
		goto out;
	}
	/* TCP, UDP and SCTP, whole or in fragments (SCTP whole: ekp_parse6 passes its fragments) */
	if ((parsed != EKP_PARSE_OK && parsed != EKP_PARSE_LATER) || !cfg)
		goto out;
	if (p->b.frag == EKP_FRAG_NONE && !ekp_tc6_may_translate(p, scope, cfg))
		goto out;
	/* XDP leaves to tc what needs the skb: holding and recording fragments, SCTP's CRC32c, the last
	 * hop's answer, a header past the buffer's linear part; before anything is looked up. */
	if (hook == EKP_HOOK_XDP && (parsed != EKP_PARSE_OK || p->b.frag != EKP_FRAG_NONE ||
				     p->b.proto == IPPROTO_SCTP || p->hop_limit <= 1 || !ekp_xdp6_reachable(ctx, p))) {
		verdict = ekp6_leave(hook, &outcome);
		goto out;
	}

	__u64 now = bpf_ktime_get_ns();
	struct ekp_ct6_key *k = &w->key;
	const __be32 *sa, *da;
	__be16 sp, dp;
	long rc;

	/* Fragments (ekp_frag.h, IPv4's code): a later one takes its datagram's ports from the first
	 * and is then a packet of that flow (a hit translates its addresses; it never starts a flow);
	 * one that came before its first is held when a translated flow may use its addresses, else
	 * the stack reassembles it. A first fragment records its ports and puts the held ones back
	 * into their devices, where they run through here again after this run. */
	if (hook == EKP_HOOK_TC && parsed == EKP_PARSE_LATER) {
		if (!ekp_frag6_ports(p)) {
			__builtin_memset(w->node, 0, sizeof(w->node)); /* none known: no SNAT address */
			ekp_tc6_node_addr(w->node);
			if (ekp_frag6_may_translate(p, scope, w->node)) {
				outcome = EKP_STAT_FRAG_HELD;
				verdict = ekp_tc_frag6_hold(ctx, p, &w->frag, &outcome);
			}
			goto out;
		}
	} else if (hook == EKP_HOOK_TC && p->b.frag == EKP_FRAG_FIRST) {
		ekp_frag6_record(p);
		if (ekp_frag6_held(p, now) && ekp_tc_frag6_release(ctx, p, &w->frag) < 0) {
			outcome = EKP_DROP_MALFORMED; /* the first fragment could not be put back together */
			verdict = TC_ACT_SHOT;
			goto out;
		}
	}

	__builtin_memset(k, 0, sizeof(*k));
	ekp_ct6_key_of(k, p, EKP_CT_FORWARD);
	struct ekp_ct6_entry *e = ekp_ct6_lookup(k);
	if (e && !ekp_ct6_alive(e, k, cfg, now))
		e = NULL; /* dead: the new-flow path below */
	if (e && !ekp_ct6_usable_forward(e, &p->b)) {
		/* a SYN reusing an ended flow's port, a UDP flow's backend gone: decided again, by tc
		 * (the ended flow's entries may go: see the end) */
		if (hook == EKP_HOOK_XDP) {
			verdict = ekp6_leave(hook, &outcome);
			goto out;
		}
		w->reopens = 1;
		e = NULL;
	}
	if (!e) {
		k->dir = EKP_CT_REPLY;
		e = ekp_ct6_lookup(k);
		if (e && !(ekp_ct6_alive(e, k, cfg, now) && ekp_ct6_usable_reply(e, &p->b)))
			e = NULL; /* a SYN-ACK answering something else on an ended flow's tuple */
	}
	if (e) {
		w->reopens = 0;
		/* A flow the agent hands to nf_conntrack out of eBPF mode (agent/takeover/out_of_ebpf.py,
		 * as IPv4's ekp_ct_nf_held): HANDOVER while its NAT entry replaces the plain one the stack
		 * tracked it under (a forward packet translated then would take another source port from
		 * the stack's NAT, and its reply would reach the client from the backend's own address),
		 * NFPASS once that entry is there to translate it, both ways; at XDP too, as IPv4's. Returned
		 * from here rather than through `out` (nothing queued nor reopened yet): a jump there split
		 * the verifier's states, ekp_from_pod6 641,521 instructions instead of 423,823. */
		__u16 held = ekp_ct6_nf_held(e, now);
		if (held & EKP_CT_NFPASS) {
			ekp_count_in(ekp6_counters(hook), EKP_STAT_PASS);
			return ekp6_pass(hook);
		}
		if (held && k->dir == EKP_CT_FORWARD) {
			ekp_count_in(ekp6_counters(hook), EKP_DROP_HANDOVER);
			return ekp6_drop(hook);
		}
		if (hook == EKP_HOOK_XDP) {
			/* Legacy host routing: the node's stack must see it (ekp_xdp_apply.h). Else routed
			 * first (read only): on to tc unless it leaves by the device it came in by. */
			ekp_tc6_hit_tuple(w, e, &sa, &sp, &da, &dp);
			if ((cfg->flags & EKP_CFG_HOST_LEGACY) || !ekp_xdp6_route(ctx, w, sa, sp, da, dp)) {
				verdict = ekp6_leave(hook, &outcome);
				goto out;
			}
		}
		if (hook == EKP_HOOK_TC && scope == EKP_SCOPE_INTERNAL &&
		    !ekp_source_routed_here6(ctx, p, &w->fib)) {
			outcome = EKP_DROP_SPOOFED; /* redirected past the stack's reverse-path filter */
			verdict = TC_ACT_SHOT;
			goto out;
		}
		/* The last hop, and a segment too big for the device its translation leaves by: answered
		 * here, as a router would (the stack has no nf_conntrack entry for the flow). */
		if (hook == EKP_HOOK_TC && p->hop_limit <= 1) {
			verdict = ekp_tc6_answer(ctx, w, cfg, EKP_ICMPV6_TIME_EXCEED, 0, &outcome);
			goto out;
		}
		if (ekp_tc6_hit_in(w, e, now, ekp6_counters(hook), &sa, &sp, &da, &dp) < 0) {
			/* The refresh deleted the entry (ekp_ct_refresh): the flow is gone. Dropped as IPv4
			 * drops a mid-flow segment without an entry: ip6tables would take it for a new flow
			 * mid-stream and send it to a backend that never saw the connection. */
			outcome = EKP_DROP_NO_FLOW;
			verdict = ekp6_drop(hook);
			goto out;
		}
		if (hook == EKP_HOOK_XDP) { /* routed above */
			outcome = k->dir == EKP_CT_FORWARD ? EKP_STAT_CT_FORWARD : EKP_STAT_CT_REPLY;
			verdict = ekp_xdp6_send(ctx, w, sa, sp, da, dp, &outcome);
			goto out;
		}
		/* a backend on the node's own address: no route to look up (the stack delivers it) */
		int host = k->dir == EKP_CT_FORWARD && (e->flags & EKP_CT_HOST);
		rc = host ? BPF_FIB_LKUP_RET_SUCCESS : ekp_fib6(ctx, &w->fib, p, sa, da, sp, dp, ekp_seg_len(ctx, &p->b));
		if (rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
			goto too_big;
		if (rc != BPF_FIB_LKUP_RET_SUCCESS && rc != BPF_FIB_LKUP_RET_NO_NEIGH)
			goto out;
		outcome = k->dir == EKP_CT_FORWARD ? EKP_STAT_CT_FORWARD : EKP_STAT_CT_REPLY;
		if (p->b.frag == EKP_FRAG_LATER)
			ekp_count(EKP_STAT_FRAGMENTS);
		verdict = ekp_tc6_send(ctx, w, rc, sa, sp, da, dp, &outcome, host);
		goto out;
	}

	/* A new flow: only its first packet starts one (a TCP segment without an entry belongs to a
	 * flow ip6tables translated, whose nf_conntrack entry the stack has). A later fragment of a
	 * UDP datagram without an entry is looked at for its frontend's refusal alone: its first was
	 * refused, and it is dropped under the same reason, as IPv4's path drops it. A TCP one may
	 * belong to a flow ip6tables owns (its first fragment, no SYN, went to the stack): it goes
	 * there too, whatever the frontend says now. */
	int later = p->b.frag == EKP_FRAG_LATER && p->b.proto == IPPROTO_UDP;
	if ((!later && !ekp_opens_flow(&p->b)) || p->hop_limit <= 1) /* the last hop: the stack answers it */
		goto out;
	struct ekp_flow6 *f = &w->flow;
	__u32 aff_hit = 0;
	__builtin_memset(f, 0, sizeof(*f));
	struct ekp_frontend6_key fk = {};
	ekp_fe6_key_of(&fk, p, scope);
	struct ekp_frontend *fe = ekp_fe6_lookup(&fk);
	int node = ekp_tc6_node_addr(w->node);
	if (fe) {
		/* Whatever would take ip6tables for some of its backends takes it for all, decided before
		 * the choice: a flow this path chose a backend for and then left to ip6tables would be
		 * chosen for again there, and the backends that path reaches twice would get more than
		 * their share. A source translation is ip6tables' only while the node's IPv6 address is
		 * not known. */
		__u16 flags = fe->flags;
		int refusal = ekp_lb_refusal_af(1, fe, p->saddr);
		if (refusal) {
			if (hook == EKP_HOOK_XDP && refusal == EKP_DROP_NO_ENDPOINTS && (flags & EKP_FE_NO_ENDPOINTS))
				verdict = ekp6_leave(hook, &outcome); /* the reject is built on the skb */
			else if (hook == EKP_HOOK_XDP) {
				outcome = refusal; /* source ranges, no local endpoint: dropped as tc drops them */
				verdict = XDP_DROP;
			} else
				verdict = ekp_tc6_refuse(ctx, w, cfg, fe, refusal, &outcome);
			goto out;
		}
		if (later || (!node && (flags & (EKP_FE_SNAT_ALL | EKP_FE_SNAT_REMOTE)))) {
			verdict = ekp6_leave(hook, &outcome);
			goto out;
		}
		/* XDP: legacy host routing (the stack must see it) and a frontend with a backend on the
		 * node's own address (delivered by its stack) are tc's */
		if (hook == EKP_HOOK_XDP &&
		    ((cfg->flags & EKP_CFG_HOST_LEGACY) || (flags & EKP_FE_HOST_BACKEND))) {
			verdict = ekp6_leave(hook, &outcome);
			goto out;
		}
	} else {
		/* No frontend: a connection of its own, client:P -> server:port, whose reverse tuple a
		 * live flow this path translated may hold (ekp_ct_reclaim): it keeps its addresses and
		 * gets another source port, translated to itself (ekp_flow_direct, IPv4's). A stale
		 * holder is cleared and the packet goes on untouched. XDP leaves it to the stack, whose
		 * tc program looks. */
		__u16 held_by = 0;
		if (hook == EKP_HOOK_XDP || later || ekp_ct6_reclaim(p, cfg, now, &held_by) != EKP_RECLAIM_LIVE)
			goto out;
	}
	/* A source not routed back by this device: not ours to translate past the stack, and not ours
	 * to drop either (IPv6 has no rp_filter: the stack and ip6tables do what they would without
	 * this path). A hit's packet is dropped instead (above): it would be redirected. */
	if (hook == EKP_HOOK_TC && scope == EKP_SCOPE_INTERNAL && !ekp_source_routed_here6(ctx, p, &w->fib))
		goto out;
	if (fe) {
		__u16 flags = fe->flags;
		/* XDP remembers the choice (affinity) only once it will carry the flow out: one left to
		 * tc is chosen there afresh, its first choice counted as such. */
		if (ekp_pick_backend_in(1, fe, p->saddr, bpf_get_prandom_u32(), NULL, now, &f->b, f->be_addr, &aff_hit,
					hook != EKP_HOOK_XDP)) {
			verdict = ekp6_leave(hook, &outcome);
			goto out;
		}
		if (hook == EKP_HOOK_TC && aff_hit) /* counted now, as IPv4's marks: a value held across
						      * the walk splits its states */
			ekp_count(EKP_STAT_AFFINITY_HIT);
		/* Without the node's IPv6 address, a hairpin (the client chose itself) needs ip6tables'
		 * source translation, and ip6tables chooses again, as no map says before the choice which
		 * clients are backends of this frontend: a client that is one of n backends of the
		 * Service then reaches itself with 1/n^2, and the others with more than 1/n. The node's
		 * own address (EKP_BE_HOST): delivered by its stack, the client's address kept
		 * (kube-proxy's DNAT in PREROUTING, where no masquerade runs; IPv4's rule); set in the
		 * flow's memory, not a register, which would split the SNAT walk's states. A local
		 * backend (a pod's veth) is tc's to deliver, as the node's own. */
		int snat = ekp_tc6_wants_snat(flags, f->b.be_flags, f->be_addr, p->saddr);
		f->b.ct_flags = (f->b.be_flags & EKP_BE_HOST) ? EKP_CT_HOST : 0;
		if ((snat && !node) || (hook == EKP_HOOK_XDP && (f->b.be_flags & (EKP_BE_LOCAL | EKP_BE_HOST)))) {
			verdict = ekp6_leave(hook, &outcome);
			goto out;
		}
		if (snat) { /* the port: ekp_ct6_create's walk */
			f->b.ct_flags = EKP_CT_SNAT;
			__builtin_memcpy(f->snat_addr, w->node, 16);
		}
		f->b.svc_id = fe->svc_id;
		__builtin_memcpy(f->fe_addr, p->daddr, 16);
		f->b.fe_port = p->b.dport;
	} else {
		__builtin_memcpy(f->be_addr, p->daddr, 16);
		__builtin_memcpy(f->fe_addr, p->daddr, 16);
		__builtin_memcpy(f->snat_addr, p->saddr, 16);
		f->b.be_port = p->b.dport;
		f->b.fe_port = p->b.dport;
		f->b.ct_flags = EKP_CT_SNAT;
		f->b.remapped = 1;
	}
	/* The route before anything is written (the source port a remap picks matters to no route),
	 * kept in memory across the entries' creation: in a register its two values (SUCCESS,
	 * NO_NEIGH) would have the verifier walk the SNAT port walk once for each (ekp_snat.h). */
	if (hook == EKP_HOOK_XDP) {
		if (!ekp_xdp6_route(ctx, w, (f->b.ct_flags & EKP_CT_SNAT) ? f->snat_addr : p->saddr, p->b.sport,
				    f->be_addr, f->b.be_port)) {
			verdict = ekp6_leave(hook, &outcome);
			goto out;
		}
		if (aff_hit)
			ekp_count_in(EKP_COUNT_XDP, EKP_STAT_AFFINITY_HIT);
	} else {
		w->rc = ekp_tc6_route(ctx, w, (f->b.ct_flags & EKP_CT_SNAT) ? f->snat_addr : p->saddr, p->b.sport,
				      f->be_addr, f->b.be_port);
		if (!(f->b.ct_flags & EKP_CT_HOST)) { /* a host backend's route is local: not looked at */
			/* Too big for its backend's route: answered before any entry is made (the smaller
			 * packet the client sends next opens the flow). A direct connection's (no frontend)
			 * is the stack's: its destination is its own. */
			if (w->rc == BPF_FIB_LKUP_RET_FRAG_NEEDED && !f->b.remapped)
				goto too_big;
			if (w->rc < 0 || w->rc == BPF_FIB_LKUP_RET_FRAG_NEEDED)
				goto out;
		}
	}
	/* The entries (ekp_ct_create, IPv4's): the reply one first; a source-translated flow's port
	 * from the SNAT range; on a reply tuple a live flow of another frontend holds, another source
	 * port (EKP_STAT_PORT_REMAP), as ip6tables' nf_nat would. */
	int reason = ekp_ct6_create(p, f, cfg, now);
	if (f->b.early_drop) /* the holder was deleted, whether the flow was made or not */
		ekp_count_in(ekp6_counters(hook), EKP_STAT_EARLY_DROP);
	if (reason) {
		outcome = reason;
		verdict = ekp6_drop(hook);
		goto out;
	}
	/* The ended flow's entries are this flow's now (rewritten above): kept, though a translated
	 * packet goes to the stack too under legacy host routing or to a host backend (TC_ACT_OK). */
	w->reopens = 0;
	k->dir = EKP_CT_FORWARD;
	ekp_ctq6_want(&w->queue, k, now / EKP_NSEC);
	if (hook == EKP_HOOK_XDP && ekp_fe_affinity(fe)) { /* after the entries: one branch less for the
							     * verifier to walk twice */
		struct ekp_affinity6_key ak6 = {};
		__builtin_memcpy(ak6.client, p->saddr, 16);
		ak6.svc_id = fe->svc_id;
		ekp_aff_remember_af(1, NULL, &ak6, f->b.backend_id, now);
	}
	if (f->b.remapped)
		ekp_count_in(ekp6_counters(hook), EKP_STAT_PORT_REMAP);
	else if (f->b.ct_flags & EKP_CT_SNAT)
		ekp_count_in(ekp6_counters(hook), EKP_STAT_SNAT);
	sa = (f->b.ct_flags & EKP_CT_SNAT) ? f->snat_addr : p->saddr;
	sp = (f->b.ct_flags & EKP_CT_SNAT) ? f->b.snat_port : p->b.sport;
	outcome = EKP_STAT_NEW_FLOWS;
	if (hook == EKP_HOOK_XDP)
		verdict = ekp_xdp6_send(ctx, w, sa, sp, f->be_addr, f->b.be_port, &outcome);
	else
		verdict = ekp_tc6_send(ctx, w, w->rc, sa, sp, f->be_addr, f->b.be_port, &outcome,
				       (f->b.ct_flags & EKP_CT_HOST) != 0);
	goto out;
too_big:
	/* A hit's segment or a new flow's first packet too big for the route its translation leaves
	 * by: Packet Too Big from the frontend (the MTU in w->fib.mtu_result), one answer for both. */
	if (hook == EKP_HOOK_TC)
		verdict = ekp_tc6_answer(ctx, w, cfg, EKP_ICMPV6_PKT_TOOBIG, w->fib.mtu_result, &outcome);
out:
	/* A SYN that reopened an ended flow's tuple and goes to the stack untranslated (ip6tables
	 * decides it: its frontend now needs ip6tables, no route, ...): the ended flow's entries go
	 * with it, or the connection's next segment, no SYN, would hit them and reach the old backend.
	 * A SYN that made a new flow here rewrote them (ekp_ct6_create, reopens cleared): the verdict
	 * cannot tell, as legacy host routing hands translated packets to the stack (TC_ACT_OK) too,
	 * and deleting them left the SYN-ACK untranslated (the client reset it, retried 1 s later).
	 * One dropped keeps them for its retry. XDP never reopens: it leaves such a SYN to tc. */
	if (hook == EKP_HOOK_TC && w->reopens && verdict == TC_ACT_OK) {
		struct ekp_ct6_key *fk6 = &w->key;
		ekp_ct6_key_of(fk6, p, EKP_CT_FORWARD);
		struct ekp_ct6_entry *old = ekp_ct6_lookup(fk6);
		if (old) {
			ekp_ct6_delete_twin(old, fk6);
			ekp_ct6_delete(fk6);
		}
	}
	/* the flow that began or closed goes in its ring (ekp_ctq.h); the one there a ring ago may go */
	if (w->queue.want) {
		__u32 evicted = ekp_ctq6_push(&w->queue);
		if (evicted)
			ekp_count_in(ekp6_counters(hook), evicted);
	}
	ekp_count_in(ekp6_counters(hook), outcome);
	return verdict;
}

