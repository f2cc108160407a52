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
 *
 * HOLD and release are ekp_tc_frag_af.h, one text for both families: instantiated here for IPv4
 * (ekp_tc_frag_hold, ekp_tc_frag_release) and in ekp_frag6.h for the tc IPv6 path
 * (ekp_tc_frag6_hold, ekp_tc_frag6_release).
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

#define EKP_CT_V6 0
#include "ekp_tc_frag_af.h"
#undef EKP_CT_V6

#endif /* EKP_TC_FRAG_H */
