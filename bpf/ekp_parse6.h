/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_parse6.h: Ethernet / IPv6 / TCP-UDP parsing for the tc programs' IPv6 path (ekp_tc6.h).
 *
 * The IPv4 packet's value (struct ekp_pkt) carries the family-free part: ports, protocol, TCP
 * flags, the L4 offset, the fragment kind, so the conntrack state machine (ekp_ct.h) and the
 * backend choice (ekp_lb.h) read it as they read an IPv4 packet's; the 16-byte addresses sit
 * beside it (struct ekp_pkt6).
 *
 * Extension headers are walked to the transport header, at most EKP_IPV6_EXT_MAX of them
 * (hop-by-hop, routing, destination options, fragment; AH is skipped by its own length rule): a
 * packet with more is not ours (the stack and ip6tables see it untouched). The IPv6 header, and
 * the L4 header right behind it (no extension header: nearly every packet), are read straight from
 * the linear data when they are there (ekp_at6), as IPv4's parser reads its headers; every other
 * read goes through bpf_skb_load_bytes (bpf_xdp_load_bytes for the XDP program, ekp_xdp6.h: the
 * same walk, `xdp` a constant at each call site) at an offset, so a header in paged data or behind
 * extension headers needs no pull and the verifier tracks no packet pointer across a
 * variable-length walk. The helper costs: two calls were 34 ns of an untranslated packet's 117 in
 * ekp_from_pod, the reads from the frame 8 (IPv4's parse, 6; bench/v6cost.py).
 *
 * A routing header with segments left names another destination than the one the packet is
 * addressed to (SRv6, type 0): not ours. A fragment header makes the packet a first fragment
 * (offset 0: the L4 header is parsed) or a later one (EKP_PARSE_LATER, no ports).
 *
 * ICMPv6 errors (destination unreachable 1, packet too big 2, time exceeded 3, parameter problem
 * 4), whole, quoting the start of a TCP, UDP or SCTP packet (its own extension headers walked the
 * same way, not a later fragment, at least the 8 bytes that hold the ports): EKP_PARSE_ICMP_ERR, with
 * the quote's tuple and offsets in the ekp_pkt fields IPv4's quote uses and its addresses beside
 * them. They may be about a flow this path translated (ekp_tc6.h, ekp_tc6_related).
 */
#ifndef EKP_PARSE6_H
#define EKP_PARSE6_H

#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/ipv6.h>

#include "ekp_parse.h"

#define EKP_IP6_OFF ETH_HLEN
#define EKP_IP6_SADDR_OFF (EKP_IP6_OFF + 8)
#define EKP_IP6_DADDR_OFF (EKP_IP6_OFF + 24)
#define EKP_IP6_HOPLIMIT_OFF (EKP_IP6_OFF + 7)
#define EKP_IPV6_EXT_MAX 4

/* IPv6 next-header values of the extension headers we walk (linux/in6.h's IPPROTO_*). */
#define EKP_NH_HOP 0
#define EKP_NH_ROUTING 43
#define EKP_NH_FRAGMENT 44
#define EKP_NH_AH 51
#define EKP_NH_DSTOPTS 60
#define EKP_NH_ICMPV6 58

#define EKP_ICMPV6_DEST_UNREACH 1
#define EKP_ICMPV6_PARAMPROB 4 /* the last error type; 2 packet too big, 3 time exceeded */

struct ekp_pkt6 {
	struct ekp_pkt b;  /* ports, proto, tcp_flags, l4_off, frag; an ICMPv6 error: icmp_type and
			    * code, and its quote's in_proto, in_sport, in_dport, in_off, in_l4_off,
			    * in_l4_len (its IPv4 addresses stay 0) */
	__be32 saddr[4];   /* be */
	__be32 daddr[4];   /* be */
	__be32 in_saddr[4]; /* be: an ICMPv6 error's quoted packet's source */
	__be32 in_daddr[4]; /* be: and destination */
	__u8 hop_limit;
	__u8 pad[3];
	__be32 frag_id;    /* be: a fragment's identification (its fragment header), the key its
			    * datagram's pieces are found by (ekp_frag6.h) */
};

/* Bytes of the frame at `off`: the skb's, or the XDP buffer's (`xdp`, a compile-time constant). */
static __always_inline long ekp_load6(void *ctx, __u8 xdp, __u32 off, void *to, __u32 len)
{
	if (xdp)
		return bpf_xdp_load_bytes(ctx, off, to, len);
	return bpf_skb_load_bytes(ctx, off, to, len);
}

/* The frame's `len` bytes at `off` (both constants at each call) in the linear data: a pointer to
 * them, or NULL when they are not there (paged data, a short frame: the caller reads them with
 * ekp_load6, which costs a helper call; see the top). */
static __always_inline const void *ekp_at6(void *ctx, __u8 xdp, __u32 off, __u32 len)
{
	void *data, *data_end;

	if (xdp) {
		data = (void *)(long)((struct xdp_md *)ctx)->data;
		data_end = (void *)(long)((struct xdp_md *)ctx)->data_end;
	} else {
		data = (void *)(long)((struct __sk_buff *)ctx)->data;
		data_end = (void *)(long)((struct __sk_buff *)ctx)->data_end;
	}
	if (data + off + len > data_end)
		return NULL;
	return data + off;
}

static __always_inline int ekp_addr6_eq(const __be32 *a, const __be32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/* One extension header at `*off`: the next header and its length (a fragment header: the kind of
 * fragment into *frag, its identification into *id). 0, or -1 when not walkable. */
static __always_inline int ekp_parse6_ext(void *ctx, __u8 xdp, __u32 *off, __u8 *nh, __u8 *frag, __be32 *id)
{
	__u8 hdr[8];

	if (ekp_load6(ctx, xdp, *off, hdr, sizeof(hdr)) < 0)
		return -1;
	if (*nh == EKP_NH_FRAGMENT) {
		__u16 fo = ((__u16)hdr[2] << 8) | hdr[3];
		if (fo & 0xfff8)
			*frag = EKP_FRAG_LATER;
		else if (fo & 1)
			*frag = EKP_FRAG_FIRST;
		__builtin_memcpy(id, hdr + 4, 4);
		*nh = hdr[0];
		*off += 8;
		return 0;
	}
	if (*nh == EKP_NH_ROUTING && hdr[3] != 0)
		return -1; /* segments left: the destination is not the final one */
	__u32 len = *nh == EKP_NH_AH ? ((__u32)hdr[1] + 2) * 4 : ((__u32)hdr[1] + 1) * 8;
	*nh = hdr[0];
	*off += len;
	return 0;
}

static __always_inline int ekp_is_ext6(__u8 nh)
{
	return nh == EKP_NH_HOP || nh == EKP_NH_ROUTING || nh == EKP_NH_FRAGMENT || nh == EKP_NH_AH ||
	       nh == EKP_NH_DSTOPTS;
}

/* Walks the extension headers from `*off` (next header `*nh`) toward the transport header: at
 * most EKP_IPV6_EXT_MAX of them, so *nh may still be one after it (then not ours). It stops at a
 * fragment header (not an atomic one): what follows a later fragment's is payload, not a header,
 * and a first fragment's next header is then the one every piece of its datagram carries (so a
 * datagram with headers after its fragment header, destination options in RFC 8200's order, is
 * the stack's whole, all its pieces, and the first fragment's record is keyed by what the later
 * ones see). Linux's own fragmentation puts a socket's IPV6_DSTOPTS before the fragment header
 * (ip6_find_1stfragopt; after it only behind a routing header): walked, translated as any.
 * 0, or -1 when a header is not walkable. */
static __always_inline int ekp_parse6_walk(void *ctx, __u8 xdp, __u32 *off, __u8 *nh, __u8 *frag, __be32 *id)
{
#pragma unroll
	for (int i = 0; i < EKP_IPV6_EXT_MAX; i++) {
		if (!ekp_is_ext6(*nh) || *frag != EKP_FRAG_NONE)
			break;
		if (ekp_parse6_ext(ctx, xdp, off, nh, frag, id) < 0)
			return -1;
	}
	return 0;
}

/* The quote of an ICMPv6 error, its IPv6 header at `inner`: EKP_PARSE_ICMP_ERR when it is the
 * start of a TCP, UDP or SCTP packet with its ports, else EKP_PARSE_PASS. */
static __always_inline int ekp_parse6_quote(void *ctx, __u8 xdp, struct ekp_pkt6 *p, __u32 inner)
{
	struct ipv6hdr ip;
	__u8 frag = EKP_FRAG_NONE;
	__be32 id = 0;
	__u8 csum_word[4];

	if (ekp_load6(ctx, xdp, inner, &ip, sizeof(ip)) < 0 || ip.version != 6)
		return EKP_PARSE_PASS; /* a quote too short to be about a flow */
	__u8 nh = ip.nexthdr;
	__u32 off = inner + sizeof(ip);
	if (ekp_parse6_walk(ctx, xdp, &off, &nh, &frag, &id) < 0 || frag == EKP_FRAG_LATER ||
	    (nh != IPPROTO_TCP && nh != IPPROTO_UDP && nh != IPPROTO_SCTP))
		return EKP_PARSE_PASS;
	/* RFC 4443 quotes as much as fits in 1280 bytes; the ports and, for the checksum, the first 8
	 * bytes (RFC 792's minimum, what IPv4's parser asks) must be there */
	__u8 l4[8];
	if (ekp_load6(ctx, xdp, off, l4, sizeof(l4)) < 0)
		return EKP_PARSE_PASS;
	__builtin_memcpy(p->in_saddr, &ip.saddr, 16);
	__builtin_memcpy(p->in_daddr, &ip.daddr, 16);
	__builtin_memcpy(&p->b.in_sport, l4, 2);
	__builtin_memcpy(&p->b.in_dport, l4 + 2, 2);
	p->b.in_proto = nh;
	p->b.in_off = inner;
	p->b.in_l4_off = off;
	p->b.in_l4_len = 8;
	if (nh == IPPROTO_TCP && ekp_load6(ctx, xdp, off + 16, csum_word, sizeof(csum_word)) == 0)
		p->b.in_l4_len = EKP_INNER_TCP_LEN; /* its checksum is quoted: it follows the tuple */
	return EKP_PARSE_ICMP_ERR;
}

/* EKP_PARSE_OK (TCP/UDP/SCTP, a whole datagram or a first fragment: tuple valid; SCTP whole
 * alone), EKP_PARSE_LATER (a later fragment), EKP_PARSE_ICMP_ERR (an ICMPv6 error quoting
 * TCP/UDP/SCTP: see the top), EKP_PARSE_PASS (not IPv6 TCP/UDP/SCTP, an SCTP fragment: other
 * ICMPv6, neighbour discovery, others) or EKP_PARSE_MALFORMED (truncated). */
static __always_inline int ekp_parse6_frame(void *ctx, __u8 xdp, struct ekp_pkt6 *p)
{
	struct ipv6hdr ip;

	const struct ipv6hdr *h = ekp_at6(ctx, xdp, EKP_IP6_OFF, sizeof(ip));
	if (h)
		ip = *h; /* word loads, as IPv4's parse reads its header (a memcpy from a void * is bytewise) */
	else if (ekp_load6(ctx, xdp, EKP_IP6_OFF, &ip, sizeof(ip)) < 0)
		return EKP_PARSE_MALFORMED;
	if (ip.version != 6)
		return EKP_PARSE_MALFORMED;
	__builtin_memcpy(p->saddr, &ip.saddr, 16);
	__builtin_memcpy(p->daddr, &ip.daddr, 16);
	p->hop_limit = ip.hop_limit;
	p->b.tos = (ip.priority << 4) | (ip.flow_lbl[0] >> 4);

	__u8 nh = ip.nexthdr;
	__u32 off = EKP_IP6_OFF + sizeof(ip);
	if (ekp_parse6_walk(ctx, xdp, &off, &nh, &p->b.frag, &p->frag_id) < 0)
		return EKP_PARSE_PASS;
	if (nh == EKP_NH_ICMPV6 && p->b.frag == EKP_FRAG_NONE) {
		__u8 icmp[2];
		if (ekp_load6(ctx, xdp, off, icmp, sizeof(icmp)) < 0)
			return EKP_PARSE_MALFORMED;
		if (icmp[0] < EKP_ICMPV6_DEST_UNREACH || icmp[0] > EKP_ICMPV6_PARAMPROB)
			return EKP_PARSE_PASS; /* informational (echo, neighbour discovery) or unknown */
		p->b.proto = nh;
		p->b.l4_off = off;
		p->b.icmp_type = icmp[0];
		p->b.icmp_code = icmp[1];
		return ekp_parse6_quote(ctx, xdp, p, off + 8); /* the quote follows the 8-byte ICMPv6 header */
	}
	if (nh != IPPROTO_TCP && nh != IPPROTO_UDP && nh != IPPROTO_SCTP)
		return EKP_PARSE_PASS; /* more headers than we walk, a piece of ICMPv6, others */
	if (nh == IPPROTO_SCTP && p->b.frag != EKP_FRAG_NONE)
		return EKP_PARSE_PASS; /* its checksum cannot follow a translation (ekp_sctp.h) */
	p->b.proto = nh;
	p->b.l4_off = off;
	if (p->b.frag == EKP_FRAG_LATER)
		return EKP_PARSE_LATER;

	/* Read straight from the frame when no extension header came first (a constant offset) and
	 * 14 bytes are there (a short UDP datagram's 8 are read by the helper) */
	__u8 l4[14];
	const void *l4d = off == EKP_IP6_OFF + sizeof(ip) ? ekp_at6(ctx, xdp, EKP_IP6_OFF + sizeof(ip), sizeof(l4)) : NULL;
	if (l4d)
		__builtin_memcpy(l4, __builtin_assume_aligned(l4d, 2), sizeof(l4)); /* halfwords, as a header's */
	else if (ekp_load6(ctx, xdp, off, l4, nh == IPPROTO_UDP ? 8 : nh == IPPROTO_TCP ? 14 : EKP_SCTP_HDR_LEN + 1) < 0)
		return EKP_PARSE_MALFORMED;
	__builtin_memcpy(&p->b.sport, l4, 2);
	__builtin_memcpy(&p->b.dport, l4 + 2, 2);
	if (nh == IPPROTO_TCP)
		p->b.tcp_flags = l4[13];
	if (nh == IPPROTO_SCTP) {
		/* the CRC update's length (ekp_sctp.h): the SCTP header to the end of the IPv6 packet */
		__u32 end = EKP_IP6_OFF + sizeof(ip) + ntohs(ip.payload_len);
		if (end < off + EKP_SCTP_HDR_LEN + 1)
			return EKP_PARSE_MALFORMED;
		p->b.l4_len = end - off;
		p->b.chunk = l4[EKP_SCTP_HDR_LEN];
	}
	return EKP_PARSE_OK;
}

static __always_inline int ekp_parse6(struct __sk_buff *skb, struct ekp_pkt6 *p)
{
	if (skb->protocol != htons(ETH_P_IPV6))
		return EKP_PARSE_PASS;
	p->b.l2_group = skb->pkt_type == PACKET_BROADCAST || skb->pkt_type == PACKET_MULTICAST;
	return ekp_parse6_frame(skb, 0, p);
}

/* The XDP buffer's frame (ekp_xdp6.h; ekp_xdp_net tail-calls only IPv6 frames here). No pkt_type
 * before the stack: XDP answers nothing (its rejects and errors go to tc), as IPv4's. */
static __always_inline int ekp_parse6_xdp(struct xdp_md *ctx, struct ekp_pkt6 *p)
{
	p->b.l2_group = 0;
	return ekp_parse6_frame(ctx, 1, p);
}

#endif /* EKP_PARSE6_H */
