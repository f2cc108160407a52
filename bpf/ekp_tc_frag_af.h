/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc_frag_af.h: HOLD and release (ekp_tc_frag.h says what they do) for one family, included
 * as ekp_frag_af.h is: by ekp_tc_frag.h with EKP_CT_V6 0 (ekp_tc_frag_*) and by ekp_frag6.h with
 * EKP_CT_V6 1 (ekp_tc_frag6_*). The frame held is the family's own; the map of held frames is
 * ekp_fraghold / ekp_fraghold6 (ekp_def_af.h's names).
 *
 * No include guard: included once per family.
 */
#include "ekp_def_af.h"

/* HOLD: returns the verdict; *outcome is left as it is (FRAG_HELD), or set to the drop. */
static __always_inline int EKP_TCFRAGF(hold)(struct __sk_buff *skb, const EKP_PKT *p, struct ekp_fraghold *v,
					  __u32 *outcome)
{
	EKP_FRAGHOLD_KEY k = {};
	__u64 len = ekp_tc_frag_len(skb->len);

	if (!len || bpf_skb_load_bytes(skb, 0, v->data, len) < 0) {
		*outcome = EKP_DROP_FRAG_NO_FIRST;
		return TC_ACT_SHOT;
	}
	v->len = len;
	v->ifindex = skb->ifindex;
#pragma clang loop unroll(disable)
	for (__u8 slot = 0; slot < EKP_FRAGHOLD_SLOTS; slot++) {
		EKP_FRAGHOLDF(key_of)(&k, p, slot);
		if (EKP_FRAGHOLDF(lookup)(&k))
			continue;
		/* BPF_NOEXIST: another CPU holding a fragment of the datagram may have taken it */
		if (EKP_FRAGHOLDF(insert)(&k, v) == 0) {
			__u32 zero = 0;
			__u64 *last = ekp_fraglast_lookup(&zero);
			if (last)
				*last = bpf_ktime_get_ns(); /* first fragments look for held ones from now on */
			return TC_ACT_SHOT; /* held: the copy goes back in when the first fragment comes */
		}
	}
	*outcome = EKP_DROP_FRAG_NO_FIRST;
	return TC_ACT_SHOT;
}

/* release: every held fragment of the datagram of `p` (its first fragment, in the skb) goes back
 * into its device. 0, or -1 when the first fragment could not be restored (drop it then). */
static __always_inline int EKP_TCFRAGF(release)(struct __sk_buff *skb, const EKP_PKT *p, struct ekp_fraghold *saved)
{
	EKP_FRAGHOLD_KEY k = {};
	__u64 len = ekp_tc_frag_len(skb->len);

	if (!len || bpf_skb_load_bytes(skb, 0, saved->data, len) < 0)
		return 0; /* cannot save this one: the held fragments wait for the LRU (datagram lost) */
	int changed = 0;
#pragma clang loop unroll(disable)
	for (__u8 slot = 0; slot < EKP_FRAGHOLD_SLOTS; slot++) {
		EKP_FRAGHOLDF(key_of)(&k, p, slot);
		struct ekp_fraghold *h = EKP_FRAGHOLDF(lookup)(&k);
		if (!h)
			continue;
		changed = 1;
		if (ekp_tc_frag_write(skb, h->data, h->len) == 0 && bpf_clone_redirect(skb, h->ifindex, BPF_F_INGRESS) == 0)
			ekp_count(EKP_STAT_FRAG_RELEASED);
		EKP_FRAGHOLDF(delete)(&k);
	}
	if (changed && ekp_tc_frag_write(skb, saved->data, len) < 0)
		return -1;
	return 0;
}

#include "ekp_undef_af.h"
