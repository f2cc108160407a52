/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_ct6.h: IPv6's conntrack (ekp_ct6_tcp / ekp_ct6_any and their early-drop rings ekp_ctq6_tcp /
 * ekp_ctq6_any), the same code as IPv4's: ekp_ct_af.h, ekp_ctq_af.h and ekp_snat_af.h instantiated
 * with EKP_CT_V6 1 (ekp_ct6_*, ekp_ctq6_*, ekp_snat6_*). What they do is said once, in ekp_ct.h and
 * ekp_ctq.h; only the family's own pieces are here: its address compare and fold, its flow (struct
 * ekp_flow6) and its flow hash.
 */
#ifndef EKP_CT6_H
#define EKP_CT6_H

#include "ekp_act.h"
#include "ekp_ct.h"
#include "ekp_ctq.h"
#include "ekp_maps.h"
#include "ekp_parse6.h"

/* An IPv6 endpoint in the flow-activity array (ekp_act.h) is its address folded to 32 bits: a
 * stamp is a hint, and a slot shared with another endpoint (of either family) only costs the
 * lookups, never a wrong answer. */
static __always_inline __be32 ekp_fold6(const __be32 *a)
{
	return a[0] ^ a[1] ^ a[2] ^ a[3];
}

/* A new IPv6 flow: struct ekp_flow (ids, ports, flags; its IPv4 addresses stay 0) and the flow's
 * three addresses at full width. */
struct ekp_flow6 {
	struct ekp_flow b;
	__be32 be_addr[4];   /* be: the backend (ekp_pick_backend_af's `be6`) */
	__be32 fe_addr[4];   /* be: the frontend */
	__be32 snat_addr[4]; /* be: the source after translation when EKP_CT_SNAT: the node's IPv6
			      * address (ekp_cfg6), or the client's own for a remapped port */
};

/* ekp_flow_hash of an IPv6 tuple: where the SNAT port walk starts (ekp_snat_af.h). */
static __always_inline __u32 ekp_flow6_hash(const struct ekp_pkt6 *p)
{
	__u32 h = 0;

#pragma unroll
	for (int i = 0; i < 4; i++) {
		h ^= p->saddr[i] * 0x9e3779b1u + 0x7f4a7c15u + (h << 6) + (h >> 2);
		h ^= p->daddr[i] + 0x7f4a7c15u + (h << 6) + (h >> 2);
	}
	h ^= ((__u32)p->b.sport << 16 | p->b.dport) + 0x7f4a7c15u + (h << 6) + (h >> 2);
	h ^= p->b.proto;
	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return h;
}

#define EKP_CT_V6 1
#include "ekp_ct_af.h"
#include "ekp_ctq_af.h"
#undef EKP_CT_V6

#endif /* EKP_CT6_H */
