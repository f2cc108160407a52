/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_snat.h: choosing the source port of a source-translated flow, as the kernel's NAT does.
 *
 * A port is free for a flow when no live flow holds the reply tuple {backend, snat addr, bport,
 * port, REPLY}: uniqueness is per backend, so the range serves every backend in full. The search
 * follows nf_nat_l4proto_unique_tuple: start at an offset (here a hash of the flow's tuple), walk
 * up to 128 consecutive ports, then up to 64, 32 and 16 more from fresh random offsets (240
 * probes at most; a range of 128 ports or fewer is walked once, whole). The insert of the REPLY
 * entry with BPF_NOEXIST is the lock (ekp_ct_place): two CPUs never get the same port; the one
 * that loses the race drops its packet (the client's retransmission tries again).
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
 * bcc 0.26 cannot pass a callback to bpf_loop (its loader leaves the function pointer a plain
 * scalar: "R2 type=scalar expected=func") nor load BPF-to-BPF calls, so this is a bounded loop,
 * verified once per iteration.
 */
#ifndef EKP_SNAT_H
#define EKP_SNAT_H

/* Included by ekp_ct.h, after the conntrack helpers it uses (ekp_ct_reusable, ekp_ct_delete_twin,
 * ekp_flow_hash); used by it (IPv4) and by ekp_tc6_snat.h (IPv6). */
#include "ekp_maps.h"
#include "ekp_parse.h"
#include "ekp_time.h"

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

/* Whether an IPv6 entry `e` holding a reply tuple a new flow wants may be taken over: ekp_ct_reusable
 * for the tc IPv6 path's entries, whose life is their timeout alone (that path keeps no ORPHAN
 * state: ekp_tc6.h). */
static __always_inline int ekp_ct6_reusable(const struct ekp_ct6_entry *e, const struct ekp_pkt *p,
					    const struct ekp_config *cfg, __u64 now)
{
	if (ekp_age_ns(now, e->last_seen_ns) > (__s64)ekp_ct_timeout_ns(cfg, p->proto, e->flags))
		return 1;
	return ekp_pure_syn(p) && ekp_ct_closed(e->flags);
}

/* Sets the probed port of the reply tuple `rkey`: IPv4's struct ekp_ct_key, or IPv6's struct
 * ekp_ct6_key when `v6` (a constant at every call site, as ekp_lb.h's `_af` functions take it). */
static __always_inline void ekp_snat_set_port_af(int v6, void *rkey, __u16 port)
{
	if (v6)
		((struct ekp_ct6_key *)rkey)->dport = htons(port);
	else
		((struct ekp_ct_key *)rkey)->dport = htons(port);
}

/* After the walk: whether the reply tuple `rkey` with `port` is free, or held by an entry that may be
 * taken over (the exact check, ekp_ct_reusable / ekp_ct6_reusable). Leaves the port in `rkey`. */
static __always_inline int ekp_snat_takeable_af(int v6, void *rkey, __u16 port, const struct ekp_pkt *p,
						const struct ekp_config *cfg, __u64 now)
{
	ekp_snat_set_port_af(v6, rkey, port);
	if (v6) {
		struct ekp_ct6_entry *old6 = ekp_ct6_lookup(rkey);
		return !old6 || ekp_ct6_reusable(old6, p, cfg, now);
	}
	struct ekp_ct_entry *old = ekp_ct_lookup(rkey);
	return !old || ekp_ct_reusable(old, rkey, p, cfg, now);
}

/* Finds a source port for a new flow: sets rkey->dport to a port whose reply tuple is free, or
 * held by an entry that may be taken over (dead, or the first unanswered one when nothing else
 * is left: f->early_drop is set then). `rkey` carries backend, SNAT address, protocol and
 * direction: IPv4's struct ekp_ct_key, or with `v6` IPv6's struct ekp_ct6_key, whose entries the
 * walk reads in the IPv6 tables (one walk for both families, the family a constant parameter as
 * in ekp_lb.h: each program verifies only its own family's copy, and the IPv4 copy is the code it
 * was before IPv6 shared it). `hash` (of the flow's tuple: ekp_tuple_hash) is where the first round
 * starts. Returns 0 or EKP_DROP_SNAT_PORTS. The caller claims the port (ekp_ct_place; IPv6:
 * ekp_ct6_place).
 *
 * The walk itself only notes candidates with one-line tests (the verifier explores every
 * iteration, and a branchy body overflows its 8192 pending states): a port held by a flow that
 * saw a FIN or RST, idle longer than any timeout of its protocol, or ORPHAN and idle longer than
 * tcp_orphan_s (dead for sure); for IPv4 TCP, the first port idle longer than tcp_orphan_s (dead
 * if its backend left every Service: a flow no packet came for since, so none flagged it; the
 * IPv6 path keeps no ORPHAN state, so it has no such candidate); and the first port held by a flow
 * that never completed its handshake. The exact check of the candidates (ekp_snat_takeable_af)
 * runs after the walk, once each. The walk is written once per conntrack table (`tcp` is a
 * constant at every call site): a table chosen inside the loop would leave the verifier two
 * states per probe, 2^240 paths.
 *
 * The verifier walks the loop once per iteration for every distinct state it enters with, so
 * what the loop carries lives in the flow's work memory (f->snat_*, a per-CPU map value), whose
 * contents it does not track: held in registers, a candidate noted or not and a range of at most
 * 128 ports or more (the probe count 240 or the range) were distinct states, each walked through
 * every iteration again (about 560,000 of the tc programs' 780,000 verified instructions). */
static __always_inline int ekp_snat_walk_af(int v6, void *rkey, const struct ekp_pkt *p, __u32 hash,
					    const struct ekp_config *cfg, __u64 now, struct ekp_flow *f, const int tcp)
{
	__u32 min = cfg->snat_port_min, max = cfg->snat_port_max;

	if (!min || max < min)
		return EKP_DROP_SNAT_PORTS;
	__u32 range = max - min + 1;
	f->snat_probes = range <= EKP_SNAT_ATTEMPTS ? range : EKP_SNAT_PROBES;
	f->snat_candidate = 0;
	f->snat_idle = 0;
	f->snat_victim = 0;
	__u32 off0 = hash;
	__u32 off1 = bpf_get_prandom_u32(), off2 = bpf_get_prandom_u32(), off3 = bpf_get_prandom_u32();
	/* Past this idle time an entry is dead whatever its state (the longest timeout). */
	__u64 dead_ns = ekp_ct_timeout_ns(cfg, p->proto, EKP_CT_ESTABLISHED);
	__s64 orphan_ns = (__s64)ekp_ct_orphan_ns(cfg);

#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < EKP_SNAT_PROBES; i++) {
		/* Read back from memory each time: the compiler would otherwise turn `i >= total` into
		 * `i == total`, an exit the verifier cannot bound (it does not know total <= 240). */
		if (i >= f->snat_probes)
			break;
		__u16 port = ekp_snat_probe_port(i, off0, off1, off2, off3, min, range);
		__u16 flags;
		__s64 age;
		ekp_snat_set_port_af(v6, rkey, port);
		if (v6) {
			struct ekp_ct6_entry *old6 = tcp ? ekp_ct6_tcp_lookup(rkey) : ekp_ct6_any_lookup(rkey);
			if (!old6)
				return 0;
			flags = old6->flags;
			age = ekp_age_ns(now, old6->last_seen_ns);
		} else {
			struct ekp_ct_entry *old = tcp ? ekp_ct_tcp_lookup(rkey) : ekp_ct_any_lookup(rkey);
			if (!old)
				return 0;
			flags = old->flags;
			age = ekp_age_ns(now, old->last_seen_ns);
		}
		if (!f->snat_candidate && ((flags & EKP_CT_ENDING) || age > (__s64)dead_ns ||
					   (tcp && (flags & EKP_CT_ORPHAN) && age > orphan_ns)))
			f->snat_candidate = port;
		if (tcp && !v6 && !f->snat_idle && age > orphan_ns)
			f->snat_idle = port;
		if (!f->snat_victim && !(flags & EKP_CT_ESTABLISHED))
			f->snat_victim = port;
	}
	if (f->snat_candidate && ekp_snat_takeable_af(v6, rkey, f->snat_candidate, p, cfg, now))
		return 0;
	if (f->snat_idle && ekp_snat_takeable_af(v6, rkey, f->snat_idle, p, cfg, now))
		return 0;
	if (!f->snat_victim)
		return EKP_DROP_SNAT_PORTS;
	ekp_snat_set_port_af(v6, rkey, f->snat_victim);
	f->early_drop = 1;
	return 0;
}

static __always_inline int ekp_snat_find(struct ekp_ct_key *rkey, const struct ekp_pkt *p,
					 const struct ekp_config *cfg, __u64 now, struct ekp_flow *f)
{
	if (p->proto == IPPROTO_TCP)
		return ekp_snat_walk_af(0, rkey, p, ekp_flow_hash(p), cfg, now, f, 1);
	return ekp_snat_walk_af(0, rkey, p, ekp_flow_hash(p), cfg, now, f, 0);
}

#endif /* EKP_SNAT_H */
