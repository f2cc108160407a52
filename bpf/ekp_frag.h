/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_frag.h: IPv4 fragments of TCP/UDP datagrams (ekp_frag_v2, an LRU hash), as Cilium's
 * IPV4_FRAG_DATAGRAMS_MAP, and those that come before their first (ekp_fraghold_v2).
 *
 * Only the first fragment carries the L4 header, so only it says which flow the datagram belongs
 * to. Every first fragment (offset 0, MF set) records its ports under {saddr, daddr, IP id,
 * protocol}, the key the receiver reassembles by; a later fragment takes the ports from there
 * and is then decided like any packet of its flow (a conntrack hit translates its addresses;
 * it never starts a flow). The datagram's L4 checksum lives in the first fragment, which is
 * translated like a whole packet; later fragments change addresses and the IP checksum only.
 *
 * A later fragment without a record came before its first (reordered on the way: an ECMP
 * fabric hashes the first fragment's ports and the others' addresses apart; some senders emit
 * the last first), or the record was evicted. The kernel reassembles in any order, and so must
 * we, without knowing the datagram's flow yet:
 *   - when no translated flow can use its addresses (its destination is no frontend of this
 *     scope nor the node's SNAT address, and its source is no backend: ekp_addr), it is passed
 *     to the stack untouched: pod to pod, to the node itself, through the node;
 *   - otherwise it is held (EKP_ACT_HOLD: a copy in ekp_fraghold_v2, up to EKP_FRAGHOLD_SLOTS per
 *     datagram) and its first fragment, recorded as usual, puts every held one back into the
 *     device it came in by (bpf_clone_redirect to ingress, ekp_tc_frag.h), where it runs through
 *     the program again as an ordinary later fragment with a record: translated with its flow,
 *     or passed. A fragment that cannot be held drops (EKP_DROP_FRAG_NO_FIRST).
 * bpf/README.md ("Fragments in any order") compares this with handing fragments to the kernel's
 * reassembly.
 */
#ifndef EKP_FRAG_H
#define EKP_FRAG_H

#include "ekp_maps.h"
#include "ekp_parse.h"
#include "ekp_time.h"

/* How long after the last hold a first fragment looks for held ones: the kernel's reassembly
 * time (net.ipv4.ipfrag_time, 30 s); a fragment held longer is useless to the receiver anyway. */
#define EKP_FRAGHOLD_WINDOW_NS (30 * EKP_NSEC)

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

/* Whether a translated flow may use the addresses of `p` (a later fragment with no record): to a
 * frontend of this scope, to the SNAT address (a reply to a source-translated flow), or from a
 * backend (a reply). */
static __always_inline int ekp_frag_may_translate(const struct ekp_pkt *p, __u8 scope, const struct ekp_config *cfg)
{
	struct ekp_addr_key k = {};

	if (p->daddr == cfg->node_addr)
		return 1;
	k.addr = p->daddr;
	struct ekp_addr *a = ekp_addr_lookup(&k);
	if (a && (a->flags & (1 << scope)))
		return 1;
	k.addr = p->saddr;
	a = ekp_addr_lookup(&k);
	return a && (a->flags & EKP_ADDR_BACKEND);
}

static __always_inline void ekp_fraghold_key_of(struct ekp_fraghold_key *k, const struct ekp_pkt *p, __u8 slot)
{
	k->saddr = p->saddr;
	k->daddr = p->daddr;
	k->id = p->ip_id;
	k->proto = p->proto;
	k->slot = slot;
}

/* A first fragment: whether later fragments of its datagram are held. Looked up only when some
 * fragment was held in the last EKP_FRAGHOLD_WINDOW_NS (ekp_fraglast: an array, which the JIT
 * reads in place), so in-order fragments pay no hash lookup on a node that sees none out of
 * order. Slots fill from 0, so slot 0 is there whenever any is (when the LRU took it, the
 * datagram is incomplete anyway). */
static __always_inline __u8 ekp_frag_held(const struct ekp_pkt *p, __u64 now)
{
	struct ekp_fraghold_key k = {};
	__u32 zero = 0;
	__u64 *last = ekp_fraglast_lookup(&zero);

	if (!last || ekp_age_ns(now, *last) > (__s64)EKP_FRAGHOLD_WINDOW_NS)
		return 0;
	ekp_fraghold_key_of(&k, p, 0);
	return ekp_fraghold_lookup(&k) ? 1 : 0;
}

#endif /* EKP_FRAG_H */
