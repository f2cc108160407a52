/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_frag.h: IPv4 fragments of TCP/UDP datagrams (ekp_frag_v2, an LRU hash), as Cilium's
 * IPV4_FRAG_DATAGRAMS_MAP, and those that come before their first (ekp_fraghold_v2).
 *
 * Only the first fragment carries the L4 header, so only it says which flow the datagram belongs
 * to. Every first fragment (offset 0, MF set) records its ports under {saddr, daddr, IP id,
 * protocol}, the key the receiver reassembles by; a later fragment takes the ports from there
 * and is then decided like any packet of its flow (a conntrack hit translates its addresses;
 * it never starts a flow). The datagram's L4 checksum lives in the first fragment, which is
 * translated like a whole packet; later fragments change addresses and the IP checksum only.
 *
 * A later fragment without a record came before its first (reordered on the way: an ECMP
 * fabric hashes the first fragment's ports and the others' addresses apart; some senders emit
 * the last first), or the record was evicted. The kernel reassembles in any order, and so must
 * we, without knowing the datagram's flow yet:
 *   - when no translated flow can use its addresses (its destination is no frontend of this
 *     scope nor the node's SNAT address, and its source is no backend: ekp_addr), it is passed
 *     to the stack untouched: pod to pod, to the node itself, through the node;
 *   - otherwise it is held (EKP_ACT_HOLD: a copy in ekp_fraghold_v2, up to EKP_FRAGHOLD_SLOTS per
 *     datagram) and its first fragment, recorded as usual, puts every held one back into the
 *     device it came in by (bpf_clone_redirect to ingress, ekp_tc_frag.h), where it runs through
 *     the program again as an ordinary later fragment with a record: translated with its flow,
 *     or passed. A fragment that cannot be held drops (EKP_DROP_FRAG_NO_FIRST).
 * bpf/README.md ("Fragments in any order") compares this with handing fragments to the kernel's
 * reassembly.
 *
 * The code is ekp_frag_af.h, written once for both families: this file instantiates it for IPv4
 * (ekp_frag_*, ekp_fraghold_*), ekp_frag6.h for the tc IPv6 path's UDP fragments (ekp_frag6_*,
 * ekp_fraghold6_*: the fragment header's 32-bit id, 16-byte addresses).
 */
#ifndef EKP_FRAG_H
#define EKP_FRAG_H

#include "ekp_maps.h"
#include "ekp_parse.h"
#include "ekp_time.h"

/* How long after the last hold a first fragment looks for held ones: the kernel's reassembly
 * time (net.ipv4.ipfrag_time, net.ipv6.ip6frag_time: 30 s); a fragment held longer is useless to
 * the receiver anyway. */
#define EKP_FRAGHOLD_WINDOW_NS (30 * EKP_NSEC)

#define EKP_CT_V6 0
#include "ekp_frag_af.h"
#undef EKP_CT_V6

#endif /* EKP_FRAG_H */
