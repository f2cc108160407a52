/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_icmp.h: turning a packet into the ICMP error that answers it, in place:
 *   - destination unreachable / port unreachable (type 3 code 3), the answer of kube-proxy's
 *     `-j REJECT` for a service without endpoints, from the frontend the client targeted;
 *   - destination unreachable / fragmentation needed (type 3 code 4) with the next-hop MTU, when
 *     a translated packet with DF set is too big for the device it would leave by, from the
 *     address the sender targeted, quoting the packet as the sender sent it (before our
 *     translation), so the sender's stack matches it to its socket and lowers its path MTU.
 *
 *   in:  | eth | IP (ihl*4) | L4 ... payload |
 *   out: | eth, MACs swapped | IP: target -> sender, ICMP | ICMP 3/x | IP (ihl*4) | 8 bytes |
 *
 * Shaping: bpf_skb_change_tail trims the frame to Ethernet + the quote (the original IP header,
 * options included, and the first 8 bytes of its payload, RFC 792), then
 * bpf_skb_adjust_room(+28, BPF_ADJ_ROOM_MAC) opens the new IP and ICMP headers between the
 * Ethernet header and the quote, which therefore never moves. Trimming first also clears GSO
 * state (adjust_room refuses to grow a UDP GSO skb); adjust_room then turns CHECKSUM_UNNECESSARY
 * into CHECKSUM_NONE, and the header stores keep a CHECKSUM_COMPLETE sum right.
 *
 * Checksum offload: an skb from a local socket (every pod behind a veth) is CHECKSUM_PARTIAL and
 * bpf_skb_change_tail refuses to cut it before its L4 checksum field (__bpf_skb_min_len), 18
 * bytes into a TCP header. For TCP the quote then keeps the whole 20-byte TCP base header (RFC
 * 1812 allows quoting more than 8 bytes; Linux itself quotes up to 576 bytes), for SCTP the 12
 * bytes of its common header (the CRC32c offload, csum_not_inet). UDP's checksum field ends at
 * byte 8, so a UDP quote is always 8 bytes. An SCTP INIT is quoted to 20 bytes whatever its
 * skb: its verification tag is 0, and Linux's SCTP (sctp_err_lookup, RFC 9260 appendix C) takes
 * an error about a packet with tag 0 only when the quote shows the INIT chunk's header and its
 * initiate tag (bytes 12-19), else drops it and the client never learns of the refusal. An INIT
 * is at least 32 bytes: the quote never reaches past it. The skb stays CHECKSUM_PARTIAL (no
 * helper clears it) with csum_start on the quoted L4 header: the receiving stack takes the ICMP
 * checksum as verified; a device that would compute that offload in software on the way out (a
 * veth with tx checksumming turned off) would spoil the ICMP checksum.
 *
 * Not answered (the caller drops): a TCP RST; a source that is not a unicast host (0/8,
 * 127/8, multicast, class E, broadcast), or a frame to a link-layer broadcast or multicast
 * address (skb->pkt_type, ekp_parse's l2_group), as icmp_send refuses. Never called for ICMP. Rejects
 * are rate-limited by the caller (ekp_ratelimit.h); fragmentation needed is not, as in the kernel.
 */
#ifndef EKP_ICMP_H
#define EKP_ICMP_H

#include <linux/icmp.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>

#include "ekp_nat.h"
#include "ekp_parse.h"

#define EKP_ICMP_L4_QUOTE 8      /* RFC 792: the first 64 bits of the datagram's data */
#define EKP_ICMP_L4_QUOTE_TCP 20 /* a CHECKSUM_PARTIAL TCP skb: the whole TCP base header */
#define EKP_ICMP_L4_QUOTE_SCTP 12 /* a CHECKSUM_PARTIAL SCTP skb: the whole common header */
#define EKP_ICMP_L4_QUOTE_INIT 20 /* an SCTP INIT: common header, chunk header, initiate tag */
#define EKP_ICMP_QUOTE_MAX (60 + EKP_ICMP_L4_QUOTE_TCP) /* = 60 + EKP_ICMP_L4_QUOTE_INIT */
_Static_assert(EKP_ICMP_L4_QUOTE_INIT <= EKP_ICMP_L4_QUOTE_TCP, "an INIT's quote fits the quote buffer");
#define EKP_ICMP_TTL 64
#define EKP_IPTOS_TOS_MASK 0x1e             /* IPTOS_TOS_MASK */
#define EKP_IPTOS_PREC_INTERNETCONTROL 0xc0 /* what icmp_send gives its errors */

/* The headers put in front of the quote; 28 bytes, no padding. */
struct ekp_icmp_hdrs {
	struct iphdr ip;
	struct icmphdr icmp;
};

_Static_assert(sizeof(struct ekp_icmp_hdrs) == 28, "IPv4 header + ICMP header");

/* Working memory of ekp_icmp_unreach, kept off the 512-byte stack (ekp_tc_scratch.h). */
struct ekp_icmp_work {
	struct ekp_icmp_hdrs h;
	__u8 macs[2 * ETH_ALEN];
	__u8 quote[EKP_ICMP_QUOTE_MAX]; /* zero tail: adds nothing to the checksum */
};

/* Whether the client gets an answer: any UDP, TCP without RST, from a unicast host address, in a
 * frame to this host alone (the kernel's icmp_send answers no link-layer broadcast or multicast). */
static __always_inline int ekp_icmp_wanted(const struct ekp_pkt *p)
{
	__u32 src = ntohl(p->saddr);
	__u8 first = src >> 24;

	if ((p->proto == IPPROTO_TCP && (p->tcp_flags & EKP_TCP_RST)) || p->l2_group)
		return 0;
	if (first == 0 || first == 127 || first >= 224) /* this network, loopback, multicast, E */
		return 0;
	return 1;
}

/* Rewrites the skb into the ICMP error (type 3, `code`; `mtu` for fragmentation needed) answering
 * `p` (see the top of this file); the caller redirects it to the egress of the device it came in
 * on. 0, or -1 when the skb could not be shaped: drop it then (the frame may be half rewritten). */
static __always_inline int ekp_icmp_unreach(struct __sk_buff *skb, const struct ekp_pkt *p, __u8 code, __u16 mtu,
					    struct ekp_icmp_work *w)
{
	/* The parser bounds ihl to 20..60 in steps of 4; the mask tells the verifier, which does not
	 * follow values through the per-CPU work area. */
	__u32 ihl = (p->l4_off - EKP_IP_OFF) & 0x3c;
	/* an INIT shorter than its quote (malformed: an INIT is at least 32 bytes) is not padded */
	int init = p->proto == IPPROTO_SCTP && p->chunk == EKP_SCTP_CID_INIT && p->l4_len >= EKP_ICMP_L4_QUOTE_INIT;
	__u32 qlen = ihl + (init ? EKP_ICMP_L4_QUOTE_INIT : EKP_ICMP_L4_QUOTE);

	__builtin_memset(w, 0, sizeof(*w));
	if (bpf_skb_load_bytes(skb, 0, w->macs, sizeof(w->macs)) < 0)
		return -1;
	if (bpf_skb_change_tail(skb, EKP_IP_OFF + qlen, 0) < 0) {
		/* CHECKSUM_PARTIAL keeps the checksum field in the frame: TCP's (bytes 16-17), SCTP's
		 * (8-11). */
		if ((p->proto != IPPROTO_TCP && p->proto != IPPROTO_SCTP) || p->frag == EKP_FRAG_LATER || init)
			return -1;
		qlen = ihl + (p->proto == IPPROTO_TCP ? EKP_ICMP_L4_QUOTE_TCP : EKP_ICMP_L4_QUOTE_SCTP);
		if (bpf_skb_change_tail(skb, EKP_IP_OFF + qlen, 0) < 0)
			return -1;
	}
	if (ihl < sizeof(struct iphdr))
		return -1;
	if (bpf_skb_load_bytes(skb, EKP_IP_OFF, w->quote, qlen) < 0)
		return -1;
	if (bpf_skb_adjust_room(skb, sizeof(w->h), BPF_ADJ_ROOM_MAC, 0) < 0)
		return -1;

	struct ekp_icmp_hdrs *h = &w->h;
	h->ip.version = 4;
	h->ip.ihl = sizeof(h->ip) / 4;
	h->ip.tos = (p->tos & EKP_IPTOS_TOS_MASK) | EKP_IPTOS_PREC_INTERNETCONTROL;
	h->ip.tot_len = htons(sizeof(*h) + qlen);
	h->ip.id = (__be16)bpf_get_prandom_u32();
	h->ip.ttl = EKP_ICMP_TTL;
	h->ip.protocol = IPPROTO_ICMP;
	h->ip.saddr = p->daddr; /* the address the sender targeted (the frontend, for a reject) */
	h->ip.daddr = p->saddr;
	h->ip.check = ekp_csum_fold(bpf_csum_diff(0, 0, (void *)&h->ip, sizeof(h->ip), 0));

	h->icmp.type = ICMP_DEST_UNREACH;
	h->icmp.code = code;
	if (code == ICMP_FRAG_NEEDED)
		h->icmp.un.frag.mtu = htons(mtu);
	__s64 sum = bpf_csum_diff(0, 0, (void *)&h->icmp, sizeof(h->icmp), 0);
	if (sum < 0)
		return -1;
	sum = bpf_csum_diff(0, 0, (void *)w->quote, sizeof(w->quote), (__u32)sum);
	if (sum < 0)
		return -1;
	h->icmp.checksum = ekp_csum_fold(sum);

	if (bpf_skb_store_bytes(skb, EKP_IP_OFF, h, sizeof(*h), BPF_F_RECOMPUTE_CSUM) < 0 ||
	    bpf_skb_store_bytes(skb, 0, w->macs + ETH_ALEN, ETH_ALEN, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, w->macs, ETH_ALEN, 0) < 0)
		return -1;
	return 0;
}

#endif /* EKP_ICMP_H */
