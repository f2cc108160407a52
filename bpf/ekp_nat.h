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
 * All writes go through skb offsets; each successful rewrite updates `p` so later stages
 * (FIB lookup) see the translated tuple.
 */
#ifndef EKP_NAT_H
#define EKP_NAT_H

#include "ekp_parse.h"

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

/* Replaces the address at `off` (EKP_IP_SADDR_OFF / EKP_IP_DADDR_OFF). 0 or a negative error. */
static __always_inline int ekp_set_addr(struct __sk_buff *skb, const struct ekp_pkt *p, __u32 off,
					__be32 old, __be32 new)
{
	if (old == new)
		return 0;
	if (bpf_l4_csum_replace(skb, ekp_l4_csum_off(p), old, new,
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

/* Destination translation (DNAT, or the un-SNAT of a reply). */
static __always_inline int ekp_nat_dst(struct __sk_buff *skb, struct ekp_pkt *p, __be32 addr, __be16 port)
{
	if (ekp_set_addr(skb, p, EKP_IP_DADDR_OFF, p->daddr, addr) < 0 ||
	    ekp_set_port(skb, p, __builtin_offsetof(struct udphdr, dest), p->dport, port) < 0)
		return -1;
	p->daddr = addr;
	p->dport = port;
	return 0;
}

/* Source translation (SNAT, or the reverse NAT of a reply to the frontend). */
static __always_inline int ekp_nat_src(struct __sk_buff *skb, struct ekp_pkt *p, __be32 addr, __be16 port)
{
	if (ekp_set_addr(skb, p, EKP_IP_SADDR_OFF, p->saddr, addr) < 0 ||
	    ekp_set_port(skb, p, __builtin_offsetof(struct udphdr, source), p->sport, port) < 0)
		return -1;
	p->saddr = addr;
	p->sport = port;
	return 0;
}

/* Decrements the TTL as a router does (the caller checked ttl > 1). */
static __always_inline int ekp_dec_ttl(struct __sk_buff *skb, struct ekp_pkt *p)
{
	/* The TTL shares a 16-bit checksum word with the protocol byte. */
	__be16 old = htons(((__u16)p->ttl << 8) | p->proto);
	__be16 new = htons(((__u16)(p->ttl - 1) << 8) | p->proto);
	__u8 ttl = p->ttl - 1;

	if (bpf_l3_csum_replace(skb, EKP_IP_CSUM_OFF, old, new, sizeof(new)) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, EKP_IP_TTL_OFF, &ttl, sizeof(ttl), 0) < 0)
		return -1;
	p->ttl = ttl;
	return 0;
}

#endif /* EKP_NAT_H */
