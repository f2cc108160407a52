/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_host_af.h: legacy host routing's per-family code (ekp_host.h says what it does), written once
 * and included twice, as ekp_ct_af.h is: by ekp_host.h with EKP_CT_V6 0 (ekp_host_*, ekp_hostnat_v2,
 * struct ekp_pkt) and by ekp_host6.h with EKP_CT_V6 1 (ekp_host6_*, ekp_hostnat6_v2, struct
 * ekp_pkt6). The names and address macros are ekp_def_af.h's.
 *
 * The one difference between the families: only IPv4 keeps the stack's reply tuple of a SNAT flow
 * (tag 0, ekp_host_note_stack_reply), as only IPv4's egress reads it (ekp_decide_stack_reply).
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
#if !EKP_CT_V6
			if (!EKP_A_EQ(da, p->daddr) || dp != EKP_PB(p)->dport)
				ekp_host_note_stack_reply(p, da, dp);
#endif
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
