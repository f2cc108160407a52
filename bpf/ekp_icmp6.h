/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_icmp6.h: turning an IPv6 packet the tc IPv6 path answers (ekp_tc6.h) into the ICMPv6 error
 * that answers it, in place, as ekp_icmp.h does for IPv4:
 *   - destination unreachable (type 1), port unreachable (code 4), a new flow's first packet to a
 *     frontend whose service has no endpoints: ip6tables' `-j REJECT` (its default reject type,
 *     icmp6-port-unreachable, the rule upstream's IPv6 proxier writes), from the frontend;
 *   - Packet Too Big (type 2, code 0) with the MTU of the device the translated segment would
 *     leave by (bpf_fib_lookup's mtu_result), the answer IPv4's fragmentation needed gives (IPv6
 *     routers never fragment: no DF to look at);
 *   - time exceeded (type 3, code 0: hop limit exceeded in transit), for a segment whose hop limit
 *     this hop would spend to 0.
 * All from the address the sender targeted (the frontend, or the client for a reply), quoting the
 * packet as the sender sent it (before translation), so its stack finds the socket by the quote:
 * the node's stack would have no nf_conntrack entry for a flow tc translated (ip6tables would see a
 * mid-flow segment as a new flow and translate it again).
 *
 *   in:  | eth | IPv6 (40) | extension headers | TCP ... payload |
 *   out: | eth, MACs swapped | IPv6: target -> sender, ICMPv6 | ICMPv6 2 or 3 | IPv6, extension
 *        headers, the L4 header (TCP 20 bytes, SCTP 12 or an INIT's 20, UDP 8) |
 *
 * Shaping as IPv4's: bpf_skb_change_tail trims the frame to Ethernet + the quote (which also drops
 * GSO state), then bpf_skb_adjust_room(+48, BPF_ADJ_ROOM_MAC) opens the new IPv6 and ICMPv6
 * headers in front of it. The quote keeps the whole L4 header: an skb from a local socket
 * (CHECKSUM_PARTIAL) cannot be cut before its checksum field (ekp_icmp.h: TCP's ends at byte 18,
 * SCTP's at 12, UDP's at 8), and no more, so a short datagram's quote never reaches past its end
 * (bpf_skb_change_tail would pad it with zeros); an SCTP INIT, at least 32 bytes, to its initiate
 * tag (20 bytes), as IPv4's (ekp_icmp.h: Linux's SCTP drops an error about a packet with tag 0
 * unless the quote shows the INIT and its initiate tag). Up to EKP_ICMP6_EXT_MAX bytes of extension headers: a segment
 * with more is not answered (the caller drops it, counted).
 * The ICMPv6 checksum covers the pseudo header (RFC 8200 8.1), the ICMPv6 header and the quote.
 */
#ifndef EKP_ICMP6_H
#define EKP_ICMP6_H

#include <linux/in.h>

#include "ekp_icmp.h"
#include "ekp_parse6.h"

#define EKP_ICMPV6_PORT_UNREACH 4 /* destination unreachable's code (EKP_ICMPV6_DEST_UNREACH) */
#define EKP_ICMPV6_PKT_TOOBIG 2
#define EKP_ICMPV6_TIME_EXCEED 3
#define EKP_ICMP6_EXT_MAX 56 /* extension headers quoted, at most (they come in 8-byte units) */
#define EKP_ICMP6_QUOTE_MAX 124 /* IPv6 header, 63 bytes (the mask below), TCP base header: 4n */

/* The headers put in front of the quote: IPv6 and ICMPv6, 48 bytes, no padding. */
struct ekp_icmp6_hdrs {
	__be32 ver_tc_flow; /* version 6, traffic class 0, flow label 0 */
	__be16 payload_len;
	__u8 nexthdr;
	__u8 hop_limit;
	__be32 saddr[4];
	__be32 daddr[4];
	__u8 type;
	__u8 code;
	__u16 checksum;
	__be32 word; /* Packet Too Big: the MTU; the others: unused, 0 */
};

_Static_assert(sizeof(struct ekp_icmp6_hdrs) == 48, "IPv6 header + ICMPv6 header");

/* The pseudo header of the ICMPv6 checksum (RFC 8200 8.1). */
struct ekp_icmp6_pseudo {
	__be32 saddr[4];
	__be32 daddr[4];
	__be32 len;
	__be32 nexthdr; /* three zero bytes, then the next header */
};

/* Working memory of ekp_icmp6_error (the tc IPv6 path's scratch). */
struct ekp_icmp6_work {
	struct ekp_icmp6_hdrs h;
	struct ekp_icmp6_pseudo ph;
	__u8 macs[2 * ETH_ALEN];
	__u8 quote[EKP_ICMP6_QUOTE_MAX]; /* zero tail: adds nothing to the checksum */
};

/* Whether the sender gets an answer: not for a TCP RST nor a later fragment (IPv4's rules,
 * ekp_icmp_wanted: a later fragment's quote holds no ports, so no socket could take it), nor for a
 * frame to a link-layer broadcast or multicast address (icmp6_send's pkt_type check, which lets
 * Packet Too Big through; here none: no sender of a translated flow addresses it so), nor to a
 * source that names no single node (unspecified, multicast: RFC 4443 2.4 e), nor to one the
 * stack's ip6_rcv_core drops as a martian on a wire: loopback (::1) and IPv4-mapped
 * (::ffff:0:0/96, RFC 4291 2.5.5.2), as IPv4's refuses 127/8 and 0/8. */
static __always_inline int ekp_icmp6_wanted(const struct ekp_pkt6 *p)
{
	__u32 first = ntohl(p->saddr[0]);

	if ((p->b.tcp_flags & EKP_TCP_RST) || p->b.frag == EKP_FRAG_LATER || p->b.l2_group)
		return 0;
	if ((first >> 24) == 0xff)
		return 0;
	if (p->saddr[0] | p->saddr[1])
		return 1;
	__u32 third = ntohl(p->saddr[2]), last = ntohl(p->saddr[3]);
	return !(third == 0xffff || (third == 0 && last <= 1)); /* v4-mapped, unspecified, loopback */
}

/* Rewrites the skb into the ICMPv6 error `type`, `code` (`word` after the checksum) answering the
 * TCP, UDP or SCTP packet `p` (see the top of this file); the caller redirects it to the egress of the device
 * it came in on. 0, or -1 when the skb could not be shaped: drop it then (the frame may be half
 * rewritten). */
static __always_inline int ekp_icmp6_error(struct __sk_buff *skb, const struct ekp_pkt6 *p, __u8 type, __u8 code,
					   __u32 word, struct ekp_icmp6_work *w)
{
	__u32 ext = p->b.l4_off - EKP_IP6_OFF - 40; /* the extension headers' bytes */

	if (ext > EKP_ICMP6_EXT_MAX)
		return -1;
	/* The same bound where the verifier sees it: LLVM would drop the mask as implied by the test
	 * and size the load from l4_off, which the verifier does not bound. */
	asm volatile("" : "+r"(ext));
	ext &= 0x3f;
	/* an INIT shorter than its quote (malformed: an INIT is at least 32 bytes) is not padded */
	int init = p->b.proto == IPPROTO_SCTP && p->b.chunk == EKP_SCTP_CID_INIT && p->b.l4_len >= EKP_ICMP_L4_QUOTE_INIT;
	__u32 l4 = p->b.proto == IPPROTO_TCP	? EKP_ICMP_L4_QUOTE_TCP
		   : init			? EKP_ICMP_L4_QUOTE_INIT
		   : p->b.proto == IPPROTO_SCTP ? EKP_ICMP_L4_QUOTE_SCTP
						: EKP_ICMP_L4_QUOTE;
	__u32 qlen = 40 + ext + l4;

	__builtin_memset(w, 0, sizeof(*w));
	if (bpf_skb_load_bytes(skb, 0, w->macs, sizeof(w->macs)) < 0)
		return -1;
	if (bpf_skb_change_tail(skb, EKP_IP6_OFF + qlen, 0) < 0)
		return -1;
	if (bpf_skb_load_bytes(skb, EKP_IP6_OFF, w->quote, qlen) < 0)
		return -1;
	if (bpf_skb_adjust_room(skb, sizeof(w->h), BPF_ADJ_ROOM_MAC, 0) < 0)
		return -1;

	struct ekp_icmp6_hdrs *h = &w->h;
	__u32 len = sizeof(h->type) + sizeof(h->code) + sizeof(h->checksum) + sizeof(h->word) + qlen;
	h->ver_tc_flow = htonl(6U << 28);
	h->payload_len = htons(len);
	h->nexthdr = EKP_NH_ICMPV6;
	h->hop_limit = EKP_ICMP_TTL;
	__builtin_memcpy(h->saddr, p->daddr, 16); /* the address the sender targeted */
	__builtin_memcpy(h->daddr, p->saddr, 16);
	h->type = type;
	h->code = code;
	h->word = htonl(word);

	struct ekp_icmp6_pseudo *ph = &w->ph;
	__builtin_memcpy(ph->saddr, h->saddr, 16);
	__builtin_memcpy(ph->daddr, h->daddr, 16);
	ph->len = htonl(len);
	ph->nexthdr = htonl(EKP_NH_ICMPV6);
	__s64 sum = bpf_csum_diff(0, 0, (void *)ph, sizeof(*ph), 0);
	if (sum < 0)
		return -1;
	sum = bpf_csum_diff(0, 0, (void *)&h->type, 8, (__u32)sum); /* type, code, checksum 0, word */
	if (sum < 0)
		return -1;
	sum = bpf_csum_diff(0, 0, (void *)w->quote, sizeof(w->quote), (__u32)sum);
	if (sum < 0)
		return -1;
	h->checksum = ekp_csum_fold(sum);

	if (bpf_skb_store_bytes(skb, EKP_IP6_OFF, h, sizeof(*h), BPF_F_RECOMPUTE_CSUM) < 0 ||
	    bpf_skb_store_bytes(skb, 0, w->macs + ETH_ALEN, ETH_ALEN, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, w->macs, ETH_ALEN, 0) < 0)
		return -1;
	return 0;
}

#endif /* EKP_ICMP6_H */
