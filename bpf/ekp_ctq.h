/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_ctq.h: the early-drop queues of conntrack, so that a flood of flows that never complete
 * (spoofed SYNs, unanswered datagrams) or of flows that end at once cannot evict established ones.
 *
 * The conntrack tables are LRU hashes: when one is full, the kernel evicts the entry used least
 * recently, and an idle established connection is older than every entry of a flood. nf_conntrack
 * keeps "assured" flows (a reply seen and, for TCP, the handshake completed) by dropping an
 * unassured one first when its table is full (early_drop; also closing TCP flows,
 * tcp_can_early_drop). An LRU map offers no choice of victim and no cheap way to find unassured
 * entries, so the choice is made before the table fills:
 *
 *   every flow is queued in its table's ring (ekp_ctq_tcp / ekp_ctq_any, and IPv6's own
 *   ekp_ctq6_tcp / ekp_ctq6_any: its FORWARD key and created_s) when it begins, and once more when it closes (RST, or FINs both ways); ekp_ctqh
 *   (ekp_ctqh6) holds where each ring writes next (an atomic add, so every CPU shares one ring). Writing a
 *   slot first looks at the flow queued there a whole ring ago: when it is still the same flow
 *   (same key, same created_s) and is not assured, or is closed, both its entries are deleted
 *   (EKP_STAT_EVICT_UNREPLIED / _UNASSURED / _CLOSED).
 *
 * So at most one ring's worth of flows (N slots, N flows, 2 N entries) is ever unassured or closed
 * at once. The ring has a quarter of the table's entries (agent/ebpf/abi.py CT_QUEUES): however
 * many flows a flood starts, half the table stays for assured flows, and the LRU evicts one only
 * when assured flows alone fill that half. A flow that becomes assured stays whatever its slot
 * says; an ended assured flow is deleted a ring after it closed rather than kept for its
 * tcp_closed_s (it could only reject a retransmitted last ACK); a flow that expired unassured
 * goes when its slot comes round, which on a quiet node is later than its timeout.
 *
 * The cost: one atomic add, one array slot and at most one conntrack lookup per new or closing
 * flow; nothing for any other packet (no lookup is added to the per-packet path, unlike a
 * separate table of unassured flows, which every miss would have to search as well: see
 * bpf/README.md, "Conntrack under floods").
 *
 * A handshake still has to complete within N new flows after its SYN (at a flood of 80,000
 * SYNs/s and the default 65,536 slots on 2 CPUs, 0.8 s): the kernel's early drop gives no
 * better promise.
 */
#ifndef EKP_CTQ_H
#define EKP_CTQ_H

#include "ekp_ct.h"
#include "ekp_maps.h"

/* The state counter of a flow the queue came round to, 0 when it stays (assured, still open). */
static __always_inline __u32 ekp_ctq_evictable(__u16 flags)
{
	if (ekp_ct_closed(flags))
		return EKP_STAT_EVICT_CLOSED;
	if (flags & EKP_CT_ESTABLISHED)
		return 0;
	return (flags & EKP_CT_SEEN_REPLY) ? EKP_STAT_EVICT_UNASSURED : EKP_STAT_EVICT_UNREPLIED;
}

#define EKP_CT_V6 0
#include "ekp_ctq_af.h"
#undef EKP_CT_V6

#endif /* EKP_CTQ_H */
