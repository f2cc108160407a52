/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_host6.h: legacy host routing for the tc programs' IPv6 path (ekp_hostnat6_v2): IPv4's code
 * (ekp_host_af.h) instantiated with EKP_CT_V6 1 (ekp_host6_tag, ekp_host6_hand_over,
 * ekp_host6_egress). What it does is said once, in ekp_host.h: the destination at tc ingress
 * (ekp_main6), the source at tc egress (ekp_egress6, reached from ekp_egress by a tail call), the
 * node's stack (ip6tables FORWARD, nf_conntrack) in between. Included by ekp_tc6.h after its
 * scratch (struct ekp_tc6_scratch), which the egress half parses into.
 */
#ifndef EKP_HOST6_H
#define EKP_HOST6_H

#include <linux/pkt_cls.h>

#include "ekp_frag6.h"
#include "ekp_host.h"
#include "ekp_maps.h"
#include "ekp_nat6.h"
#include "ekp_parse6.h"

static __always_inline void ekp_hostnat6_key_of(struct ekp_hostnat6_key *k, const __be32 *saddr,
						const __be32 *daddr, __be16 sport, __be16 dport, __u8 proto, __u16 tag)
{
	__builtin_memcpy(k->saddr, saddr, 16);
	__builtin_memcpy(k->daddr, daddr, 16);
	k->sport = sport;
	k->dport = dport;
	k->proto = proto;
	k->tag = tag;
}

#define EKP_CT_V6 1
#include "ekp_host_af.h"
#undef EKP_CT_V6

#endif /* EKP_HOST6_H */
