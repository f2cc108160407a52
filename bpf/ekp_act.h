/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_act.h: flow activity (ekp_act_v2), the cheapest check that a packet cannot belong to a
 * translated flow: two array loads (the JIT inlines array lookups) before any hash lookup.
 *
 * A packet may belong to a translated flow only when its destination is an endpoint of a live
 * flow (the frontend a flow went through: its FORWARD key's destination; the backend, which a
 * direct connection may collide with: ekp_ct_reclaim) or its source is one (the backend a reply
 * comes from: the REPLY key's source), or when its destination is a frontend (ekp_addr, for the
 * first packet of a flow). Every stamp of a conntrack entry (last_seen_ns, ekp_ct.h) also stamps
 * both endpoints of its flow here, in the slot a hash of (address, port, protocol) picks; a slot
 * stamped longer ago than the longest conntrack timeout holds no endpoint of a live flow (an entry
 * stamped then has expired since, whatever its state). So traffic between pods, with socket-level
 * load balancing a pod's connection to its backend too, pays two loads, not two conntrack lookups,
 * as long as no translated flow uses its endpoints (and one hash lookup for the frontend check).
 * Two endpoints that share a slot only cost the lookups: a false "maybe", never a wrong answer.
 *
 * Slot 0 is no endpoint's (ekp_act_slot never returns it): it is nonzero once the agent stamped
 * every flow the conntrack tables held when these programs started (agent/ebpf/activity.py: an
 * upgrade from programs that kept no stamps, an agent that died before it was done). Until then
 * the check says "maybe" to every packet.
 *
 * The slot hash is mirrored in agent/ebpf/activity.py (tests/ebpf/test_datapath_activity.py checks
 * the two agree).
 */
#ifndef EKP_ACT_H
#define EKP_ACT_H

#include "ekp_maps.h"

/* The slot of an endpoint: never 0. Addresses and ports as on the wire (network order). */
static __always_inline __u32 ekp_act_slot(__be32 addr, __be16 port, __u8 proto)
{
	__u32 h = (__u32)addr * 0x9e3779b1u;

	h ^= ((((__u32)port) << 8) | proto) * 0x85ebca6bu;
	h ^= h >> 15;
	h *= 0x2c1b3c6du;
	h ^= h >> 12;
	h &= EKP_ACT_SLOTS - 1;
	return h ? h : 1;
}

/* A stamp of the time `now` (bpf_ktime_get_ns); never 0, which means "never stamped". */
static __always_inline __u32 ekp_act_stamp_of(__u64 now)
{
	__u32 t = now >> EKP_ACT_SHIFT;

	return t ? t : 1;
}

/* Stamps one endpoint; a slot already holding this stamp is not written again (a busy frontend's
 * slot is written once per unit, not by every new flow on every CPU). */
static __always_inline void ekp_act_stamp(__be32 addr, __be16 port, __u8 proto, __u32 stamp)
{
	__u32 i = ekp_act_slot(addr, port, proto);
	struct ekp_act *a = ekp_act_lookup(&i);

	if (a && a->stamp != stamp)
		a->stamp = stamp;
}

/* Whether every flow stamped on this endpoint's slot has surely expired: stamped never, or more
 * than `span` units before `stamp`. */
static __always_inline int ekp_act_idle(__be32 addr, __be16 port, __u8 proto, __u32 stamp, __u32 span)
{
	__u32 i = ekp_act_slot(addr, port, proto);
	struct ekp_act *a = ekp_act_lookup(&i);

	if (!a)
		return 0;
	__u32 s = a->stamp;
	return !s || (__s32)(stamp - s) > (__s32)span;
}

/* Whether the agent has armed the check (slot 0, see above). */
static __always_inline int ekp_act_armed(void)
{
	__u32 zero = 0;
	struct ekp_act *a = ekp_act_lookup(&zero);

	return a && a->stamp;
}

#endif /* EKP_ACT_H */
