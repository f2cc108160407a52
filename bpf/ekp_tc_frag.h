/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc_frag.h: holding later fragments that came before their first, and putting them back into
 * the path when it comes (tc; the decision is ekp_frag.h's).
 *
 *   HOLD     the frame is copied into ekp_fraghold_v2 under the first free slot of its datagram,
 *            with the device it came in by, and dropped (counted EKP_STAT_FRAG_HELD). No room (a
 *            frame over EKP_FRAGHOLD_LEN, EKP_FRAGHOLD_SLOTS held): EKP_DROP_FRAG_NO_FIRST.
 *   release  the first fragment of a datagram with held fragments: before its own decision is
 *            applied, the skb is saved, then made into each held frame in turn and cloned into the
 *            ingress of that frame's device (bpf_clone_redirect, BPF_F_INGRESS), then restored.
 *            A clone is queued to the CPU's backlog (netif_rx), so it runs through the program
 *            after this run ends: the first fragment's record, and the flow it starts, are there.
 *
 * bpf_clone_redirect is the only way for a tc program to emit a frame it does not hold; the skb
 * it clones is the one in hand, hence the save and restore (a few microseconds, only for a
 * datagram that came out of order). The restored skb has the same bytes and length, so the parsed
 * packet and its decision stay valid.
 */
#ifndef EKP_TC_FRAG_H
#define EKP_TC_FRAG_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/pkt_cls.h>

#include "ekp_frag.h"
#include "ekp_maps.h"
#include "ekp_stats.h"

/* `len` when a frame of that size can be held (more than an Ethernet header, at most
 * EKP_FRAGHOLD_LEN), else 0. The two tests stay apart (the empty asm): LLVM folds them into one
 * `len - 15 > 1505` on a copy, which leaves the verifier no bound on `len` itself; 64 bits, or the asm gets a
 * zero-extended copy just the same. */
static __always_inline __u64 ekp_tc_frag_len(__u64 len)
{
	if (len > EKP_FRAGHOLD_LEN)
		return 0;
	asm volatile("" : "+r"(len));
	if (len <= ETH_HLEN)
		return 0;
	return len;
}

/* The bytes of a frame of `len` bytes written over the skb: the Ethernet header as it is, the rest
 * with the checksum of a CHECKSUM_COMPLETE skb kept right. */
static __always_inline int ekp_tc_frag_write(struct __sk_buff *skb, const __u8 *data, __u64 len)
{
	len = ekp_tc_frag_len(len);
	if (!len)
		return -1;
	if (bpf_skb_change_tail(skb, len, 0) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, 0, data, ETH_HLEN, 0) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, ETH_HLEN, data + ETH_HLEN, len - ETH_HLEN, BPF_F_RECOMPUTE_CSUM);
}

/* HOLD: returns the verdict; d->outcome is FRAG_HELD, or the drop. */
static __always_inline int ekp_tc_frag_hold(struct __sk_buff *skb, const struct ekp_pkt *p,
					    struct ekp_fraghold *v, struct ekp_decision *d)
{
	struct ekp_fraghold_key k = {};
	__u64 len = ekp_tc_frag_len(skb->len);

	if (!len || bpf_skb_load_bytes(skb, 0, v->data, len) < 0) {
		d->outcome = EKP_DROP_FRAG_NO_FIRST;
		return TC_ACT_SHOT;
	}
	v->len = len;
	v->ifindex = skb->ifindex;
#pragma clang loop unroll(disable)
	for (__u8 slot = 0; slot < EKP_FRAGHOLD_SLOTS; slot++) {
		ekp_fraghold_key_of(&k, p, slot);
		if (ekp_fraghold_lookup(&k))
			continue;
		/* BPF_NOEXIST: another CPU holding a fragment of the datagram may have taken it */
		if (ekp_fraghold_insert(&k, v) == 0) {
			__u32 zero = 0;
			__u64 *last = ekp_fraglast_lookup(&zero);
			if (last)
				*last = bpf_ktime_get_ns(); /* first fragments look for held ones from now on */
			return TC_ACT_SHOT; /* held: the copy goes back in when the first fragment comes */
		}
	}
	d->outcome = EKP_DROP_FRAG_NO_FIRST;
	return TC_ACT_SHOT;
}

/* release: every held fragment of the datagram of `p` (its first fragment, in the skb) goes back
 * into its device. 0, or -1 when the first fragment could not be restored (drop it then). */
static __always_inline int ekp_tc_frag_release(struct __sk_buff *skb, const struct ekp_pkt *p,
					       struct ekp_fraghold *saved)
{
	struct ekp_fraghold_key k = {};
	__u64 len = ekp_tc_frag_len(skb->len);

	if (!len || bpf_skb_load_bytes(skb, 0, saved->data, len) < 0)
		return 0; /* cannot save this one: the held fragments wait for the LRU (datagram lost) */
	int changed = 0;
#pragma clang loop unroll(disable)
	for (__u8 slot = 0; slot < EKP_FRAGHOLD_SLOTS; slot++) {
		ekp_fraghold_key_of(&k, p, slot);
		struct ekp_fraghold *h = ekp_fraghold_lookup(&k);
		if (!h)
			continue;
		changed = 1;
		if (ekp_tc_frag_write(skb, h->data, h->len) == 0 && bpf_clone_redirect(skb, h->ifindex, BPF_F_INGRESS) == 0)
			ekp_count(EKP_STAT_FRAG_RELEASED);
		ekp_fraghold_delete(&k);
	}
	if (changed && ekp_tc_frag_write(skb, saved->data, len) < 0)
		return -1;
	return 0;
}

#endif /* EKP_TC_FRAG_H */
