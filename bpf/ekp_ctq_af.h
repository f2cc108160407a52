/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_ctq_af.h: the early-drop ring of ekp_ctq.h for one family, written once (the names and types
 * are ekp_def_af.h's, see ekp_ct_af.h): ekp_ctq_* on ekp_ctq_tcp / ekp_ctq_any / ekp_ctqh for
 * IPv4 (ekp_ctq.h), ekp_ctq6_* on ekp_ctq6_tcp / ekp_ctq6_any / ekp_ctqh6 for IPv6 (ekp_ct6.h).
 * No include guard: included once per family.
 */
#include "ekp_def_af.h"

/* A flow to queue, set by the decision (ekp_decide.h) and queued once at its end. */
struct EKP_CTQF(req) {
	EKP_CT_KEY key; /* the FORWARD key of the flow */
	__u32 created_s;       /* its created_s */
	__u8 want;             /* 1: queue it */
	__u8 pad[3];
};

static __always_inline void EKP_CTQF(want)(struct EKP_CTQF(req) *q, const EKP_CT_KEY *fkey, __u32 created_s)
{
	q->key = *fkey;
	q->created_s = created_s;
	q->want = 1;
}

/* Deletes the flow queued a ring ago in `s` when it is still that flow and evictable; returns the
 * counter to mark, 0 when nothing was deleted. */
static __always_inline __u32 EKP_CTQF(reclaim)(const EKP_CTQ_SLOT *s)
{
	EKP_CT_KEY k = {};

	EKP_A_SET(k.saddr, s->saddr);
	EKP_A_SET(k.daddr, s->daddr);
	k.sport = s->sport;
	k.dport = s->dport;
	k.proto = s->proto;
	k.dir = EKP_CT_FORWARD;
	EKP_CT_ENTRY *e = EKP_CTF(lookup)(&k);
	if (!e || e->created_s != s->created_s)
		return 0; /* gone already, or a later flow on the tuple (queued in its own slot) */
	__u32 stat = ekp_ctq_evictable(e->flags);
	if (!stat)
		return 0;
	EKP_CTF(delete_twin)(e, &k);
	EKP_CTF(delete)(&k);
	return stat;
}

/* Queues the flow `q` in its table's ring; the flow queued there before goes if evictable. Returns
 * the counter to mark (0: none). */
static __always_inline __u32 EKP_CTQF(push)(const struct EKP_CTQF(req) *q)
{
	__u32 ring = q->key.proto == IPPROTO_TCP ? EKP_CTQ_TCP : EKP_CTQ_ANY;
	__u64 *head = EKP_CTQH_LOOKUP(&ring);

	if (!head)
		return 0;
	/* The position is the high half: the add's carry out of it falls off the top, and the count
	 * (the low half, the agent's) is never touched, so one atomic add per flow queued. The 32-bit
	 * position wraps every 2^32 flows: where the slot count does not divide 2^32, the flows just
	 * after a wrap go back to slot 0 early, reclaiming flows less than a ring old (at most
	 * 2^32 % slots of them, once per 2^32 flows). */
	__u64 n = __sync_fetch_and_add(head, 1ULL << EKP_CTQH_POS_SHIFT);
	__u32 pos = n >> EKP_CTQH_POS_SHIFT;
	__u32 slots = n & EKP_CTQH_SLOTS_MASK;
	/* No test of a 0 count (a head no agent wrote): that branch cost ekp_from_pod6 50,000 more
	 * insns of the verifier's walk (bench.verifycost), and BPF's x % 0 is x, so such a head queues
	 * at its position while that is inside the ring and in no slot after (the lookup fails). */
	__u32 slot = pos % slots;
	EKP_CTQ_SLOT *s = EKP_CTQF(lookup)(ring, &slot);
	if (!s)
		return 0;
	__u32 stat = s->proto ? EKP_CTQF(reclaim)(s) : 0;

	EKP_A_SET(s->saddr, q->key.saddr);
	EKP_A_SET(s->daddr, q->key.daddr);
	s->sport = q->key.sport;
	s->dport = q->key.dport;
	s->dir = EKP_CT_FORWARD;
	s->created_s = q->created_s;
	s->proto = q->key.proto;
	return stat;
}

/* A usable conntrack hit moves its flow on (ekp_ct_transition): the new state on both entries, its
 * timeout running from now, and a flow that closes here queued for early drop under its FORWARD key
 * (`q`); else the once-a-second refresh (ekp_ct_refresh). Returns 1 when that rebuilt the twin, -1
 * when it deleted the entry (the packet is then no hit). */
static __always_inline int EKP_CTF(advance)(EKP_CT_ENTRY *e, EKP_CT_KEY *k, const struct ekp_pkt *p, __u64 now,
					    struct EKP_CTQF(req) *q)
{
	__u16 set = EKP_CTF(transition)(e, p, k->dir, now);

	if (set) {
		int closes = !ekp_ct_closed(e->flags) && ekp_ct_closed(e->flags | set);
		EKP_CTF(stamp)(e, k, now); /* the new state's timeout runs from here */
		EKP_CTF(mark)(e, k, set, 0);
		if (closes) {
			EKP_CT_KEY fkey = *k;
			if (k->dir == EKP_CT_REPLY)
				EKP_CTF(twin_key)(&fkey, k, e);
			EKP_CTQF(want)(q, &fkey, e->created_s);
		}
	} else {
		return EKP_CTF(refresh)(e, k, now);
	}
	return 0;
}

#include "ekp_undef_af.h"
