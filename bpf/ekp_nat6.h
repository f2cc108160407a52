/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_nat6.h: rewriting IPv6 packets for the tc programs' IPv6 path (ekp_tc6.h): a TCP/UDP/SCTP
 * packet's addresses and ports, and an ICMPv6 error about a translated flow, outer header and
 * quote. ekp_nat.h's twin for 16-byte addresses; the ports and the quoted L4 header go through
 * ekp_nat.h's own functions (ekp_set_port, ekp_rewrite_quote_l4), which take any address width's
 * checksum change.
 *
 * IPv6 has no header checksum: an address is balanced only by the checksum whose pseudo header
 * holds it (TCP's, UDP's, ICMPv6's).
 *
 * skb->csum of a CHECKSUM_COMPLETE packet: for a TCP/UDP rewrite, BPF_F_PSEUDO_HDR on the L4
 * checksum takes the address change out of skb->csum, as the checksum field's own change asks,
 * which for IPv4 is all (the IPv4 header's checksum balances its address); here the address is in
 * the data skb->csum covers, so the store puts it back (BPF_F_RECOMPUTE_CSUM: skb->csum minus the
 * old 16 bytes, plus the new ones; a no-op for any other ip_summed). BPF_F_IPV6 on the csum
 * replace does the same by leaving skb->csum alone, but only kernels from mid-2025 know it (older
 * ones refuse the call). An ICMPv6 error is rewritten with plain stores and explicit arithmetic
 * (as IPv4's, ekp_rewrite_icmp_err): its checksum absorbs the outer addresses (pseudo header) and
 * every quoted byte changed, so the packet's sum, which skb->csum is, does not move.
 */
#ifndef EKP_NAT6_H
#define EKP_NAT6_H

#include "ekp_nat.h"
#include "ekp_parse6.h"

/* Replaces the 16-byte address at `off` and fixes the L4 checksum for it (its pseudo header): a
 * later fragment has no L4 header (its datagram's checksum is fixed in the first fragment, which is
 * rewritten as a whole packet), so only the address and skb->csum change. 0 or -1. */
static __always_inline int ekp_set_addr6(struct __sk_buff *skb, const struct ekp_pkt6 *p, __u32 off,
					 const __be32 *old, const __be32 *new)
{
	__s64 diff = bpf_csum_diff((__be32 *)old, 16, (__be32 *)new, 16, 0);

	if (diff < 0)
		return -1;
	if (p->b.frag != EKP_FRAG_LATER &&
	    bpf_l4_csum_replace(skb, ekp_l4_csum_off(&p->b), 0, diff, ekp_l4_csum_flags(&p->b) | BPF_F_PSEUDO_HDR) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, (void *)new, 16, BPF_F_RECOMPUTE_CSUM) < 0 ? -1 : 0;
}

/* Rewrites the packet (or fragment: its addresses alone) to saddr:sport -> daddr:dport. 0 or -1.
 * SCTP's CRC32c covers no pseudo header: its addresses are plain stores, its ports change the CRC
 * by ekp_sctp.h's arithmetic (ekp_set_sctp_ports, IPv4's). */
static __always_inline int ekp_rewrite6(struct __sk_buff *skb, const struct ekp_pkt6 *p, const __be32 *saddr,
					__be16 sport, const __be32 *daddr, __be16 dport)
{
	if (p->b.proto == IPPROTO_SCTP) {
		if (bpf_skb_store_bytes(skb, EKP_IP6_SADDR_OFF, (void *)saddr, 16, BPF_F_RECOMPUTE_CSUM) < 0 ||
		    bpf_skb_store_bytes(skb, EKP_IP6_DADDR_OFF, (void *)daddr, 16, BPF_F_RECOMPUTE_CSUM) < 0)
			return -1;
		return ekp_set_sctp_ports(skb, &p->b, sport, dport);
	}
	if (!ekp_addr6_eq(saddr, p->saddr) && ekp_set_addr6(skb, p, EKP_IP6_SADDR_OFF, p->saddr, saddr) < 0)
		return -1;
	if (!ekp_addr6_eq(daddr, p->daddr) && ekp_set_addr6(skb, p, EKP_IP6_DADDR_OFF, p->daddr, daddr) < 0)
		return -1;
	if (p->b.frag == EKP_FRAG_LATER)
		return 0;
	if (ekp_set_port(skb, &p->b, 0, p->b.sport, sport) < 0 || ekp_set_port(skb, &p->b, 2, p->b.dport, dport) < 0)
		return -1;
	return 0;
}

/* An ICMPv6 error's tuples after translation: its outer addresses, and the packet it quotes. */
struct ekp_icmp6_nat {
	__be32 saddr[4];    /* be */
	__be32 daddr[4];    /* be */
	__be32 in_saddr[4]; /* be */
	__be32 in_daddr[4]; /* be */
	__be16 in_sport;    /* be */
	__be16 in_dport;    /* be */
};

/* The checksum change of two 16-byte addresses replaced, as one sum (bpf_csum_diff). -1 on error. */
static __always_inline __s64 ekp_addr6_pair_diff(const __be32 *old_s, const __be32 *old_d, const __be32 *new_s,
						 const __be32 *new_d)
{
	__s64 d = bpf_csum_diff((__be32 *)old_s, 16, (__be32 *)new_s, 16, 0);

	if (d < 0)
		return -1;
	return bpf_csum_diff((__be32 *)old_d, 16, (__be32 *)new_d, 16, (__u32)d);
}

/* Rewrites an ICMPv6 error (p: parsed, EKP_PARSE_ICMP_ERR) to `n`: outer addresses, the quote's
 * addresses and ports and the quoted L4 checksum when quoted (ekp_rewrite_quote_l4), and the
 * ICMPv6 checksum for all of them. 0 or -1. */
static __always_inline int ekp_rewrite_icmp6_err(struct __sk_buff *skb, const struct ekp_pkt6 *p,
						 const struct ekp_icmp6_nat *n)
{
	__s64 outer = ekp_addr6_pair_diff(p->saddr, p->daddr, n->saddr, n->daddr);
	__s64 quoted = ekp_addr6_pair_diff(p->in_saddr, p->in_daddr, n->in_saddr, n->in_daddr);

	if (outer < 0 || quoted < 0)
		return -1;
	/* the ICMPv6 checksum: the pseudo header's addresses and the quote's bytes */
	__u32 icmp_diff = ekp_csum_add((__u32)outer, (__u32)quoted);
	if (ekp_rewrite_quote_l4(skb, &p->b, (__u32)quoted, n->in_sport, n->in_dport, &icmp_diff) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, p->b.in_off + 8, (void *)n->in_saddr, 16, 0) < 0 ||
	    bpf_skb_store_bytes(skb, p->b.in_off + 24, (void *)n->in_daddr, 16, 0) < 0 ||
	    bpf_skb_store_bytes(skb, EKP_IP6_SADDR_OFF, (void *)n->saddr, 16, 0) < 0 ||
	    bpf_skb_store_bytes(skb, EKP_IP6_DADDR_OFF, (void *)n->daddr, 16, 0) < 0)
		return -1;
	return ekp_icmp_csum_adjust(skb, p->b.l4_off + 2, icmp_diff); /* icmp6_cksum: bytes 2-3 */
}

#endif /* EKP_NAT6_H */
