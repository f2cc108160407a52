/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_ct.h: connection tracking of translated flows (ekp_ct_v1, an LRU hash).
 *
 * A flow owns two entries, each keyed by a tuple exactly as it appears on the wire when the
 * packet reaches an ekp program:
 *   FORWARD  {client, frontend, cport, fport}        -> backend (and node:snat_port if SNAT)
 *   REPLY    {backend, client|node, bport, cport|snat_port} -> rev_nat_id (and client if SNAT)
 * Lookups do not depend on the program's scope: replies from a local backend arrive through
 * ekp_from_pod, replies from a remote one through ekp_from_net.
 *
 * Expiry is computed on lookup (last_seen_ns + timeout from ekp_config); an expired entry is a
 * miss and is overwritten by the next flow on that tuple; the LRU evicts the rest (one LRU list
 * per CPU, BPF_F_NO_COMMON_LRU: see ekp_maps.h). last_seen_ns is refreshed at most once a second
 * to limit writes. The one deletion: a direct (untranslated) TCP SYN on the backend-side tuple of
 * an ended flow removes that flow's pair (ekp_ct_reclaim).
 */
#ifndef EKP_CT_H
#define EKP_CT_H

#include "ekp_maps.h"
#include "ekp_parse.h"

#define EKP_NSEC 1000000000ULL
#define EKP_CT_REFRESH_NS EKP_NSEC
/* Used when ekp_config holds 0 (the agent has not written it yet): Cilium's defaults. */
#define EKP_DEFAULT_TCP_TIMEOUT_S 21600
#define EKP_DEFAULT_UDP_TIMEOUT_S 60
#define EKP_DEFAULT_CLOSING_TIMEOUT_S 10
/* How many SNAT ports a new flow tries before giving up (EKP_DROP_SNAT_PORTS). */
#define EKP_SNAT_PROBES 16

/* The decision taken for a new flow, from backend choice to conntrack entries. */
struct ekp_flow {
	__u32 backend_id;
	__be32 be_addr;
	__be16 be_port;
	__u8 be_flags;
	__u8 ct_flags;  /* EKP_CT_* */
	__be32 snat_addr;
	__be16 snat_port; /* chosen by ekp_ct_create when EKP_CT_SNAT */
	__u16 rev_nat_id;
};

static __always_inline __u64 ekp_ct_timeout_ns(const struct ekp_config *cfg, __u8 proto, __u8 flags)
{
	__u32 s;

	if (flags & EKP_CT_CLOSING)
		s = cfg->closing_timeout_s ? cfg->closing_timeout_s : EKP_DEFAULT_CLOSING_TIMEOUT_S;
	else if (proto == IPPROTO_TCP)
		s = cfg->tcp_timeout_s ? cfg->tcp_timeout_s : EKP_DEFAULT_TCP_TIMEOUT_S;
	else
		s = cfg->udp_timeout_s ? cfg->udp_timeout_s : EKP_DEFAULT_UDP_TIMEOUT_S;
	return (__u64)s * EKP_NSEC;
}

static __always_inline int ekp_ct_expired(const struct ekp_ct_entry *e, const struct ekp_config *cfg,
					  __u8 proto, __u64 now)
{
	__u64 last = e->last_seen_ns;

	/* another CPU may have refreshed it after we read the clock: not expired then */
	return now > last && now - last > ekp_ct_timeout_ns(cfg, proto, e->flags);
}

/* A hit that may be used: alive; for TCP, no SYN on a closing flow: a SYN (without ACK) on a
 * closing FORWARD entry is the client reusing its port after TIME_WAIT (a new flow, a new backend
 * choice, as nf_conntrack does), and a SYN-ACK on a closing REPLY entry answers some other flow on
 * that tuple (a direct connection from the client's old port, see ekp_ct_reclaim): it passes
 * untranslated and does not refresh the entry. For UDP, a FORWARD entry needs its backend still in
 * ekp_be_v1 at the same address: kube-proxy deletes the conntrack entries of a removed UDP
 * endpoint so a resolver keeping its source port moves on; TCP flows keep their backend (a
 * terminating pod finishes its connections), as with kube-proxy. */
static __always_inline int ekp_ct_usable(const struct ekp_ct_entry *e, const struct ekp_pkt *p,
					 const struct ekp_config *cfg, __u64 now)
{
	if (ekp_ct_expired(e, cfg, p->proto, now))
		return 0;
	if (p->proto == IPPROTO_TCP) {
		if (!(e->flags & EKP_CT_CLOSING))
			return 1;
		if (e->dir == EKP_CT_REPLY)
			return !(p->tcp_flags & EKP_TCP_SYN);
		return (p->tcp_flags & (EKP_TCP_SYN | EKP_TCP_ACK)) != EKP_TCP_SYN;
	}
	if (e->dir != EKP_CT_FORWARD)
		return 1;

	struct ekp_backend_key bk = {};
	bk.id = e->backend_id;
	struct ekp_backend *be = ekp_be_lookup(&bk);
	return be && be->addr == e->nat_addr && be->port == e->nat_port;
}

/* In-place refresh of a hit: coarse last_seen, and the closing mark on FIN/RST. */
static __always_inline void ekp_ct_touch(struct ekp_ct_entry *e, const struct ekp_pkt *p, __u64 now)
{
	if ((p->tcp_flags & (EKP_TCP_FIN | EKP_TCP_RST)) && !(e->flags & EKP_CT_CLOSING)) {
		e->flags |= EKP_CT_CLOSING;
		e->last_seen_ns = now;
		return;
	}
	if (now > e->last_seen_ns + EKP_CT_REFRESH_NS)
		e->last_seen_ns = now;
}

static __always_inline void ekp_ct_key_of(struct ekp_ct_key *k, const struct ekp_pkt *p)
{
	k->saddr = p->saddr;
	k->daddr = p->daddr;
	k->sport = p->sport;
	k->dport = p->dport;
	k->proto = p->proto;
}

static __always_inline __u32 ekp_flow_hash(const struct ekp_pkt *p)
{
	__u32 h = p->saddr * 0x9e3779b1u;

	h ^= p->daddr + 0x7f4a7c15u + (h << 6) + (h >> 2);
	h ^= ((__u32)p->sport << 16 | p->dport) + 0x7f4a7c15u + (h << 6) + (h >> 2);
	h ^= p->proto;
	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return h;
}

/* Claims a SNAT port by inserting the REPLY entry {backend, node, bport, port} with BPF_NOEXIST:
 * the insert is the lock. An expired holder is overwritten. Returns 0 or a drop reason. */
static __always_inline int ekp_snat_claim(struct ekp_ct_key *rkey, struct ekp_ct_entry *rent,
					  const struct ekp_pkt *p, const struct ekp_config *cfg, __u64 now)
{
	__u32 min = cfg->snat_port_min, max = cfg->snat_port_max;

	if (!cfg->node_addr || !min || max < min)
		return EKP_DROP_SNAT_PORTS;
	__u32 range = max - min + 1;
	__u32 h = ekp_flow_hash(p);

	for (int i = 0; i < EKP_SNAT_PROBES; i++) {
		rkey->dport = htons((__u16)(min + (h + i) % range));
		if (ekp_ct_insert(rkey, rent) == 0)
			return 0;
		struct ekp_ct_entry *old = ekp_ct_lookup(rkey);
		if (old && ekp_ct_expired(old, cfg, p->proto, now) && ekp_ct_update(rkey, rent) == 0)
			return 0;
	}
	return EKP_DROP_SNAT_PORTS;
}

/* Writes a new flow's entry under `k`. When the entry there already translates exactly the same
 * way (the tuple of an ended flow reused for the same backend, the common case of a busy client:
 * its ports come round again while the last flow on them is still closing), only last_seen and
 * flags are rewritten in place, which a concurrent reader may see in either order. Any other
 * entry is replaced by a map update: an LRU map update takes a new node and frees the old one,
 * ~2 us more per connect() in the bench when both entries of every flow were replaced. */
static __always_inline int ekp_ct_write(struct ekp_ct_key *k, struct ekp_ct_entry *v)
{
	struct ekp_ct_entry *old = ekp_ct_lookup(k);

	if (old && old->dir == v->dir && old->nat_addr == v->nat_addr && old->nat_port == v->nat_port &&
	    old->snat_addr == v->snat_addr && old->snat_port == v->snat_port &&
	    old->backend_id == v->backend_id && old->rev_nat_id == v->rev_nat_id &&
	    (old->flags & EKP_CT_SNAT) == (v->flags & EKP_CT_SNAT)) {
		old->last_seen_ns = v->last_seen_ns;
		old->flags = v->flags;
		return 0;
	}
	return ekp_ct_update(k, v);
}

/* Inserts the REPLY then the FORWARD entry of a new flow (a reply can never beat its entry).
 * With EKP_CT_SNAT, chooses f->snat_port. Returns 0 or a drop reason. */
static __always_inline int ekp_ct_create(const struct ekp_pkt *p, struct ekp_flow *f,
					 const struct ekp_config *cfg, __u64 now)
{
	struct ekp_ct_key rkey = {};
	struct ekp_ct_entry rent = {};
	int reason;

	rkey.saddr = f->be_addr;
	rkey.sport = f->be_port;
	rkey.proto = p->proto;
	rent.last_seen_ns = now;
	rent.backend_id = f->backend_id;
	rent.rev_nat_id = f->rev_nat_id;
	rent.dir = EKP_CT_REPLY;
	rent.flags = f->ct_flags;

	if (f->ct_flags & EKP_CT_SNAT) {
		rkey.daddr = cfg->node_addr;
		rent.nat_addr = p->saddr;
		rent.nat_port = p->sport;
		reason = ekp_snat_claim(&rkey, &rent, p, cfg, now);
		if (reason)
			return reason;
		f->snat_addr = cfg->node_addr;
		f->snat_port = rkey.dport;
	} else {
		/* Overwrites: a stale entry of an earlier flow on this tuple (port reuse). Known limit:
		 * one client port reaching one backend through two frontends at once shares this key. */
		rkey.daddr = p->saddr;
		rkey.dport = p->sport;
		if (ekp_ct_write(&rkey, &rent))
			return EKP_DROP_CT_FULL;
	}

	struct ekp_ct_key fkey = {};
	struct ekp_ct_entry fent = {};

	ekp_ct_key_of(&fkey, p);
	fent.last_seen_ns = now;
	fent.nat_addr = f->be_addr;
	fent.nat_port = f->be_port;
	fent.snat_addr = f->snat_addr;
	fent.snat_port = f->snat_port;
	fent.backend_id = f->backend_id;
	fent.rev_nat_id = f->rev_nat_id;
	fent.dir = EKP_CT_FORWARD;
	fent.flags = f->ct_flags;
	if (ekp_ct_write(&fkey, &fent)) {
		ekp_ct_delete(&rkey);
		return EKP_DROP_CT_FULL;
	}
	return 0;
}

/* The FORWARD key of the flow that owns the REPLY entry `r` stored under `rkey`: the client is the
 * entry's nat address when the flow was source-translated, else the REPLY key's destination; the
 * frontend is the flow's reverse NAT target. */
static __always_inline void ekp_ct_forward_key(struct ekp_ct_key *fkey, const struct ekp_ct_key *rkey,
					       const struct ekp_ct_entry *r, const struct ekp_revnat *rn)
{
	int snat = r->flags & EKP_CT_SNAT;

	fkey->saddr = snat ? r->nat_addr : rkey->daddr;
	fkey->sport = snat ? r->nat_port : rkey->dport;
	fkey->daddr = rn->addr;
	fkey->dport = rn->port;
	fkey->proto = rkey->proto;
}

/* Whether the FORWARD entry `f` belongs to the same flow as the REPLY entry `r` under `rkey`
 * (the FORWARD key may since have been taken by a later flow to another backend). */
static __always_inline int ekp_ct_twins(const struct ekp_ct_entry *f, const struct ekp_ct_key *rkey,
					const struct ekp_ct_entry *r)
{
	if (f->dir != EKP_CT_FORWARD || f->rev_nat_id != r->rev_nat_id || f->nat_addr != rkey->saddr ||
	    f->nat_port != rkey->sport)
		return 0;
	return !(f->flags & EKP_CT_SNAT) || (f->snat_addr == rkey->daddr && f->snat_port == rkey->dport);
}

/* A TCP SYN that is no service flow (it missed conntrack and the frontends), client:P ->
 * server:port, may reuse the tuple of a translated flow seen from the server's side: the flow
 * client:P -> frontend -> server:port left the REPLY entry {server, client, port, P}. If that
 * flow has ended, its REPLY entry would reverse-translate the new connection's SYN-ACK to come
 * from the frontend, the client would never accept it, and each retransmitted SYN-ACK would
 * refresh the entry. So the old pair is deleted when it is stale: the REPLY entry expired or
 * closing, or its FORWARD twin missing, taken by another flow, expired or closing, or its
 * frontend's reverse NAT entry gone. A live pair (neither direction closed) stays: the server
 * then holds a connection on this very 4-tuple, which the new one cannot share (nf_conntrack
 * would move the newcomer to another source port; we do not rewrite untranslated flows), and the
 * established flow is kept. One lookup per such SYN, a miss unless the tuple was used before. */
static __always_inline void ekp_ct_reclaim(const struct ekp_pkt *p, const struct ekp_config *cfg, __u64 now)
{
	struct ekp_ct_key rkey = {};

	rkey.saddr = p->daddr;
	rkey.daddr = p->saddr;
	rkey.sport = p->dport;
	rkey.dport = p->sport;
	rkey.proto = p->proto;
	struct ekp_ct_entry *rp = ekp_ct_lookup(&rkey);
	if (!rp || rp->dir != EKP_CT_REPLY)
		return;
	struct ekp_ct_entry r = *rp;
	int stale = (r.flags & EKP_CT_CLOSING) || ekp_ct_expired(&r, cfg, p->proto, now);
	int twin = 0;
	struct ekp_ct_key fkey = {};
	struct ekp_revnat_key nk = {};

	nk.id = r.rev_nat_id;
	struct ekp_revnat *rn = ekp_rnat_lookup(&nk);
	if (rn) {
		ekp_ct_forward_key(&fkey, &rkey, &r, rn);
		struct ekp_ct_entry *f = ekp_ct_lookup(&fkey);
		if (f && ekp_ct_twins(f, &rkey, &r)) {
			twin = 1;
			if ((f->flags & EKP_CT_CLOSING) || ekp_ct_expired(f, cfg, p->proto, now))
				stale = 1;
		}
	}
	if (!twin)
		stale = 1;
	if (!stale)
		return;
	ekp_ct_delete(&rkey);
	if (twin)
		ekp_ct_delete(&fkey);
}

#endif /* EKP_CT_H */
