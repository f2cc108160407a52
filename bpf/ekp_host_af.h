/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_host_af.h: legacy host routing's per-family code (ekp_host.h says what it does), written once
 * and included twice, as ekp_ct_af.h is: by ekp_host.h with EKP_CT_V6 0 (ekp_host_*, ekp_hostnat_v2,
 * struct ekp_pkt) and by ekp_host6.h with EKP_CT_V6 1 (ekp_host6_*, ekp_hostnat6_v2, struct
 * ekp_pkt6). The names and address macros are ekp_def_af.h's.
 *
 * Both families keep the stack's reply tuple of a flow whose both addresses ingress translated (tag 0,
 * EKP_HOSTF(note_stack_reply)) and find it for what the stack itself sends about that flow
 * (EKP_HOSTF(stack_reply)); what they make of it differs only as their decisions do (IPv4's
 * ekp_decide_stack_reply fills an ekp_decision, IPv6's ekp_tc6_stack_reply and ekp_tc6_stack_related
 * rewrite at once, ekp_tc6.h).
 *
 * No include guard: included once per family.
 */
#include "ekp_def_af.h"

/* The tag of the flow direction `p` arrived on: its tuple hashed to 16 bits, never 0 (an IPv6
 * address folded to 32 bits first: a tag only tells apart flows that leave with one tuple). */
static __always_inline __u16 EKP_HOSTF(tag)(const EKP_PKT *p)
{
	__u32 h = EKP_A_FOLD(p->saddr) * EKP_HOST_MIX;

	h = (h ^ EKP_A_FOLD(p->daddr)) * EKP_HOST_MIX;
	h = (h ^ (((__u32)EKP_PB(p)->sport << 16) | EKP_PB(p)->dport)) * EKP_HOST_MIX;
	h = (h ^ EKP_PB(p)->proto) * EKP_HOST_MIX;
	__u16 tag = h >> 16;
	return tag ? tag : 1;
}

/* Both addresses translated (a SNAT flow, either direction): the packets the node's stack itself
 * sends back about this one (a REJECT's RST or ICMP error in FORWARD, an ICMP error of its routing)
 * carry the tuple the stack saw, which no conntrack key holds (the REPLY key has the SNAT port).
 * Kept under tag 0 (no ingress tag is 0): the stack's reply tuple -> the source that reply needs,
 * this packet's destination as it arrived (the frontend; the SNAT address for a reply's). Written
 * with the tagged entry (when missing or stale), so it costs nothing per packet; it may be evicted
 * before it (it is read only by such packets), and such a packet then leaves untranslated, as
 * before. A failed update costs only that. `da`, `dp`: the packet's destination after
 * translation. */
static __always_inline void EKP_HOSTF(note_stack_reply)(const EKP_PKT *p, EKP_A_ARG da, __be16 dp)
{
	EKP_HOSTNAT_KEY k = {};
	EKP_HOSTNAT v = {};

	EKP_HOSTNAT_KEY_OF(&k, da, p->saddr, dp, EKP_PB(p)->sport, EKP_PB(p)->proto, 0);
	EKP_A_SET(v.saddr, p->daddr);
	v.sport = EKP_PB(p)->dport;
	EKP_HOSTNAT_UPDATE(&k, &v);
}

/* The tag-0 entry (EKP_HOSTF(note_stack_reply)) of a packet the node's stack sends (tc egress, no
 * conntrack entry claimed it): a TCP RST or UDP datagram by its own tuple (backend -> client), an
 * ICMP error (`related`) by its quote reversed (the quote is the packet as the stack saw it,
 * client -> backend). NULL when none. */
static __always_inline EKP_HOSTNAT *EKP_HOSTF(stack_reply)(const EKP_PKT *p, int related)
{
	EKP_HOSTNAT_KEY k = {};

	if (related)
		EKP_HOSTNAT_KEY_OF(&k, p->in_daddr, p->in_saddr, EKP_PB(p)->in_dport, EKP_PB(p)->in_sport,
				   EKP_PB(p)->in_proto, 0);
	else
		EKP_HOSTNAT_KEY_OF(&k, p->saddr, p->daddr, EKP_PB(p)->sport, EKP_PB(p)->dport, EKP_PB(p)->proto,
				   0);
	return EKP_HOSTNAT_LOOKUP(&k);
}

/* Ingress: the decided destination (da, dp) now, the decided source (sa, sp) left for egress; the
 * packet goes to the stack (TC_ACT_OK). Sets *outcome to a drop when it cannot. */
static __always_inline int EKP_HOSTF(hand_over)(struct __sk_buff *skb, const EKP_PKT *p, EKP_A_ARG sa, __be16 sp,
						EKP_A_ARG da, __be16 dp, __u32 *outcome)
{
	if (!EKP_A_EQ(sa, p->saddr) || sp != EKP_PB(p)->sport) {
		EKP_HOSTNAT_KEY k = {};
		EKP_HOSTNAT_KEY_OF(&k, p->saddr, da, EKP_PB(p)->sport, dp, EKP_PB(p)->proto, EKP_HOSTF(tag)(p));
		EKP_HOSTNAT *v = EKP_HOSTNAT_LOOKUP(&k);
		if (!v || !EKP_A_EQ(v->saddr, sa) || v->sport != sp) {
			EKP_HOSTNAT nv = {};
			EKP_A_SET(nv.saddr, sa);
			nv.sport = sp;
			if (EKP_HOSTNAT_UPDATE(&k, &nv) < 0) {
				*outcome = EKP_DROP_CT_FULL;
				return TC_ACT_SHOT;
			}
			if (!EKP_A_EQ(da, p->daddr) || dp != EKP_PB(p)->dport)
				EKP_HOSTF(note_stack_reply)(p, da, dp);
		}
		skb->tc_classid = k.tag; /* skb->tc_index at egress (ekp_host.h) */
	}
	if (EKP_REWRITE(skb, p, p->saddr, EKP_PB(p)->sport, da, dp) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	return TC_ACT_OK;
}

/* Egress: a packet the ingress program tagged (`tag`, its skb->tc_index, nonzero) gets its source.
 * A tagged packet whose entry is gone (evicted between ingress and egress) leaves as it is. */
static __always_inline int EKP_HOSTF(egress)(struct __sk_buff *skb, __u16 tag)
{
	EKP_SCRATCH *w = EKP_SCRATCH_LOOKUP();
	if (!w)
		return TC_ACT_OK; /* cannot happen: a one-element per-CPU array */
	EKP_PKT *p = EKP_SCRATCH_PKT(w);
	__builtin_memset(p, 0, sizeof(*p));
	int parsed = EKP_PARSE(skb, p);
	if (parsed == EKP_PARSE_LATER) {
		if (!EKP_FRAGF(ports)(p))
			return TC_ACT_OK;
	} else if (parsed != EKP_PARSE_OK) {
		return TC_ACT_OK;
	}
	EKP_HOSTNAT_KEY k = {};
	EKP_HOSTNAT_KEY_OF(&k, p->saddr, p->daddr, EKP_PB(p)->sport, EKP_PB(p)->dport, EKP_PB(p)->proto, tag);
	EKP_HOSTNAT *v = EKP_HOSTNAT_LOOKUP(&k);
	if (!v)
		return TC_ACT_OK;
	EKP_A_VAR(saddr);
	EKP_A_SET(saddr, v->saddr);
	__be16 sport = v->sport;
	if (EKP_PB(p)->frag == EKP_FRAG_FIRST)
		EKP_FRAGF(record)(p); /* its later fragments leave with the same tuple, without ports */
	if (EKP_REWRITE(skb, p, saddr, sport, p->daddr, EKP_PB(p)->dport) < 0)
		return TC_ACT_SHOT;
	return TC_ACT_OK;
}

#include "ekp_undef_af.h"
