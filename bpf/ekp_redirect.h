/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_redirect.h: delivering a translated packet without the node's IP stack (tc).
 *
 * Handing a half-translated packet to the stack runs into martian / rp_filter checks and
 * netfilter's INVALID state (see ENVIRONMENT.md), so we route it ourselves: bpf_fib_lookup from
 * the ingress device (needs forwarding enabled on it), then bpf_redirect with the neighbour's
 * MAC, or bpf_redirect_neigh when the neighbour is not resolved yet.
 *
 * The lookup is made for the translated tuple *before* the packet is rewritten (ekp_tc_apply),
 * so that a packet too big for the egress device can still be answered with an ICMP
 * fragmentation-needed that quotes it as its sender sent it.
 */
#ifndef EKP_REDIRECT_H
#define EKP_REDIRECT_H

#include <linux/ipv6.h>
#include <linux/pkt_cls.h>

#include "ekp_nat.h"
#include "ekp_parse.h"

#ifndef AF_INET
#define AF_INET 2
#endif

/* bcc 0.26 declares bpf_redirect_neigh with 3 arguments; the kernel's helper takes 4. */
static long (*ekp_redirect_neigh)(__u32 ifindex, struct bpf_redir_neigh *params, int plen,
				  __u64 flags) = (void *)BPF_FUNC_redirect_neigh;

/* GSO_BY_FRAGS (linux/skbuff.h): an SCTP GSO skb, whose segments are its chunks' sizes */
#define EKP_GSO_BY_FRAGS 0xFFFF

/* The IP length of the largest packet this skb leaves as, for the route lookup's MTU check
 * (fib->tot_len). A GSO skb (a pod's TSO burst, GRO's merge on the way in) leaves as segments of
 * gso_size payload behind copies of its headers: network header (extension headers included) +
 * L4 header + gso_size; any other as its IP header gives it (IPv4 tot_len, IPv6 40 +
 * payload_len). 0 (the helper's own check) for SCTP's GSO_BY_FRAGS and a TCP header that cannot
 * be read. With tot_len 0 the helper only asks is_skb_forwardable(),
 * which passes every GSO skb whatever its segments and compares against the device, not the
 * route: a burst bigger than a smaller uplink was then redirected and its segments dropped there,
 * no ICMP sent, the sender's path-MTU discovery waiting for its retransmission timeout.
 * A UDP-tunnel GSO skb (VXLAN, Geneve: SKB_GSO_UDP_TUNNEL, skb->encapsulation) is undercounted by
 * its inner headers, which gso_size does not cover. __sk_buff shows neither gso_type nor
 * encapsulation, so it cannot be told from a UDP GSO burst (SKB_GSO_UDP_L4, counted right); an
 * undercount only misses a too-big answer (the segments dropped at the device, as with tot_len 0),
 * never gives a wrong one, so both keep the count rather than pass 0. (IPIP, GRE and ESP never
 * get here: the parser passes them.) */
static __always_inline __u16 ekp_seg_len(struct __sk_buff *skb, const struct ekp_pkt *p)
{
	__u32 gso = skb->gso_size;
	__u32 len;

	if (!gso) {
		/* The IP header's own length: skb->len also counts what follows the packet in the frame
		 * (Ethernet padding, a trailer), which a full-size packet would be refused for. */
		__u8 ip[6];
		if (bpf_skb_load_bytes(skb, ETH_HLEN, ip, sizeof(ip)) < 0)
			return 0;
		if ((ip[0] >> 4) == 6)
			len = ((__u32)ip[4] << 8 | ip[5]) + sizeof(struct ipv6hdr); /* payload_len */
		else
			len = (__u32)ip[2] << 8 | ip[3]; /* tot_len */
	} else if (gso >= EKP_GSO_BY_FRAGS) {
		return 0;
	} else {
		__u32 l4 = sizeof(struct udphdr);
		if (p->proto == IPPROTO_TCP) {
			__u8 doff;
			if (bpf_skb_load_bytes(skb, p->l4_off + 12, &doff, 1) < 0)
				return 0;
			l4 = (doff >> 4) * 4;
		}
		len = p->l4_off - ETH_HLEN + l4 + gso;
	}
	return len > 0xFFFF ? 0xFFFF : len;
}

/* The route for the tuple saddr:sport -> daddr:dport, checked against `tot_len` (ekp_seg_len): the
 * helper then compares it with an MTU before it looks at the neighbour, and says
 * BPF_FIB_LKUP_RET_FRAG_NEEDED with that MTU in fib->mtu_result (net/core/filter.c, check_mtu;
 * Linux 5.12+, hence the doctor's minimum). That MTU is not quite the one the stack's forwarding
 * uses. IPv4 (ip_mtu_from_fib_result): a route's `mtu` metric only when locked (`mtu lock N`) or
 * net.ipv4.ip_forward_use_pmtu is set, else a learnt path MTU (an exception from an ICMP), else
 * the device's; ip_forward honours an unlocked `mtu` metric and ignores a learnt path MTU unless
 * locked or ip_forward_use_pmtu. IPv6 (ip6_mtu_from_fib6): a locked `mtu` metric, else a learnt
 * path MTU, else the device's mtu6; ip6_forward ignores the learnt one. So an unlocked IPv4 route MTU
 * smaller than the device's is not enforced here (a packet between the two leaves whole), and a
 * learnt path MTU is answered here where forwarding would pass the packet on. 0 asks no MTU
 * question that matters (the reverse-path check). */
static __always_inline long ekp_fib(struct __sk_buff *skb, struct bpf_fib_lookup *fib, __u8 proto, __u8 tos,
				    __be32 saddr, __be32 daddr, __be16 sport, __be16 dport, __u16 tot_len)
{
	fib->family = AF_INET;
	fib->tos = tos;
	fib->l4_protocol = proto;
	fib->sport = sport;
	fib->dport = dport;
	fib->ipv4_src = saddr;
	fib->ipv4_dst = daddr;
	fib->tot_len = tot_len;
	fib->ifindex = skb->ingress_ifindex;
	return bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
}

/* What the stack's strict reverse-path filter checks (rp_filter=1), for a packet we deliver past
 * it: the route back to the packet's source leaves by the device it came in on. For a pod device
 * that is the pod's own address (and any other the node routes to it), read from the FIB at the
 * moment the packet passes: no list of pod addresses to keep in step with the CNI. FRAG_NEEDED
 * still names the device. 1 when it does.
 *
 * Pods on a Linux bridge (kubenet's cbr0, --detect-local-mode=BridgeInterface): the program runs
 * on the pod's port, before the bridge, and the node routes the pods' addresses by the bridge, so
 * the route's device is the bridge, never the port. A route back by the port's bridge passes: what
 * the kernel's rp_filter checks for the same packet, whose input device is the bridge (so a pod can
 * claim another address of its bridge's subnet, as it can with iptables mode). The bridge comes
 * from ekp_port_v2, which the agent writes for each port (struct ekp_port), looked up only when the
 * route back is not the ingress device: an ordinary pod's packet pays nothing for it. */
static __always_inline __u32 ekp_port_bridge(struct __sk_buff *skb)
{
	u32 port = skb->ingress_ifindex;
	struct ekp_port *v = ekp_port_lookup(&port);

	return v ? v->bridge : 0;
}

static __always_inline int ekp_source_routed_here(struct __sk_buff *skb, const struct ekp_pkt *p,
						  struct bpf_fib_lookup *fib)
{
	__builtin_memset(fib, 0, sizeof(*fib));
	long rc = ekp_fib(skb, fib, p->proto, p->tos, p->daddr, p->saddr, p->dport, p->sport, 0);

	return (rc == BPF_FIB_LKUP_RET_SUCCESS || rc == BPF_FIB_LKUP_RET_NO_NEIGH ||
		rc == BPF_FIB_LKUP_RET_FRAG_NEEDED) &&
	       (fib->ifindex == skb->ingress_ifindex || ekp_port_bridge(skb) == fib->ifindex);
}

/* Sends a rewritten packet along the route `fib` found (rc SUCCESS or NO_NEIGH). Returns the TC
 * verdict; turns *outcome into EKP_DROP_MALFORMED when the frame could not be finished. */
static __always_inline int ekp_redirect(struct __sk_buff *skb, const struct ekp_pkt *p, struct bpf_fib_lookup *fib,
					long rc, __u32 *outcome)
{
	if (ekp_dec_ttl(skb, p) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH) {
		struct bpf_redir_neigh nh = {};
		nh.nh_family = AF_INET;
		nh.ipv4_nh = fib->ipv4_dst; /* the gateway when the route has one */
		return ekp_redirect_neigh(fib->ifindex, &nh, sizeof(nh), 0);
	}
	if (bpf_skb_store_bytes(skb, 0, fib->dmac, ETH_ALEN, 0) < 0 ||
	    bpf_skb_store_bytes(skb, ETH_ALEN, fib->smac, ETH_ALEN, 0) < 0) {
		*outcome = EKP_DROP_MALFORMED;
		return TC_ACT_SHOT;
	}
	return bpf_redirect(fib->ifindex, 0);
}

#endif /* EKP_REDIRECT_H */
