/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_xdp_apply.h: carrying out a decision (ekp_decide.h) on an XDP buffer, before the skb exists.
 *
 *   PASS      XDP_PASS: on to the tc program (the outcome says whether it is a service packet
 *             left to tc, EKP_STAT_TO_TC, or none of ours)
 *   DROP      XDP_DROP
 *   TRANSLATE with legacy host routing (EKP_CFG_HOST_LEGACY): XDP_PASS, EKP_STAT_TO_TC, as below,
 *             so that the node's stack sees it. Otherwise
 *             route the translated tuple (bpf_fib_lookup, the packet's length against the egress
 *             MTU); when the route goes back out of the device the packet came in by, with its
 *             neighbour resolved: rewrite (addresses, ports, checksums, TTL - 1, MACs) and XDP_TX.
 *             Any other route (a pod's veth, another device, a neighbour to resolve, too big, no
 *             route): XDP_PASS untouched, EKP_STAT_TO_TC: the tc program finds the conntrack entry
 *             this decision wrote or used and carries it out with redirect_neigh, ICMP errors and
 *             the rest of its means.
 * REJECT, RELATED and HOLD never reach here: XDP's decisions leave those packets to tc.
 *
 * The checksums are updated incrementally from the bytes as they are (RFC 1624). That is right for
 * a frame from a wire; a frame another namespace's socket sent through a veth may carry a partial
 * checksum (CHECKSUM_PARTIAL, completed by whoever transmits it), which XDP cannot see: a lab must
 * make its external links compute their checksums, as a NIC's wire does (bpf/README.md, "XDP").
 */
#ifndef EKP_XDP_APPLY_H
#define EKP_XDP_APPLY_H

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/tcp.h>
#include <linux/udp.h>

#include "ekp_decide.h"
#include "ekp_nat.h"
#include "ekp_redirect.h"
#include "ekp_tc_scratch.h"

/* A 16-bit word of a checksummed region changed from `old` to `new` (host order both). */
static __always_inline __u16 ekp_csum_replace16(__u16 check, __u16 old, __u16 new)
{
	return ekp_csum_apply(check, (__u32)(__u16)~old + new);
}

/* The TCP or UDP header at `l4` (the UDP header's 8 bytes checked by the caller): its checksum
 * moved by `diff` (the addresses' and ports' change, bpf_csum_diff), its ports set. Both families'
 * (ekp_xdp6.h). 0, or -1 when a TCP header runs past data_end (nothing written). */
static __always_inline int ekp_xdp_rewrite_l4(__u8 *l4, void *data_end, __u8 proto, __u32 diff, __be16 sport,
					      __be16 dport)
{
	if (proto == IPPROTO_TCP) {
		struct tcphdr *tcp = (void *)l4;
		if ((void *)(tcp + 1) > data_end)
			return -1;
		tcp->check = ekp_csum_apply(tcp->check, diff);
		tcp->source = sport;
		tcp->dest = dport;
	} else {
		struct udphdr *udp = (void *)l4;
		if (udp->check) { /* 0: the sender sent none, and none is owed */
			__u16 check = ekp_csum_apply(udp->check, diff);
			udp->check = check ? check : 0xffff;
		}
		udp->source = sport;
		udp->dest = dport;
	}
	return 0;
}

static __always_inline int ekp_xdp_to_tc(struct ekp_decision *d)
{
	d->outcome = EKP_STAT_TO_TC;
	return XDP_PASS;
}

static __always_inline int ekp_xdp_apply(struct xdp_md *ctx, struct ekp_tc_scratch *w)
{
	const struct ekp_pkt *p = &w->work.pkt;
	struct ekp_decision *d = &w->work.dec;

	if (d->action == EKP_ACT_DROP)
		return XDP_DROP;
	if (d->action != EKP_ACT_TRANSLATE)
		return XDP_PASS;
	/* Legacy host routing: the node's stack (its FORWARD chain, rp_filter) must see every
	 * translated packet, which XDP_TX would send past it; tc hands it over (ekp_host.h). */
	const struct ekp_config *cfg = ekp_config_get();
	if (cfg && (cfg->flags & EKP_CFG_HOST_LEGACY))
		return ekp_xdp_to_tc(d);

	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > data_end)
		return ekp_xdp_to_tc(d);

	struct bpf_fib_lookup *fib = &w->fib;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->family = AF_INET;
	fib->tos = p->tos;
	fib->l4_protocol = p->proto;
	fib->sport = d->sport;
	fib->dport = d->dport;
	fib->ipv4_src = d->saddr;
	fib->ipv4_dst = d->daddr;
	fib->tot_len = ntohs(ip->tot_len); /* XDP frames are never GRO-merged: the length is the packet's */
	fib->ifindex = ctx->ingress_ifindex;
	long rc = bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS || fib->ifindex != ctx->ingress_ifindex)
		return ekp_xdp_to_tc(d);

	/* The L4 header, at an offset the verifier can bound (the parser checked the IP header). */
	__u64 off = p->l4_off;
	asm volatile("" : "+r"(off)); /* keeps LLVM from reading it again after the test */
	if (off < ETH_HLEN + sizeof(struct iphdr) || off > ETH_HLEN + 60)
		return ekp_xdp_to_tc(d);
	__u8 *l4 = data + off;
	if ((void *)(l4 + sizeof(struct udphdr)) > data_end)
		return ekp_xdp_to_tc(d);

	__be32 old_addr[2] = {ip->saddr, ip->daddr};
	__be32 new_addr[2] = {d->saddr, d->daddr};
	__be16 old_port[2] = {p->sport, p->dport};
	__be16 new_port[2] = {d->sport, d->dport};
	__s64 addr_diff = bpf_csum_diff(old_addr, sizeof(old_addr), new_addr, sizeof(new_addr), 0);
	__s64 l4_diff = bpf_csum_diff((__be32 *)old_port, sizeof(old_port), (__be32 *)new_port, sizeof(new_port),
				      (__u32)addr_diff);
	if (addr_diff < 0 || l4_diff < 0)
		return ekp_xdp_to_tc(d);

	if (ekp_xdp_rewrite_l4(l4, data_end, p->proto, (__u32)l4_diff, d->sport, d->dport) < 0)
		return ekp_xdp_to_tc(d);
	/* IP header: addresses and TTL (which shares its checksum word with the protocol byte). */
	__u16 ttl_old = ((__u16)ip->ttl << 8) | ip->protocol;
	__u16 ttl_new = ((__u16)(ip->ttl - 1) << 8) | ip->protocol;
	__u16 check = ekp_csum_apply(ip->check, (__u32)addr_diff);
	ip->check = ekp_csum_replace16(check, htons(ttl_old), htons(ttl_new));
	ip->ttl -= 1;
	ip->saddr = d->saddr;
	ip->daddr = d->daddr;
	__builtin_memcpy(eth->h_dest, fib->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib->smac, ETH_ALEN);
	return XDP_TX;
}

#endif /* EKP_XDP_APPLY_H */
