/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_frag_af.h: the fragments' per-family code (ekp_frag.h says what it does), written once and
 * included twice, as ekp_ct_af.h is: by ekp_frag.h with EKP_CT_V6 0 (ekp_frag_*, ekp_fraghold_*,
 * struct ekp_pkt's 16-bit IPv4 id) and by ekp_frag6.h with EKP_CT_V6 1 (ekp_frag6_*,
 * ekp_fraghold6_*, struct ekp_pkt6's 32-bit fragment-header id). The names and address macros are
 * ekp_def_af.h's; the IPv4 instance is, after the preprocessor, the text it was.
 *
 * No include guard: included once per family.
 */
#include "ekp_def_af.h"

static __always_inline void EKP_FRAGF(key_of)(EKP_FRAG_KEY *k, const EKP_PKT *p)
{
	EKP_A_SET(k->saddr, p->saddr);
	EKP_A_SET(k->daddr, p->daddr);
	k->id = EKP_FRAG_ID(p);
	k->proto = EKP_PB(p)->proto;
}

/* A first fragment: remember its ports for the rest of its datagram. */
static __always_inline void EKP_FRAGF(record)(const EKP_PKT *p)
{
	EKP_FRAG_KEY k = {};
	struct ekp_frag v = {};

	EKP_FRAGF(key_of)(&k, p);
	v.sport = EKP_PB(p)->sport;
	v.dport = EKP_PB(p)->dport;
	EKP_FRAGF(update)(&k, &v); /* LRU: a failure only costs this datagram its later fragments */
}

/* A later fragment: its datagram's ports into p. 0 when its first fragment was not seen. */
static __always_inline int EKP_FRAGF(ports)(EKP_PKT *p)
{
	EKP_FRAG_KEY k = {};

	EKP_FRAGF(key_of)(&k, p);
	struct ekp_frag *v = EKP_FRAGF(lookup)(&k);
	if (!v)
		return 0;
	EKP_PB(p)->sport = v->sport;
	EKP_PB(p)->dport = v->dport;
	return 1;
}

/* Whether a translated flow may use the addresses of `p` (a later fragment with no record): to a
 * frontend of this scope, to the SNAT address `node` (a reply to a source-translated flow), or
 * from a backend (a reply). */
static __always_inline int EKP_FRAGF(may_translate)(const EKP_PKT *p, __u8 scope, EKP_A_ARG node)
{
	EKP_ADDR_KEY k = {};

	if (EKP_A_EQ(p->daddr, node))
		return 1;
	EKP_A_SET(k.addr, p->daddr);
	struct ekp_addr *a = EKP_ADDR_LOOKUP(&k);
	if (a && (a->flags & (1 << scope)))
		return 1;
	EKP_A_SET(k.addr, p->saddr);
	a = EKP_ADDR_LOOKUP(&k);
	return a && (a->flags & EKP_ADDR_BACKEND);
}

static __always_inline void EKP_FRAGHOLDF(key_of)(EKP_FRAGHOLD_KEY *k, const EKP_PKT *p, __u8 slot)
{
	EKP_A_SET(k->saddr, p->saddr);
	EKP_A_SET(k->daddr, p->daddr);
	k->id = EKP_FRAG_ID(p);
	k->proto = EKP_PB(p)->proto;
	k->slot = slot;
}

/* A first fragment: whether later fragments of its datagram are held. Looked up only when some
 * fragment was held in the last EKP_FRAGHOLD_WINDOW_NS (ekp_fraglast, either family's: an array,
 * which the JIT reads in place), so in-order fragments pay no hash lookup on a node that sees none
 * out of order. Slots fill from 0, so slot 0 is there whenever any is (when the LRU took it, the
 * datagram is incomplete anyway). */
static __always_inline __u8 EKP_FRAGF(held)(const EKP_PKT *p, __u64 now)
{
	EKP_FRAGHOLD_KEY k = {};
	__u32 zero = 0;
	__u64 *last = ekp_fraglast_lookup(&zero);

	if (!last || ekp_age_ns(now, *last) > (__s64)EKP_FRAGHOLD_WINDOW_NS)
		return 0;
	EKP_FRAGHOLDF(key_of)(&k, p, 0);
	return EKP_FRAGHOLDF(lookup)(&k) ? 1 : 0;
}

#include "ekp_undef_af.h"
