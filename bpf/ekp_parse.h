/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_parse.h: Ethernet / IPv4 / TCP-UDP parsing into a small value (struct ekp_pkt).
 *
 * The result holds copies and offsets, never packet pointers: every helper that writes the packet
 * (csum, store_bytes, pull) invalidates pointers, so later stages work with skb offsets.
 * One bounds check per header advance (Katran's habit); a packet whose headers are not in the
 * linear part is pulled once, up to the largest header stack we read.
 */
#ifndef EKP_PARSE_H
#define EKP_PARSE_H

#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>

#define EKP_IP_OFF ETH_HLEN
#define EKP_IP_MF 0x2000     /* host order: more fragments */
#define EKP_IP_OFFSET 0x1fff /* host order: fragment offset mask */

#define EKP_TCP_FIN 0x01 /* byte 13 of the TCP header */
#define EKP_TCP_SYN 0x02
#define EKP_TCP_RST 0x04
#define EKP_TCP_ACK 0x10

/* Ethernet + the longest IPv4 header + a TCP header without options: all we ever read. */
#define EKP_PULL_LEN (ETH_HLEN + 60 + sizeof(struct tcphdr))

enum ekp_parse_result {
	EKP_PARSE_OK = 0,    /* IPv4 TCP/UDP, not a fragment: tuple valid */
	EKP_PARSE_FRAG,      /* first fragment of a TCP/UDP datagram: tuple valid, not translated */
	EKP_PARSE_PASS,      /* not ours: not IPv4, not TCP/UDP, or a non-first fragment */
	EKP_PARSE_MALFORMED, /* IPv4 TCP/UDP with truncated or invalid headers */
};

struct ekp_pkt {
	__u32 l4_off;   /* offset of the TCP/UDP header from the start of the frame */
	__be32 saddr;   /* be */
	__be32 daddr;   /* be */
	__be16 sport;   /* be */
	__be16 dport;   /* be */
	__u8 proto;     /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 ttl;
	__u8 tos;
	__u8 tcp_flags; /* byte 13 of the TCP header (EKP_TCP_*); 0 for UDP */
};

static __always_inline int ekp_parse(struct __sk_buff *skb, struct ekp_pkt *p)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	__u32 linear = data_end - data;

	/* Headers may sit in paged data (GRO, some drivers): make the ones we read linear. */
	if (linear < EKP_PULL_LEN && skb->len > linear) {
		bpf_skb_pull_data(skb, skb->len < EKP_PULL_LEN ? skb->len : EKP_PULL_LEN);
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
	}

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end)
		return EKP_PARSE_PASS;
	if (eth->h_proto != htons(ETH_P_IP))
		return EKP_PARSE_PASS;

	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end)
		return EKP_PARSE_MALFORMED;
	if (ip->protocol != IPPROTO_TCP && ip->protocol != IPPROTO_UDP)
		return EKP_PARSE_PASS;
	__u32 ihl = ip->ihl * 4;
	if (ip->version != 4 || ihl < sizeof(struct iphdr))
		return EKP_PARSE_MALFORMED;

	__u16 frag = ntohs(ip->frag_off);
	if (frag & EKP_IP_OFFSET)
		return EKP_PARSE_PASS; /* no L4 header to match on */

	p->l4_off = EKP_IP_OFF + ihl;
	p->saddr = ip->saddr;
	p->daddr = ip->daddr;
	p->proto = ip->protocol;
	p->ttl = ip->ttl;
	p->tos = ip->tos;

	void *l4 = (void *)ip + ihl;
	if (p->proto == IPPROTO_TCP) {
		struct tcphdr *tcp = l4;
		if ((void *)(tcp + 1) > data_end)
			return EKP_PARSE_MALFORMED;
		p->sport = tcp->source;
		p->dport = tcp->dest;
		p->tcp_flags = ((__u8 *)tcp)[13];
	} else {
		struct udphdr *udp = l4;
		if ((void *)(udp + 1) > data_end)
			return EKP_PARSE_MALFORMED;
		p->sport = udp->source;
		p->dport = udp->dest;
		p->tcp_flags = 0;
	}
	return (frag & EKP_IP_MF) ? EKP_PARSE_FRAG : EKP_PARSE_OK;
}

#endif /* EKP_PARSE_H */
