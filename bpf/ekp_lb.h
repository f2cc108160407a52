/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_lb.h: service lookup and backend choice for a packet that starts a new flow.
 *
 *   frontend    ekp_fe_v2 {daddr, dport, proto, scope of the program}
 *   refusal     source ranges, no endpoints (ekp_lb_refusal)
 *   ranges      ekp_srcr_v2 {64, rev_nat_id, saddr} (LPM) when EKP_FE_SOURCE_RANGES
 *   affinity    ekp_aff_v2 {saddr, svc_id} when EKP_FE_AFFINITY and affinity_timeout > 0,
 *               honoured only while ekp_member_v2 {svc_id, backend} holds the backend in the set
 *               this frontend uses (EKP_MEMBER_LOCAL for EKP_FE_LOCAL frontends, else CLUSTER)
 *   Maglev      ekp_maglev_v2 {set_id}[flow hash % table size] -> backend_id when EKP_FE_MAGLEV,
 *               honoured while the backend is a member of the frontend's set
 *   slot        ekp_slot_v2 {set_id, 1 + random % count} -> backend_id
 *   backend     ekp_be_v2 {backend_id}
 *
 * Shared by the packet path (ekp_decide.h) and the socket path (ekp_sock.h), and by both address
 * families (the _af functions: IPv6 reads ekp_fe6_v2, ekp_slot6_v2, ekp_be6_v2, ekp_member6_v2,
 * ekp_aff6_v2, ekp_srcr6_v2): one choice of backend.
 *
 * Backend ids are shared between services, so "the id still exists" says nothing about whether
 * the backend still serves *this* service port: membership does (Cilium's LB_AFFINITY_MATCH_MAP).
 */
#ifndef EKP_LB_H
#define EKP_LB_H

#include "ekp_ct.h"
#include "ekp_maps.h"
#include "ekp_parse.h"

static __always_inline struct ekp_frontend *ekp_frontend_lookup(const struct ekp_pkt *p, __u8 scope)
{
	struct ekp_frontend_key k = {};

	k.addr = p->daddr;
	k.port = p->dport;
	k.proto = p->proto;
	k.scope = scope;
	return ekp_fe_lookup(&k);
}

/* Both families go through the functions below: `v6` is a constant at every call (0 for the packet
 * path, either on the socket path), so each inlined copy looks up its own family's maps and the
 * other branch is compiled out. An address of either family is `const __be32 *`: one word for IPv4,
 * four for IPv6 (ekp_abi.h, "IPv6 pairs"). */

/* loadBalancerSourceRanges: the key's first 32 bits (rev_nat_id + pad) always match exactly. */
static __always_inline int ekp_source_allowed_af(int v6, __u16 rev_nat_id, const __be32 *saddr)
{
	if (v6) {
		struct ekp_srcrange6_key k = {};
		k.prefixlen = 32 + 128;
		k.rev_nat_id = rev_nat_id;
		__builtin_memcpy(k.addr, saddr, 16);
		return ekp_srcr6_lookup(&k) != NULL;
	}
	struct ekp_srcrange_key k = {};

	k.prefixlen = 32 + 32;
	k.rev_nat_id = rev_nat_id;
	k.addr = saddr[0];
	return ekp_srcr_lookup(&k) != NULL;
}

static __always_inline int ekp_source_allowed(__u16 rev_nat_id, __be32 saddr)
{
	return ekp_source_allowed_af(0, rev_nat_id, &saddr);
}

/* Whether `backend_id` is in the set frontend `fe` chooses from. */
static __always_inline int ekp_is_member_af(int v6, const struct ekp_frontend *fe, __u32 backend_id)
{
	struct ekp_member_key k = {};

	k.svc_id = fe->svc_id;
	k.backend_id = backend_id;
	struct ekp_member *m = v6 ? ekp_member6_lookup(&k) : ekp_member_lookup(&k);
	if (!m)
		return 0;
	return m->flags & ((fe->flags & EKP_FE_LOCAL) ? EKP_MEMBER_LOCAL : EKP_MEMBER_CLUSTER);
}

static __always_inline int ekp_is_member(const struct ekp_frontend *fe, __u32 backend_id)
{
	return ekp_is_member_af(0, fe, backend_id);
}

/* Why `client` gets no backend from frontend `fe`, before one is chosen: 0 (it may have one), or
 * SOURCE_RANGE (outside loadBalancerSourceRanges), NO_ENDPOINTS (the service has none: kube-proxy
 * rejects), NO_LOCAL (a Local traffic policy and none on this node: kube-proxy drops). The packet
 * path answers NO_ENDPOINTS with an ICMP port unreachable, the socket path with ECONNREFUSED. */
static __always_inline int ekp_lb_refusal_af(int v6, const struct ekp_frontend *fe, const __be32 *client)
{
	if ((fe->flags & EKP_FE_SOURCE_RANGES) && !ekp_source_allowed_af(v6, fe->rev_nat_id, client))
		return EKP_DROP_SOURCE_RANGE;
	if (fe->count)
		return 0;
	/* Neither flag is never written by the agent: dropped as "no endpoints", unanswered. */
	if (!(fe->flags & EKP_FE_NO_ENDPOINTS) && (fe->flags & EKP_FE_LOCAL))
		return EKP_DROP_NO_LOCAL;
	return EKP_DROP_NO_ENDPOINTS;
}

static __always_inline int ekp_lb_refusal(const struct ekp_frontend *fe, __be32 client)
{
	return ekp_lb_refusal_af(0, fe, &client);
}

/* Remembers `backend_id` as the client's backend (ClientIP affinity) from `now`, under the key of
 * the family: `ak` for IPv4, `ak6` for IPv6 (the client and the frontend's svc_id). */
static __always_inline void ekp_aff_remember_af(int v6, struct ekp_affinity_key *ak, struct ekp_affinity6_key *ak6,
						__u32 backend_id, __u64 now)
{
	struct ekp_affinity a = {};

	a.last_seen_ns = now;
	a.backend_id = backend_id;
	/* LRU: cannot be full; a failure only loses affinity */
	if (v6)
		ekp_aff6_update(ak6, &a);
	else
		ekp_aff_update(ak, &a);
}

/* Whether frontend `fe` keeps each client on one backend (ClientIP affinity). */
static __always_inline int ekp_fe_affinity(const struct ekp_frontend *fe)
{
	return (fe->flags & EKP_FE_AFFINITY) && fe->affinity_timeout;
}

/* Fills f->backend_id, be_port, be_flags and the backend's address: f->be_addr for IPv4, `be6`
 * (four words) for IPv6; sets *aff_hit when the client's remembered backend was used. Maglev hashes
 * the packet `p`'s tuple (IPv4's packet path only; the socket path has no packet: NULL, no Maglev,
 * a socket's source port is not known at connect()); else `rnd` picks the slot: random per packet
 * path flow, per socket on the socket path. `remember` (a constant at each call site): write the
 * choice to the affinity table here; 0 for a caller that may still leave the flow to another
 * hook, which remembers it itself once it carries the flow out (ekp_aff_remember_af: XDP's IPv6
 * path). Returns 0 or a drop reason. */
static __always_inline int ekp_pick_backend_in(int v6, const struct ekp_frontend *fe, const __be32 *client,
					       __u32 rnd, const struct ekp_pkt *p, __u64 now, struct ekp_flow *f,
					       __be32 *be6, __u32 *aff_hit, int remember)
{
	struct ekp_affinity_key ak = {};
	struct ekp_affinity6_key ak6 = {};
	struct ekp_backend_key bk = {};
	struct ekp_backend *be = NULL;
	struct ekp_backend6 *b6 = NULL;
	int affinity = ekp_fe_affinity(fe);
	/* Whether a backend was found, tested on the family's own pointer: with `v6` a constant the
	 * IPv4 copy branches on `be` exactly as before the families were parameters. */
#define EKP_LB_FOUND (v6 ? b6 != NULL : be != NULL)

	if (v6) {
		__builtin_memcpy(ak6.client, client, 16);
		ak6.svc_id = fe->svc_id;
	} else {
		ak.client = client[0];
		ak.svc_id = fe->svc_id;
	}
	if (affinity) {
		struct ekp_affinity *a = v6 ? ekp_aff6_lookup(&ak6) : ekp_aff_lookup(&ak);
		if (a) {
			__u64 last = a->last_seen_ns;
			__u32 remembered = a->backend_id;
			if (ekp_age_ns(now, last) < (__s64)fe->affinity_timeout * (__s64)EKP_NSEC &&
			    ekp_is_member_af(v6, fe, remembered)) {
				bk.id = remembered;
				/* gone: choose again */
				if (v6)
					b6 = ekp_be6_lookup(&bk);
				else
					be = ekp_be_lookup(&bk);
				if (EKP_LB_FOUND)
					*aff_hit = 1;
			}
		}
	}
	if (!v6 && !be && p && (fe->flags & EKP_FE_MAGLEV)) {
		/* The same tuple names the same position on every node, and again after its conntrack
		 * entries are gone. A table not written yet, or naming a backend that is no longer in
		 * this frontend's set (the table is rewritten after the set changed): the slots decide. */
		struct ekp_maglev_key mk = {};
		mk.set_id = fe->set_id;
		struct ekp_maglev *table = ekp_maglev_lookup(&mk);
		if (table) {
			__u64 pos = ekp_flow_hash(p) % EKP_MAGLEV_TABLE_SIZE;
			/* LLVM computes the remainder with a division and a product, which leaves the
			 * verifier no bound: the test after the barrier gives it one. */
			asm volatile("" : "+r"(pos));
			__u32 chosen = pos < EKP_MAGLEV_TABLE_SIZE ? table->backend_id[pos] : 0;
			if (chosen && ekp_is_member(fe, chosen)) {
				bk.id = chosen;
				be = ekp_be_lookup(&bk);
			}
		}
	}
	if (!EKP_LB_FOUND) {
		struct ekp_slot_key sk = {};
		sk.set_id = fe->set_id;
		sk.slot = rnd % fe->count + 1;
		struct ekp_slot *s = v6 ? ekp_slot6_lookup(&sk) : ekp_slot_lookup(&sk);
		if (!s)
			return EKP_DROP_NO_BACKEND;
		bk.id = s->backend_id;
		if (v6)
			b6 = ekp_be6_lookup(&bk);
		else
			be = ekp_be_lookup(&bk);
		if (!EKP_LB_FOUND)
			return EKP_DROP_NO_BACKEND;
	}
#undef EKP_LB_FOUND
	f->backend_id = bk.id;
	if (v6) {
		__builtin_memcpy(be6, b6->addr, 16);
		f->be_port = b6->port;
		f->be_flags = b6->flags;
	} else {
		f->be_addr = be->addr;
		f->be_port = be->port;
		f->be_flags = be->flags;
	}

	if (affinity && remember)
		ekp_aff_remember_af(v6, &ak, &ak6, bk.id, now);
	return 0;
}

static __always_inline int ekp_pick_backend_af(int v6, const struct ekp_frontend *fe, const __be32 *client,
					       __u32 rnd, const struct ekp_pkt *p, __u64 now, struct ekp_flow *f,
					       __be32 *be6, __u32 *aff_hit)
{
	return ekp_pick_backend_in(v6, fe, client, rnd, p, now, f, be6, aff_hit, 1);
}

static __always_inline int ekp_pick_backend(const struct ekp_frontend *fe, __be32 client, __u32 rnd,
					    const struct ekp_pkt *p, __u64 now, struct ekp_flow *f, __u32 *aff_hit)
{
	return ekp_pick_backend_af(0, fe, &client, rnd, p, now, f, NULL, aff_hit);
}

#endif /* EKP_LB_H */
