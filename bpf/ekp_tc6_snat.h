/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc6_snat.h: source translation (masquerade) on the tc programs' IPv6 path (ekp_tc6.h), as
 * IPv4 does it (ekp_decide.h ekp_decide_new, ekp_ct.h ekp_ct_create):
 *
 *   which flows   the frontend asks it (EKP_FE_SNAT_ALL, kube-proxy's KUBE-MARK-MASQ; EKP_FE_SNAT_REMOTE
 *                 and the backend on another node: a NodePort, external IP or LB IP of policy Cluster
 *                 reached from outside), or a hairpin (the client is its own backend: its stack
 *                 would drop a packet from its own address);
 *   the source    the node's IPv6 address (ekp_cfg6, written by the agent from the IPv6 family's
 *                 node address) and a port of the SNAT range (ekp_config's, shared by both
 *                 families), chosen by IPv4's walk (ekp_snat.h, ekp_snat_walk_af with v6 = 1): one
 *                 implementation, its family a constant parameter, so each program verifies its
 *                 own family's copy and the IPv4 one is the code it was;
 *   conntrack     FORWARD {client, frontend, cport, fport} -> backend, and the SNAT source;
 *                 REPLY   {backend, node, bport, snat port} -> frontend, and the client;
 *   the reply     from a remote backend it comes back by ekp_from_net6, from a local one by
 *                 ekp_from_pod6: its REPLY entry gives it the frontend as source and the client as
 *                 destination (ekp_tc6.h, the hit path; ekp_ct6_twin_key finds the other entry).
 *
 * With no IPv6 node address known (ekp_cfg6 zero: an agent without an IPv6 half, or before its
 * first IPv6 sync) these flows are left to the stack as before this path translated them, where
 * ip6tables masquerades them; so is any flow of a frontend with affinity and SNAT_REMOTE then (one
 * owner of the service's affinity).
 *
 * Included by ekp_tc6.h after the helpers it uses (ekp_addr6_eq, ekp_fold6, struct ekp_tc6_scratch).
 */
#ifndef EKP_TC6_SNAT_H
#define EKP_TC6_SNAT_H

#include "ekp_ct.h"
#include "ekp_maps.h"

/* The node's IPv6 address, the source of IPv6 SNAT; NULL when none is known. */
static __always_inline const __be32 *ekp_tc6_node_addr(void)
{
	__u32 zero = 0;
	struct ekp_config6 *c = ekp_cfg6_lookup(&zero);

	if (!c || !(c->node_addr[0] | c->node_addr[1] | c->node_addr[2] | c->node_addr[3]))
		return NULL;
	return c->node_addr;
}

/* Whether a new flow to the backend just chosen is source-translated (ekp_decide_new's rule). */
static __always_inline int ekp_tc6_wants_snat(__u16 fe_flags, __u8 be_flags, const __be32 *be6, const __be32 *client)
{
	return (fe_flags & EKP_FE_SNAT_ALL) || ((fe_flags & EKP_FE_SNAT_REMOTE) && !(be_flags & EKP_BE_LOCAL)) ||
	       ekp_addr6_eq(be6, client);
}

/* The key of the other entry of the flow that stores `e` under `k` (IPv4's ekp_ct_twin_key). */
static __always_inline void ekp_ct6_twin_key(struct ekp_ct6_key *t, const struct ekp_ct6_key *k,
					     const struct ekp_ct6_entry *e)
{
	int snat = e->flags & EKP_CT_SNAT;

	t->proto = k->proto;
	t->pad = 0;
	if (k->dir == EKP_CT_FORWARD) {
		t->dir = EKP_CT_REPLY;
		__builtin_memcpy(t->saddr, e->nat_addr, 16);
		__builtin_memcpy(t->daddr, snat ? e->snat_addr : k->saddr, 16);
		t->sport = e->nat_port;
		t->dport = snat ? e->snat_port : k->sport;
	} else {
		t->dir = EKP_CT_FORWARD;
		__builtin_memcpy(t->saddr, snat ? e->nat_addr : k->daddr, 16);
		__builtin_memcpy(t->daddr, e->fe_addr, 16);
		t->sport = snat ? e->nat_port : k->dport;
		t->dport = e->fe_port;
	}
}

static __always_inline int ekp_ct6_key_eq(const struct ekp_ct6_key *a, const struct ekp_ct6_key *b)
{
	return ekp_addr6_eq(a->saddr, b->saddr) && ekp_addr6_eq(a->daddr, b->daddr) && a->sport == b->sport &&
	       a->dport == b->dport && a->proto == b->proto && a->dir == b->dir;
}

/* Deletes the FORWARD twin of the REPLY entry `e` under `rk` when it still is its twin (not a later
 * flow that took the key): a holder of a SNAT tuple taken over loses both entries. */
static __always_inline void ekp_ct6_delete_twin(const struct ekp_ct6_entry *e, const struct ekp_ct6_key *rk)
{
	struct ekp_ct6_key tk = {}, back = {};

	ekp_ct6_twin_key(&tk, rk, e);
	struct ekp_ct6_entry *t = ekp_ct6_lookup(&tk);
	if (!t || t->backend_id != e->backend_id || (t->flags & EKP_CT_SNAT) != (e->flags & EKP_CT_SNAT))
		return;
	ekp_ct6_twin_key(&back, &tk, t);
	if (ekp_ct6_key_eq(&back, rk))
		ekp_ct6_delete(&tk);
}

/* Chooses the SNAT source port of the new flow in `w` (backend w->be6:f->be_port, already in
 * w->rkey's source) for `node` (ekp_tc6_node_addr): w->rkey becomes the flow's REPLY key and
 * f->snat_port its port. The walk starts where a hash of the flow's tuple says, its addresses
 * folded (ekp_fold6), and runs in the TCP table: this path translates TCP alone (ekp_tc6.h).
 * 0 or EKP_DROP_SNAT_PORTS. Only looks up: the caller claims the port (ekp_ct6_place). */
static __always_inline int ekp_tc6_snat_port(struct ekp_tc6_scratch *w, const __be32 *node,
					     const struct ekp_config *cfg, __u64 now)
{
	const struct ekp_pkt6 *p = &w->pkt;
	struct ekp_ct6_key *rk = &w->rkey;
	__u32 hash = ekp_tuple_hash(ekp_fold6(p->saddr), ekp_fold6(p->daddr), p->b.sport, p->b.dport, p->b.proto);

	__builtin_memcpy(rk->daddr, node, 16);
	int reason = ekp_snat_walk_af(1, rk, &p->b, hash, cfg, now, &w->flow, 1);
	if (reason)
		return reason;
	w->flow.snat_port = rk->dport;
	return 0;
}

/* Claims the SNAT tuple `rk` with the REPLY entry `rev` (IPv4's ekp_ct_place): a free tuple with
 * BPF_NOEXIST (another CPU may have taken it since the walk looked: the packet drops, the client's
 * retransmission walks again), a held one (dead, closed and this a SYN, or unanswered: the walk's
 * early drop) replaced, its holder's FORWARD entry deleted. 0 or a drop reason. */
static __always_inline int ekp_ct6_place(struct ekp_ct6_key *rk, struct ekp_ct6_entry *rev)
{
	struct ekp_ct6_entry *old = ekp_ct6_lookup(rk);

	if (!old)
		return ekp_ct6_insert(rk, rev) < 0 ? EKP_DROP_SNAT_PORTS : 0;
	ekp_ct6_delete_twin(old, rk);
	return ekp_ct6_update(rk, rev) < 0 ? EKP_DROP_CT_FULL : 0;
}

#endif /* EKP_TC6_SNAT_H */
