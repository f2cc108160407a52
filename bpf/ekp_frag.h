/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_frag.h: IPv4 fragments of TCP/UDP datagrams (ekp_frag_v2, an LRU hash), as Cilium's
 * IPV4_FRAG_DATAGRAMS_MAP.
 *
 * Only the first fragment carries the L4 header, so only it says which flow the datagram belongs
 * to. Every first fragment (offset 0, MF set) records its ports under {saddr, daddr, IP id,
 * protocol}, the key the receiver reassembles by; a later fragment takes the ports from there
 * and is then decided like any packet of its flow (a conntrack hit translates its addresses;
 * it never starts a flow). The datagram's L4 checksum lives in the first fragment, which is
 * translated like a whole packet; later fragments change addresses and the IP checksum only.
 *
 * Untranslated datagrams are recorded too, so that a later fragment without a record has a
 * meaning: its first fragment has not been seen here (it comes later, or its record was
 * evicted). That fragment is dropped and counted (EKP_DROP_FRAG_NO_FIRST) rather than passed:
 * it may belong to a translated flow, and passed untranslated it would go to the frontend
 * address (a VIP the node's routes do not know) while its datagram could not be reassembled at
 * the backend anyway; Linux senders emit fragments in order, so it costs nothing in practice.
 */
#ifndef EKP_FRAG_H
#define EKP_FRAG_H

#include "ekp_maps.h"
#include "ekp_parse.h"

static __always_inline void ekp_frag_key_of(struct ekp_frag_key *k, const struct ekp_pkt *p)
{
	k->saddr = p->saddr;
	k->daddr = p->daddr;
	k->id = p->ip_id;
	k->proto = p->proto;
}

/* A first fragment: remember its ports for the rest of its datagram. */
static __always_inline void ekp_frag_record(const struct ekp_pkt *p)
{
	struct ekp_frag_key k = {};
	struct ekp_frag v = {};

	ekp_frag_key_of(&k, p);
	v.sport = p->sport;
	v.dport = p->dport;
	ekp_frag_update(&k, &v); /* LRU: a failure only costs this datagram its later fragments */
}

/* A later fragment: its datagram's ports into p. 0 when its first fragment was not seen. */
static __always_inline int ekp_frag_ports(struct ekp_pkt *p)
{
	struct ekp_frag_key k = {};

	ekp_frag_key_of(&k, p);
	struct ekp_frag *v = ekp_frag_lookup(&k);
	if (!v)
		return 0;
	p->sport = v->sport;
	p->dport = v->dport;
	return 1;
}

#endif /* EKP_FRAG_H */
