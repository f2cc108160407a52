/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_snat_af.h: the source-port walk of ekp_snat.h for one family, included by ekp_ct_af.h (its
 * names and types are that file's macros): ekp_snat_walk / ekp_snat_find for IPv4,
 * ekp_snat6_walk / ekp_snat6_find for IPv6. No include guard: included once per family.
 */
#include "ekp_snat.h"

/* Finds a source port for a new flow: sets rkey->dport to a port whose reply tuple is free, or
 * held by an entry that may be taken over (dead, or the first unanswered one when nothing else
 * is left: f->early_drop is set then). `rkey` carries backend, SNAT address, protocol and
 * direction. Returns 0 or EKP_DROP_SNAT_PORTS. The caller claims the port (ekp_ct_place).
 *
 * The walk itself only notes candidates with one-line tests (the verifier explores every
 * iteration, and a branchy body overflows its 8192 pending states): a port held by a flow that
 * saw a FIN or RST, idle longer than any timeout of its protocol, or ORPHAN and idle longer than
 * tcp_orphan_s (dead for sure); for TCP, the first port idle longer than tcp_orphan_s (dead if
 * its backend left every Service: a flow no packet came for since, so none flagged it); and the
 * first port held by a flow that never completed its handshake. The exact check of the
 * candidates (ekp_ct_reusable) runs after the walk, once each. The walk is written once per
 * conntrack table (`tcp` is a constant at both call sites): a table chosen inside the loop would
 * leave the verifier two states per probe, 2^240 paths.
 *
 * The verifier walks the loop once per iteration for every distinct state it enters with, so
 * what the loop carries lives in the flow's work memory (f->snat_*, a per-CPU map value), whose
 * contents it does not track: held in registers, a candidate noted or not and a range of at most
 * 128 ports or more (the probe count 240 or the range) were distinct states, each walked through
 * every iteration again (about 560,000 of the tc programs' 780,000 verified instructions). */
static __always_inline int EKP_SNATF(walk)(EKP_CT_KEY *rkey, const EKP_PKT *p,
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
	__u32 off0 = EKP_FLOW_HASH(p);
	__u32 off1 = bpf_get_prandom_u32(), off2 = bpf_get_prandom_u32(), off3 = bpf_get_prandom_u32();
	/* Past this idle time an entry is dead whatever its state (the longest timeout). */
	__u64 dead_ns = ekp_ct_timeout_ns(cfg, EKP_PB(p)->proto, EKP_CT_ESTABLISHED);
	__s64 orphan_ns = (__s64)ekp_ct_orphan_ns(cfg);

#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < EKP_SNAT_PROBES; i++) {
		/* Read back from memory each time: the compiler would otherwise turn `i >= total` into
		 * `i == total`, an exit the verifier cannot bound (it does not know total <= 240). */
		if (i >= f->snat_probes)
			break;
		__u16 port = ekp_snat_probe_port(i, off0, off1, off2, off3, min, range);
		rkey->dport = htons(port);
		EKP_CT_ENTRY *old = tcp ? EKP_CTF(tcp_lookup)(rkey) : EKP_CTF(any_lookup)(rkey);
		if (!old)
			return 0;
		__u16 flags = old->flags;
		__s64 age = ekp_age_ns(now, old->last_seen_ns);
		if (!f->snat_candidate && ((flags & EKP_CT_ENDING) || age > (__s64)dead_ns ||
					   (tcp && (flags & EKP_CT_ORPHAN) && age > orphan_ns)))
			f->snat_candidate = port;
		if (tcp && !f->snat_idle && age > orphan_ns)
			f->snat_idle = port;
		if (!f->snat_victim && !(flags & EKP_CT_ESTABLISHED))
			f->snat_victim = port;
	}
	if (f->snat_candidate) {
		rkey->dport = htons(f->snat_candidate);
		EKP_CT_ENTRY *old = EKP_CTF(lookup)(rkey);
		if (!old || EKP_CTF(reusable)(old, rkey, EKP_PB(p), cfg, now))
			return 0;
	}
	if (f->snat_idle) {
		rkey->dport = htons(f->snat_idle);
		EKP_CT_ENTRY *old = EKP_CTF(lookup)(rkey);
		if (!old || EKP_CTF(reusable)(old, rkey, EKP_PB(p), cfg, now))
			return 0;
	}
	if (!f->snat_victim)
		return EKP_DROP_SNAT_PORTS;
	rkey->dport = htons(f->snat_victim);
	f->early_drop = 1;
	return 0;
}

static __always_inline int EKP_SNATF(find)(EKP_CT_KEY *rkey, const EKP_PKT *p,
					 const struct ekp_config *cfg, __u64 now, struct ekp_flow *f)
{
	if (EKP_PB(p)->proto == IPPROTO_TCP)
		return EKP_SNATF(walk)(rkey, p, cfg, now, f, 1);
	return EKP_SNATF(walk)(rkey, p, cfg, now, f, 0);
}

