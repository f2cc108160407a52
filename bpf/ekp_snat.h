/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_snat.h: choosing the source port of a source-translated flow, as the kernel's NAT does.
 *
 * A port is free for a flow when no live flow holds the reply tuple {backend, snat addr, bport,
 * port, REPLY}: uniqueness is per backend, so the range serves every backend in full. The search
 * follows nf_nat_l4proto_unique_tuple: start at an offset (here a hash of the flow's tuple), walk
 * up to 128 consecutive ports, then up to 64, 32 and 16 more from fresh random offsets (240
 * probes at most; a range of 128 ports or fewer is walked once, whole). The insert of the REPLY
 * entry with BPF_NOEXIST is the lock (ekp_ct_place, which checks again what the walk allowed): two
 * CPUs never get the same port; the one that loses the race drops its packet (DROP_TUPLE_TAKEN:
 * the client's retransmission tries again).
 *
 * Probes only look up: on an LRU map a failed insert still takes a free node (evicting some other
 * flow when the map is full), so probing by insert would evict up to 240 flows per new flow on a
 * full table.
 *
 * A holder may be taken over when it is dead (expired, or a closed TCP flow and the newcomer is a
 * SYN, ekp_ct_reusable). When the walk finds neither a free nor a dead port, it takes the first
 * unanswered one it saw (a flow that never completed its handshake, or a UDP flow without a
 * reply): the kernel's early drop, which keeps a flood of spoofed SYNs from locking real clients
 * out. Only when every probed port holds an established flow is the flow refused
 * (EKP_DROP_SNAT_PORTS). A taken-over holder loses both entries.
 *
 * The probes run in a bpf_loop callback (ekp_snat_af.h; Linux 5.17) where the kernel has bpf_loop,
 * else in a bounded loop, which the verifier walks once per iteration for every state it is
 * entered with (about half of the tc ingress programs' verified instructions). The loader picks
 * one per node by loading a bpf_loop call (agent/ebpf/snatloop.py), not by the kernel's version
 * (distributions backport bpf_loop), and compiles it in with EKP_SNAT_BPF_LOOP. bcc compiles the
 * callback but leaves the reference to it unresolved; the loader links it (agent/ebpf/calls.py,
 * bpf/README.md "Machine facts").
 */
#ifndef EKP_SNAT_H
#define EKP_SNAT_H

/* The walk itself is per family (ekp_snat_af.h, included by ekp_ct_af.h after the conntrack
 * helpers it uses: ekp_ct_reusable, ekp_flow_hash, and their IPv6 twins). */
#include "ekp_maps.h"
#include "ekp_parse.h"
#include "ekp_time.h"

/* 1: the walk's probes in a bpf_loop callback; 0: in a bounded loop. The loader always says which
 * (agent/ebpf/loader.py compile_cflags): a build without it is not one the loader made. */
#ifndef EKP_SNAT_BPF_LOOP
#error "EKP_SNAT_BPF_LOOP (1: bpf_loop callback, 0: bounded loop) must be given: agent/ebpf/snatloop.py"
#endif

#define EKP_SNAT_ATTEMPTS 128 /* NF_NAT_MAX_ATTEMPTS */
#define EKP_SNAT_PROBES 240   /* 128 + 64 + 32 + 16 */

/* The port of probe `i`: rounds of 128, 64, 32 and 16 consecutive ports from their own offsets. */
static __always_inline __u32 ekp_snat_probe_port(__u32 i, __u32 off0, __u32 off1, __u32 off2, __u32 off3,
						 __u32 min, __u32 range)
{
	__u32 off;

	if (i < 128)
		off = off0 + i;
	else if (i < 192)
		off = off1 + (i - 128);
	else if (i < 224)
		off = off2 + (i - 192);
	else
		off = off3 + (i - 224);
	return min + off % range;
}

#endif /* EKP_SNAT_H */
