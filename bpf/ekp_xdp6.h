/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_xdp6.h: the XDP program's IPv6 path (ekp_xdp_net6), reached from ekp_xdp_net by a tail call
 * (ekp_xcalls6, ekp_tc.c) as the tc programs reach theirs, so IPv4's XDP verification and
 * per-packet work stay as they were. Loaded and filled only where the tc programs' IPv6 path is
 * (MapSizes.ipv6_tc): what it leaves to tc, ekp_from_net6 must be there to take; and only where
 * XDP attaches and the kernel has bpf_xdp_load_bytes (5.18: agent/ebpf/programs.py XDP6_NEEDS).
 *
 *   parse (ekp_parse6.h, from the XDP buffer) -> decide (ekp_decide6.h: the tc path's order of
 *   checks, the same text instantiated for XDP, ekp_decide6_xdp) -> route -> rewrite and XDP_TX
 *   (here) -> count (ekp_xstats_v3)
 *
 * What it finishes itself, as IPv4's XDP (ekp_xdp.h): drops (source ranges, no local endpoint, a
 * full SNAT range or table), and the flows between an outside client and a backend on another
 * node, both ways, whenever the route of the translated tuple leaves by the device the packet
 * came in by with its neighbour known (BPF_FIB_LKUP_RET_SUCCESS). The rewrite: addresses and ports,
 * the L4 checksum (RFC 1624, on the bytes: see ekp_xdp_apply.h for why a lab's links must compute
 * theirs), hop limit - 1 (IPv6 has no header checksum), the route's MACs.
 * Everything else passes to ekp_from_net6 untouched, BEFORE any side effect (no conntrack entry,
 * state or early-drop ring moved, no rate-limit token), counted TO_TC: fragments, ICMPv6 errors,
 * SCTP, the last hop (hop limit 1: the answer is built on the skb), a refusal tc answers with an
 * ICMPv6 error (no endpoints), a frontend with a backend on the node's own address or asking a
 * source translation while the node's IPv6 address is not known, a chosen backend that is local
 * (a pod's veth) or the node's, legacy host routing's translations, a SYN reopening an ended
 * flow's tuple, any other route result, an L4 header past the buffer's linear part. The backend's
 * choice is remembered (affinity) only past the route, where XDP will carry the flow out (IPv4's
 * XDP writes it at the choice, also for a local backend it leaves to tc).
 * A packet of no live flow and no frontend (a direct connection's reclaim is tc's) and a mid-flow
 * segment without an entry (ip6tables' flow) leave as PASS.
 */
#ifndef EKP_XDP6_H
#define EKP_XDP6_H

#include "ekp_stats.h"
#include "ekp_tc6.h"
#include "ekp_xdp_apply.h"

/* The furthest L4 header XDP rewrites: four extension headers of 64 bytes past the IPv6 header
 * (the rewrite needs a bound the verifier can check; a longer chain goes to tc). */
#define EKP_XDP6_L4_MAX (ETH_HLEN + sizeof(struct ipv6hdr) + 256)

static __always_inline int ekp_xdp6_to_tc(__u32 *outcome)
{
	*outcome = EKP_STAT_TO_TC;
	return XDP_PASS;
}

/* Whether the rewrite can reach the packet's IPv6 and L4 headers in the buffer's linear part:
 * asked before any side effect, so the rewrite after the entries are written cannot fail. */
static __always_inline int ekp_xdp6_reachable(struct xdp_md *ctx, const struct ekp_pkt6 *p)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u64 off = p->b.l4_off;
	__u32 need = p->b.proto == IPPROTO_TCP ? sizeof(struct tcphdr) : sizeof(struct udphdr);

	return off >= ETH_HLEN + sizeof(struct ipv6hdr) && off <= EKP_XDP6_L4_MAX && data + off + need <= data_end;
}

/* The route of the translated tuple from the ingress device: 1 when it goes back out of that
 * device with its neighbour resolved (w->fib holds the MACs), else 0 (tc's: NO_NEIGH, another
 * device, too big, no route). */
static __always_inline int ekp_xdp6_route(struct xdp_md *ctx, struct ekp_tc6_scratch *w, const __be32 *sa,
					  __be16 sp, const __be32 *da, __be16 dp)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ipv6hdr *ip = data + ETH_HLEN;

	if ((void *)(ip + 1) > data_end)
		return 0;
	/* XDP frames are never GRO-merged: the header's length is the packet's (the MTU check) */
	__u16 tot_len = sizeof(*ip) + ntohs(ip->payload_len);
	long rc = ekp_fib6_from(ctx, ctx->ingress_ifindex, &w->fib, &w->pkt, sa, da, sp, dp, tot_len);

	return rc == BPF_FIB_LKUP_RET_SUCCESS && w->fib.ifindex == ctx->ingress_ifindex;
}

/* Rewrites the packet to the translated tuple along the route in w->fib and sends it back out.
 * XDP_TX, or XDP_PASS (TO_TC) when a header is out of reach (ekp_xdp6_reachable said it is not). */
static __always_inline int ekp_xdp6_send(struct xdp_md *ctx, struct ekp_tc6_scratch *w, const __be32 *sa,
					 __be16 sp, const __be32 *da, __be16 dp, __u32 *outcome)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct ipv6hdr *ip = data + ETH_HLEN;

	if ((void *)(ip + 1) > data_end)
		return ekp_xdp6_to_tc(outcome);
	__u64 off = w->pkt.b.l4_off;
	asm volatile("" : "+r"(off)); /* keeps LLVM from reading it again after the test */
	if (off < ETH_HLEN + sizeof(*ip) || off > EKP_XDP6_L4_MAX)
		return ekp_xdp6_to_tc(outcome);
	__u8 *l4 = data + off;
	if ((void *)(l4 + sizeof(struct udphdr)) > data_end)
		return ekp_xdp6_to_tc(outcome);

	__be32 old_addr[8], new_addr[8];
	__builtin_memcpy(old_addr, &ip->saddr, 16);
	__builtin_memcpy(old_addr + 4, &ip->daddr, 16);
	__builtin_memcpy(new_addr, sa, 16);
	__builtin_memcpy(new_addr + 4, da, 16);
	__be16 old_port[2] = {w->pkt.b.sport, w->pkt.b.dport};
	__be16 new_port[2] = {sp, dp};
	__s64 addr_diff = bpf_csum_diff(old_addr, sizeof(old_addr), new_addr, sizeof(new_addr), 0);
	__s64 l4_diff = bpf_csum_diff((__be32 *)old_port, sizeof(old_port), (__be32 *)new_port, sizeof(new_port),
				      (__u32)addr_diff);
	if (addr_diff < 0 || l4_diff < 0 ||
	    ekp_xdp_rewrite_l4(l4, data_end, w->pkt.b.proto, (__u32)l4_diff, sp, dp) < 0)
		return ekp_xdp6_to_tc(outcome);
	ip->hop_limit -= 1; /* no header checksum to follow it */
	__builtin_memcpy(&ip->saddr, new_addr, 16);
	__builtin_memcpy(&ip->daddr, new_addr + 4, 16);
	__builtin_memcpy(eth->h_dest, w->fib.dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, w->fib.smac, ETH_ALEN);
	return XDP_TX;
}

#endif /* EKP_XDP6_H */
