/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_nat.h: rewriting IPv4 addresses and L4 ports with incremental checksum updates.
 *
 * Addresses: bpf_l3_csum_replace on the IP header checksum, and bpf_l4_csum_replace with
 * BPF_F_PSEUDO_HDR on the TCP/UDP checksum (the address is part of the pseudo header).
 * Ports: bpf_l4_csum_replace without the pseudo-header flag. UDP adds BPF_F_MARK_MANGLED_0:
 * a zero UDP checksum ("none") stays zero, and a result of zero is written as 0xffff.
 * These helpers also keep CHECKSUM_PARTIAL (veth) and CHECKSUM_COMPLETE skbs consistent.
 *
 * A later fragment has no L4 header: only its addresses and the IP checksum change (the
 * datagram's L4 checksum, which covers the pseudo header, is fixed in its first fragment).
 *
 * SCTP's CRC32c covers no pseudo header and is no one's-complement sum: addresses change with the
 * IP checksum alone, and a port change updates the CRC by its own arithmetic (ekp_sctp.h), the
 * stores recomputing a CHECKSUM_COMPLETE skb->csum.
 *
 * An ICMP error about a translated flow changes its quote (the packet it is about) as well:
 * the quoted IP header and L4 ports and checksum are plain payload of the ICMP message, so they
 * are rewritten with stores and explicit one's-complement arithmetic (ekp_csum_apply), and the
 * ICMP checksum absorbs every byte changed in its message. Every change is compensated inside
 * the same checksummed region, so a CHECKSUM_COMPLETE skb->csum stays right without being told.
 * The quoted L4 header's part (ekp_rewrite_quote_l4) and the ICMP checksum's are the same for an
 * ICMPv6 error, whose quote differs only in its addresses' width: ekp_nat6.h calls them.
 *
 * All writes go through skb offsets; callers pass the new tuple from the decision.
 */
#ifndef EKP_NAT_H
#define EKP_NAT_H

#include "ekp_parse.h"
#include "ekp_sctp.h"

#define EKP_IP_CSUM_OFF (EKP_IP_OFF + __builtin_offsetof(struct iphdr, check))
#define EKP_IP_SADDR_OFF (EKP_IP_OFF + __builtin_offsetof(struct iphdr, saddr))
#define EKP_IP_DADDR_OFF (EKP_IP_OFF + __builtin_offsetof(struct iphdr, daddr))
#define EKP_IP_TTL_OFF (EKP_IP_OFF + __builtin_offsetof(struct iphdr, ttl))

static __always_inline __u32 ekp_l4_csum_off(const struct ekp_pkt *p)
{
	return p->l4_off + (p->proto == IPPROTO_TCP ? __builtin_offsetof(struct tcphdr, check)
						    : __builtin_offsetof(struct udphdr, check));
}

static __always_inline __u64 ekp_l4_csum_flags(const struct ekp_pkt *p)
{
	return p->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* One's complement fold of a bpf_csum_diff() result, complemented: a checksum field value. */
static __always_inline __u16 ekp_csum_fold(__s64 sum)
{
	__u32 s = (__u32)sum;

	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

/* A checksum field (as stored) after the data it covers changed by `diff` (bpf_csum_diff of
 * old -> new): the kernel's csum_replace_by_diff. */
static __always_inline __u16 ekp_csum_apply(__u16 check, __u32 diff)
{
	__u64 s = (__u64)(__u16)~check + diff;

	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	s = (s & 0xffff) + (s >> 16);
	return (__u16)~s;
}

/* Replaces the address at `off` (EKP_IP_SADDR_OFF / EKP_IP_DADDR_OFF); `l4` = 0 for a later
 * fragment (no L4 checksum to fix). 0 or -1. */
static __always_inline int ekp_set_addr(struct __sk_buff *skb, const struct ekp_pkt *p, __u32 off,
					__be32 old, __be32 new, int l4)
{
	if (old == new)
		return 0;
	if (l4 && bpf_l4_csum_replace(skb, ekp_l4_csum_off(p), old, new,
				      ekp_l4_csum_flags(p) | BPF_F_PSEUDO_HDR | sizeof(new)) < 0)
		return -1;
	if (bpf_l3_csum_replace(skb, EKP_IP_CSUM_OFF, old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, &new, sizeof(new), 0) < 0 ? -1 : 0;
}

/* Replaces the L4 port at `port_off` (0 = source, 2 = destination in both TCP and UDP). */
static __always_inline int ekp_set_port(struct __sk_buff *skb, const struct ekp_pkt *p, __u32 port_off,
					__be16 old, __be16 new)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, ekp_l4_csum_off(p), old, new, ekp_l4_csum_flags(p) | sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, p->l4_off + port_off, &new, sizeof(new), 0) < 0 ? -1 : 0;
}

/* Replaces both ports of an SCTP packet and updates its CRC32c for them (ekp_sctp.h). */
static __always_inline int ekp_set_sctp_ports(struct __sk_buff *skb, const struct ekp_pkt *p, __be16 sport,
					      __be16 dport)
{
	/* the four port bytes in wire order, as the little-endian word the CRC arithmetic takes */
	__u32 old_ports = (__u32)p->sport | ((__u32)p->dport << 16);
	__u32 new_ports = (__u32)sport | ((__u32)dport << 16);
	__u32 csum;

	if (old_ports == new_ports)
		return 0;
	if (bpf_skb_load_bytes(skb, p->l4_off + EKP_SCTP_CSUM_OFF, &csum, sizeof(csum)) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, p->l4_off, &new_ports, sizeof(new_ports), BPF_F_RECOMPUTE_CSUM) < 0)
		return -1;
	/* 0: a local socket's packet whose CRC is left to the device (ekp_sctp.h): the kernel's
	 * software fallback computes it over the field as it stands, so the field must stay 0. */
	if (!csum)
		return 0;
	csum ^= ekp_sctp_csum_delta(old_ports, new_ports, p->l4_len);
	if (bpf_skb_store_bytes(skb, p->l4_off + EKP_SCTP_CSUM_OFF, &csum, sizeof(csum), BPF_F_RECOMPUTE_CSUM) < 0)
		return -1;
	return 0;
}

/* Rewrites a TCP/UDP/SCTP packet (or fragment) to the tuple saddr:sport -> daddr:dport. 0 or -1. */
static __always_inline int ekp_rewrite(struct __sk_buff *skb, const struct ekp_pkt *p, __be32 saddr,
				       __be16 sport, __be32 daddr, __be16 dport)
{
	int sctp = p->proto == IPPROTO_SCTP;
	int l4 = p->frag != EKP_FRAG_LATER && !sctp; /* an L4 checksum over a pseudo header */

	if (ekp_set_addr(skb, p, EKP_IP_SADDR_OFF, p->saddr, saddr, l4) < 0 ||
	    ekp_set_addr(skb, p, EKP_IP_DADDR_OFF, p->daddr, daddr, l4) < 0)
		return -1;
	if (sctp)
		return ekp_set_sctp_ports(skb, p, sport, dport);
	if (!l4)
		return 0;
	if (ekp_set_port(skb, p, __builtin_offsetof(struct udphdr, source), p->sport, sport) < 0 ||
	    ekp_set_port(skb, p, __builtin_offsetof(struct udphdr, dest), p->dport, dport) < 0)
		return -1;
	return 0;
}

/* Decrements the TTL as a router does (the caller checked ttl > 1). */
static __always_inline int ekp_dec_ttl(struct __sk_buff *skb, const struct ekp_pkt *p)
{
	/* The TTL shares a 16-bit checksum word with the protocol byte. */
	__be16 old = htons(((__u16)p->ttl << 8) | p->proto);
	__be16 new = htons(((__u16)(p->ttl - 1) << 8) | p->proto);
	__u8 ttl = p->ttl - 1;

	if (bpf_l3_csum_replace(skb, EKP_IP_CSUM_OFF, old, new, sizeof(new)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, EKP_IP_TTL_OFF, &ttl, sizeof(ttl), 0) < 0 ? -1 : 0;
}

/* ---- ICMP errors: the quote ------------------------------------------------------------ */

/* Bytes 8..19 of an IPv4 header: ttl, protocol, checksum, source, destination. */
struct ekp_ip_tail {
	__u8 ttl;
	__u8 proto;
	__u16 check;
	__be32 saddr;
	__be32 daddr;
};

/* The first 8 bytes of a UDP header, and the two 4-byte words of a TCP header we touch. */
struct ekp_l4_head {
	__be16 sport;
	__be16 dport;
	__u16 w1; /* UDP: length; TCP: first half of the sequence number (untouched) */
	__u16 w2; /* UDP: checksum; TCP: second half of the sequence number (untouched) */
};

struct ekp_tcp_csum_word {
	__u16 check; /* TCP checksum (bytes 16-17) */
	__u16 urg;   /* urgent pointer (untouched) */
};

/* One's complement sum of two bpf_csum_diff() results (the kernel's csum_add). */
static __always_inline __u32 ekp_csum_add(__u32 a, __u32 b)
{
	__u32 s = a + b;

	return s + (s < a);
}

/* The quoted L4 header of an ICMP or ICMPv6 error, either family: its ports become in_sport and
 * in_dport, its checksum follows them and `addr_diff` (the quoted addresses' change, the pseudo
 * header's: 4 or 16 bytes each, the width is the caller's) when the quote holds it (UDP's when
 * set, TCP's when the quote reaches byte 18). Every byte changed is added to *icmp_diff, for the
 * ICMP checksum that covers the quote. Adjusted, never recomputed: the quote may end anywhere
 * after its first 8 bytes, as nf_nat's l4proto manip does it. 0 or -1. */
static __always_inline int ekp_rewrite_quote_l4(struct __sk_buff *skb, const struct ekp_pkt *p, __u32 addr_diff,
						__be16 in_sport, __be16 in_dport, __u32 *icmp_diff)
{
	struct ekp_l4_head l4_old, l4_new;
	__u32 l4_diff;

	if (bpf_skb_load_bytes(skb, p->in_l4_off, &l4_old, sizeof(l4_old)) < 0)
		return -1;
	l4_new = l4_old;
	l4_new.sport = in_sport;
	l4_new.dport = in_dport;
	__s64 d = bpf_csum_diff((void *)&l4_old, 4, (void *)&l4_new, 4, addr_diff);
	if (d < 0)
		return -1;
	l4_diff = (__u32)d;
	if (p->in_proto == IPPROTO_UDP && l4_old.w2) {
		l4_new.w2 = ekp_csum_apply(l4_old.w2, l4_diff);
		if (!l4_new.w2)
			l4_new.w2 = 0xffff; /* 0 means "no checksum" in UDP */
	}
	d = bpf_csum_diff((void *)&l4_old, sizeof(l4_old), (void *)&l4_new, sizeof(l4_new), *icmp_diff);
	if (d < 0)
		return -1;
	*icmp_diff = (__u32)d;
	if (p->in_proto == IPPROTO_TCP && p->in_l4_len >= EKP_INNER_TCP_LEN) {
		struct ekp_tcp_csum_word c_old, c_new;
		if (bpf_skb_load_bytes(skb, p->in_l4_off + 16, &c_old, sizeof(c_old)) < 0)
			return -1;
		c_new = c_old;
		c_new.check = ekp_csum_apply(c_old.check, l4_diff);
		d = bpf_csum_diff((void *)&c_old, sizeof(c_old), (void *)&c_new, sizeof(c_new), *icmp_diff);
		if (d < 0)
			return -1;
		*icmp_diff = (__u32)d;
		if (bpf_skb_store_bytes(skb, p->in_l4_off + 16, &c_new, sizeof(c_new), 0) < 0)
			return -1;
	}
	return bpf_skb_store_bytes(skb, p->in_l4_off, &l4_new, sizeof(l4_new), 0) < 0 ? -1 : 0;
}

/* The ICMP (or ICMPv6) checksum at `off` after its message (and, for ICMPv6, pseudo header)
 * changed by `diff`. 0 or -1. */
static __always_inline int ekp_icmp_csum_adjust(struct __sk_buff *skb, __u32 off, __u32 diff)
{
	__u16 check;

	if (bpf_skb_load_bytes(skb, off, &check, sizeof(check)) < 0)
		return -1;
	check = ekp_csum_apply(check, diff);
	return bpf_skb_store_bytes(skb, off, &check, sizeof(check), 0) < 0 ? -1 : 0;
}

/* Rewrites an ICMP error: outer addresses, and the quote's addresses and ports (with the quoted
 * IP checksum, the quoted UDP/TCP checksum when it is in the quote, and the ICMP checksum).
 * `in_*` is the quoted tuple after translation. 0 or -1. */
static __always_inline int ekp_rewrite_icmp_err(struct __sk_buff *skb, const struct ekp_pkt *p, __be32 saddr,
						__be32 daddr, __be32 in_saddr, __be16 in_sport, __be32 in_daddr,
						__be16 in_dport)
{
	struct ekp_ip_tail ip_old, ip_new;
	__u32 icmp_diff = 0;

	/* Outer header: addresses and the IP checksum (ICMP has no pseudo header). */
	if (ekp_set_addr(skb, p, EKP_IP_SADDR_OFF, p->saddr, saddr, 0) < 0 ||
	    ekp_set_addr(skb, p, EKP_IP_DADDR_OFF, p->daddr, daddr, 0) < 0)
		return -1;

	/* Quoted IP header. */
	if (bpf_skb_load_bytes(skb, p->in_off + 8, &ip_old, sizeof(ip_old)) < 0)
		return -1;
	ip_new = ip_old;
	ip_new.saddr = in_saddr;
	ip_new.daddr = in_daddr;
	__s64 addr_diff = bpf_csum_diff(&ip_old.saddr, 8, &ip_new.saddr, 8, 0);
	if (addr_diff < 0)
		return -1;
	ip_new.check = ekp_csum_apply(ip_old.check, (__u32)addr_diff);
	__s64 d = bpf_csum_diff((void *)&ip_old, sizeof(ip_old), (void *)&ip_new, sizeof(ip_new), 0);
	if (d < 0)
		return -1;
	icmp_diff = (__u32)d;

	/* Quoted L4 header: ports, and the checksum the pseudo header and ports feed. */
	if (ekp_rewrite_quote_l4(skb, p, (__u32)addr_diff, in_sport, in_dport, &icmp_diff) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, p->in_off + 8, &ip_new, sizeof(ip_new), 0) < 0)
		return -1;

	/* The ICMP checksum covers the whole message, quote included. */
	return ekp_icmp_csum_adjust(skb, p->l4_off + __builtin_offsetof(struct icmphdr, checksum), icmp_diff);
}

#endif /* EKP_NAT_H */
