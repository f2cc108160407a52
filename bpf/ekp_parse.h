/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_parse.h: Ethernet / IPv4 / TCP-UDP (and ICMP errors) parsing into a small value
 * (struct ekp_pkt), the only input of the decision (ekp_decide.h).
 *
 * The result holds copies and offsets, never packet pointers: every helper that writes the packet
 * (csum, store_bytes, pull) invalidates pointers, so later stages work with skb offsets.
 * One bounds check per header advance (Katran's habit); a packet whose headers are not in the
 * linear part is pulled, to the end of the headers it has (ekp_pull), never further.
 *
 * What is ours: IPv4 TCP and UDP, including fragments (the first carries the ports; the later
 * ones get them from ekp_frag, see ekp_frag.h), SCTP without fragments (ekp_sctp.h says why), and
 * ICMP errors (destination unreachable, time exceeded, parameter problem) that quote a TCP, UDP
 * or SCTP packet: those may be about a translated flow. Everything else (ARP, IPv6, ICMP echo,
 * other protocols, SCTP fragments) is PASS before any map lookup. IPv6 must reach the stack
 * untouched: until the data path has an IPv6 path, eBPF mode serves IPv6 Services with the
 * node's ip6tables rules (agent/metaproxier.py).
 */
#ifndef EKP_PARSE_H
#define EKP_PARSE_H

#include <linux/icmp.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>

#include "ekp_sctp.h"

#define EKP_IP_OFF ETH_HLEN
#define EKP_IP_DF 0x4000     /* host order: don't fragment */
#define EKP_IP_MF 0x2000     /* host order: more fragments */
#define EKP_IP_OFFSET 0x1fff /* host order: fragment offset mask */

#define EKP_TCP_FIN 0x01 /* byte 13 of the TCP header */
#define EKP_TCP_SYN 0x02
#define EKP_TCP_RST 0x04
#define EKP_TCP_ACK 0x10

/* The quoted TCP header bytes we read from an ICMP error: the ports, and the checksum when the
 * quote is long enough (bytes 16-17). */
#define EKP_INNER_TCP_LEN 20


enum ekp_parse_result {
	EKP_PARSE_OK = 0,    /* IPv4 TCP/UDP, a whole datagram or its first fragment: tuple valid */
	EKP_PARSE_LATER,     /* a later fragment of a TCP/UDP datagram: no ports (ekp_frag has them) */
	EKP_PARSE_ICMP_ERR,  /* an ICMP error quoting a TCP/UDP packet: outer addresses and quote valid */
	EKP_PARSE_PASS,      /* not ours: not IPv4, not TCP/UDP/ICMP error */
	EKP_PARSE_MALFORMED, /* IPv4 TCP/UDP/ICMP with truncated or invalid headers */
};

enum ekp_frag_kind {
	EKP_FRAG_NONE = 0,  /* a whole datagram */
	EKP_FRAG_FIRST = 1, /* offset 0, more fragments follow: carries the L4 header */
	EKP_FRAG_LATER = 2, /* offset > 0: payload only */
};

struct ekp_pkt {
	__u32 l4_off;     /* offset of the TCP/UDP/ICMP header (a later fragment: of its payload) */
	__be32 saddr;     /* be */
	__be32 daddr;     /* be */
	__be16 sport;     /* be; a later fragment: from ekp_frag */
	__be16 dport;     /* be */
	__be16 ip_id;     /* be: IPv4 identification (fragments) */
	__u8 proto;       /* IPPROTO_TCP / IPPROTO_UDP / IPPROTO_ICMP */
	__u8 ttl;
	__u8 tos;
	__u8 tcp_flags;   /* byte 13 of the TCP header (EKP_TCP_*); 0 for UDP and later fragments */
	__u8 frag;        /* enum ekp_frag_kind */
	__u8 df;          /* 1 when DF is set */
	__u8 icmp_type;   /* ICMP errors: type and code */
	__u8 icmp_code;
	__u8 chunk;       /* SCTP: the type of the packet's first chunk (EKP_SCTP_CID_INIT starts a flow) */
	__u8 l2_group;    /* 1: a frame to a link-layer broadcast or multicast address (never answered) */
	__u16 l4_len;     /* SCTP: bytes from the SCTP header to the end of the IP packet */
	/* An ICMP error's quote: the packet it is about, as it was sent (after our translation when
	 * it is about a translated flow). */
	__u8 in_proto;    /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 in_l4_len;   /* quoted L4 bytes we may read and rewrite: 8, or EKP_INNER_TCP_LEN */
	__u32 in_off;     /* offset of the quoted IPv4 header */
	__u32 in_l4_off;  /* offset of the quoted L4 header */
	__be32 in_saddr;  /* be */
	__be32 in_daddr;  /* be */
	__be16 in_sport;  /* be */
	__be16 in_dport;  /* be */
};

static __always_inline int ekp_icmp_is_error(__u8 type)
{
	return type == ICMP_DEST_UNREACH || type == ICMP_TIME_EXCEEDED || type == ICMP_PARAMETERPROB;
}

/* The quote of an ICMP error starting at `inner` (`l4` is the ICMP header). PASS when it is not
 * about a TCP/UDP packet we could have translated. */
static __always_inline int ekp_parse_quote(struct ekp_pkt *p, void *data, void *data_end, void *inner)
{
	struct iphdr *ip = inner;

	if ((void *)(ip + 1) > data_end)
		return EKP_PARSE_PASS; /* a quote too short to be about a flow of ours */
	if (ip->version != 4 ||
	    (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP && ip->protocol != IPPROTO_SCTP))
		return EKP_PARSE_PASS;
	if (ntohs(ip->frag_off) & EKP_IP_OFFSET)
		return EKP_PARSE_PASS; /* a later fragment: no ports quoted */
	__u32 ihl = ip->ihl * 4;
	if (ihl < sizeof(struct iphdr) || ihl > 60)
		return EKP_PARSE_PASS;
	__u8 *l4 = (void *)ip + ihl;
	if ((void *)(l4 + 8) > data_end)
		return EKP_PARSE_PASS; /* RFC 792 quotes 8 bytes: anything shorter is not usable */
	p->in_off = (void *)ip - data;
	p->in_l4_off = (void *)l4 - data;
	p->in_proto = ip->protocol;
	p->in_saddr = ip->saddr;
	p->in_daddr = ip->daddr;
	p->in_sport = *(__be16 *)l4;
	p->in_dport = *(__be16 *)(l4 + 2);
	p->in_l4_len = 8;
	if (ip->protocol == IPPROTO_TCP && (void *)(l4 + EKP_INNER_TCP_LEN) <= data_end)
		p->in_l4_len = EKP_INNER_TCP_LEN;
	return EKP_PARSE_ICMP_ERR;
}

/* The frame from its Ethernet header, whatever hook holds it (a tc skb's linear part, an XDP
 * buffer): one parser for both. */
static __always_inline int ekp_parse_frame(void *data, void *data_end, struct ekp_pkt *p)
{
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		return EKP_PARSE_PASS;
	if (eth->h_proto != htons(ETH_P_IP))
		return EKP_PARSE_PASS;

	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return EKP_PARSE_MALFORMED;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP && ip->protocol != IPPROTO_ICMP &&
	    ip->protocol != IPPROTO_SCTP)
		return EKP_PARSE_PASS;
	__u32 ihl = ip->ihl * 4;
	if (ip->version != 4 || ihl < sizeof(struct iphdr) || ihl > 60)
		return EKP_PARSE_MALFORMED;

	__u16 frag = ntohs(ip->frag_off);
	if (ip->protocol == IPPROTO_SCTP && (frag & (EKP_IP_MF | EKP_IP_OFFSET)))
		return EKP_PARSE_PASS; /* its checksum cannot follow a translation (ekp_sctp.h) */
	p->l4_off = EKP_IP_OFF + ihl;
	p->saddr = ip->saddr;
	p->daddr = ip->daddr;
	p->proto = ip->protocol;
	p->ttl = ip->ttl;
	p->tos = ip->tos;
	p->ip_id = ip->id;
	p->df = (frag & EKP_IP_DF) ? 1 : 0;
	p->tcp_flags = 0;
	if (frag & EKP_IP_OFFSET) {
		if (p->proto == IPPROTO_ICMP)
			return EKP_PARSE_PASS; /* a piece of a large ICMP message: the stack's business */
		p->frag = EKP_FRAG_LATER;
		return EKP_PARSE_LATER;
	}
	p->frag = (frag & EKP_IP_MF) ? EKP_FRAG_FIRST : EKP_FRAG_NONE;

	void *l4 = (void *)ip + ihl;
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *tcp = l4;
		if ((void *)(tcp + 1) > data_end)
			return EKP_PARSE_MALFORMED;
		p->sport = tcp->source;
		p->dport = tcp->dest;
		p->tcp_flags = ((__u8 *)tcp)[13];
		return EKP_PARSE_OK;
	}
	if (p->proto == IPPROTO_UDP) {
		struct udphdr *udp = l4;
		if ((void *)(udp + 1) > data_end)
			return EKP_PARSE_MALFORMED;
		p->sport = udp->source;
		p->dport = udp->dest;
		return EKP_PARSE_OK;
	}
	if (p->proto == IPPROTO_SCTP) {
		__u8 *sctp = l4;
		__u32 tot = ntohs(ip->tot_len);
		/* the common header and the first chunk's type */
		if ((void *)(sctp + EKP_SCTP_HDR_LEN + 1) > data_end || tot < ihl + EKP_SCTP_HDR_LEN)
			return EKP_PARSE_MALFORMED;
		p->sport = *(__be16 *)sctp;
		p->dport = *(__be16 *)(sctp + 2);
		p->chunk = sctp[EKP_SCTP_HDR_LEN];
		p->l4_len = tot - ihl;
		return EKP_PARSE_OK;
	}

	struct icmphdr *icmp = l4;
	if ((void *)(icmp + 1) > data_end)
		return EKP_PARSE_MALFORMED;
	if (!ekp_icmp_is_error(icmp->type) || p->frag != EKP_FRAG_NONE)
		return EKP_PARSE_PASS;
	p->icmp_type = icmp->type;
	p->icmp_code = icmp->code;
	return ekp_parse_quote(p, data, data_end, (void *)(icmp + 1));
}

/* The bytes past the IP header the parser reads, by protocol: the L4 header (SCTP: and the first
 * chunk's type), for ICMP the error's quote too. */
static __always_inline __u32 ekp_l4_need(__u8 proto)
{
	if (proto == IPPROTO_TCP)
		return sizeof(struct tcphdr);
	if (proto == IPPROTO_UDP)
		return sizeof(struct udphdr);
	if (proto == IPPROTO_SCTP)
		return EKP_SCTP_HDR_LEN + 1;
	return sizeof(struct icmphdr) + 60 + EKP_INNER_TCP_LEN;
}

/* Makes the first `want` bytes of the frame linear when they are not (headers in paged data: a
 * GRO'd packet, a TSO segment of the node's own stack); a shorter frame keeps what it has. Pulls
 * only what is read: a pull may copy and reallocate the skb's head. */
static __always_inline void ekp_pull(struct __sk_buff *skb, __u32 want)
{
	__u32 linear = (void *)(long)skb->data_end - (void *)(long)skb->data;

	if (linear < want && skb->len > linear)
		bpf_skb_pull_data(skb, skb->len < want ? skb->len : want);
}

static __always_inline int ekp_parse(struct __sk_buff *skb, struct ekp_pkt *p)
{
	/* Headers may sit in paged data (GRO, TSO, some drivers): the IP header first, then as far as
	 * its options and L4 header reach (the pull moves the data: pointers are taken again). */
	ekp_pull(skb, EKP_IP_OFF + sizeof(struct iphdr));
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct iphdr *ip = data + EKP_IP_OFF;
	if ((void *)(ip + 1) <= data_end) {
		ekp_pull(skb, EKP_IP_OFF + ip->ihl * 4 + ekp_l4_need(ip->protocol));
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
	}
	p->l2_group = skb->pkt_type == PACKET_BROADCAST || skb->pkt_type == PACKET_MULTICAST;
	return ekp_parse_frame(data, data_end, p);
}

/* An XDP buffer is linear up to data_end (a multi-buffer frame's first buffer holds its headers). */
static __always_inline int ekp_parse_xdp(struct xdp_md *ctx, struct ekp_pkt *p)
{
	p->l2_group = 0; /* no pkt_type before the stack; XDP answers nothing (its rejects go to tc) */
	return ekp_parse_frame((void *)(long)ctx->data, (void *)(long)ctx->data_end, p);
}

#endif /* EKP_PARSE_H */
