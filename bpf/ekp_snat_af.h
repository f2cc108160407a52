/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_snat_af.h: the source-port walk of ekp_snat.h for one family, included by ekp_ct_af.h (its
 * names and types are that file's macros): struct ekp_snat_state, ekp_snat_probe (one probe, the
 * body of the bpf_loop callback ekp_snat_callback in ekp_tc.c, or of the bounded loop
 * ekp_snat_walk) and ekp_snat_find (the walk) for IPv4; ekp_snat6_* for IPv6. No include guard:
 * included once per family.
 */
#include "ekp_snat.h"

/* What one family's walk carries from probe to probe, in per-CPU memory (a member of the
 * scratch of the programs that walk, EKP_SNATF(state_lookup)): a bpf_loop callback gets nothing
 * from its caller but the probe's index (ekp_tc.c says why), and the bounded loop's verifier does
 * not track memory's contents, so a candidate noted or not is no state of its own. */
struct EKP_SNATF(state) {
	EKP_CT_KEY key;   /* the reply tuple probed: backend, SNAT address, protocol, REPLY; its dport
			   * the probe's port (be) */
	__u64 now;        /* the packet's clock (ns), as the caller's */
	__u64 dead_ns;    /* past this idle time an entry is dead whatever its state (the longest
			   * timeout of the protocol) */
	__s64 orphan_ns;  /* tcp_orphan_s, in ns */
	__u32 off[4];     /* the offsets of the four rounds (ekp_snat_probe_port) */
	__u32 min;        /* host: the first port of the range */
	__u32 range;      /* ports in the range, > 0 */
	__u16 free;       /* host: the first port whose reply tuple no flow holds, 0: none */
	__u16 candidate;  /* host: the first port held by a flow that may be dead, 0: none */
	__u16 idle;       /* host: TCP: the first port idle longer than tcp_orphan_s, 0: none */
	__u16 victim;     /* host: the first port held by an unanswered flow, 0: none */
	__u8 tcp;         /* the table walked: 1 TCP's, 0 the other protocols' */
	__u8 pad[3];
	__u32 probes;     /* the bounded loop's: how many to probe (EKP_SNATF(walk)) */
};

/* The walk's memory, in the scratch of the programs that walk (ekp_tc.c); NULL never in practice
 * (a per-CPU array of one element). */
static __always_inline struct EKP_SNATF(state) *EKP_SNATF(state_lookup)(void);

#if EKP_SNAT_BPF_LOOP
/* The bpf_loop callback of the walk (ekp_tc.c): EKP_SNATF(probe) on this CPU's state. The loader
 * links it into each program that names it (agent/ebpf/programs.py ProgSpec.callback). */
long EKP_SNATF(callback)(__u32 i);
#endif

/* The probe of `port`, the body both drivers share: returns 1 (the loop stops) when it is free,
 * else notes what holds it with one-line tests and returns 0: a port held by a flow that saw a
 * FIN or RST, idle longer than any timeout of its protocol, or ORPHAN and idle longer than
 * tcp_orphan_s (dead for sure); for TCP, the first port idle longer than tcp_orphan_s (dead if its
 * backend left every Service: a flow no packet came for since, so none flagged it); and the first
 * port held by a flow that never completed its handshake. The exact check of the candidates (ekp_ct_reusable) runs after the
 * walk, once each. */
static __always_inline long EKP_SNATF(probe_at)(struct EKP_SNATF(state) *s, __u16 port, __u64 now,
						  __u64 dead_ns, __s64 orphan_ns, const int tcp)
{
	s->key.dport = htons(port);
	EKP_CT_ENTRY *old = tcp ? EKP_CTF(tcp_lookup)(&s->key) : EKP_CTF(any_lookup)(&s->key);
	if (!old) {
		s->free = port;
		return 1;
	}
	__u16 flags = old->flags;
	__s64 age = ekp_age_ns(now, old->last_seen_ns);
	if (!s->candidate && ((flags & EKP_CT_ENDING) || age > (__s64)dead_ns ||
			      (tcp && (flags & EKP_CT_ORPHAN) && age > orphan_ns)))
		s->candidate = port;
	if (tcp && !s->idle && age > orphan_ns)
		s->idle = port;
	if (!s->victim && !(flags & EKP_CT_ESTABLISHED))
		s->victim = port;
	return 0;
}

/* Probe `i` of the walk, its invariants read from the state (the callback's: it gets nothing else). */
static __always_inline long EKP_SNATF(probe_in)(struct EKP_SNATF(state) *s, __u32 i, const int tcp)
{
	__u16 port = ekp_snat_probe_port(i, s->off[0], s->off[1], s->off[2], s->off[3], s->min, s->range);
	return EKP_SNATF(probe_at)(s, port, s->now, s->dead_ns, s->orphan_ns, tcp);
}

/* Probe `i` in the table s->tcp names. The table is a constant in each of the two bodies: with the
 * map chosen at run time (one body, the map a register) the verifier cannot bind the lookup to the
 * table's own and leaves the generic helper, an indirect call per probe (bench/snatcost.py: a new
 * flow's 64 probes 13-22% slower than the bounded loop's, by pass; now 4.7%: bench/results/scale/
 * verifycost-bpfloop-2026-11-28.txt). */
static __always_inline long EKP_SNATF(probe)(struct EKP_SNATF(state) *s, __u32 i)
{
	if (s->tcp)
		return EKP_SNATF(probe_in)(s, i, 1);
	return EKP_SNATF(probe_in)(s, i, 0);
}

#if !EKP_SNAT_BPF_LOOP
/* The walk where the kernel has no bpf_loop (before 5.17, agent/ebpf/snatloop.py): the same
 * probes in a bounded loop, which the verifier walks once per iteration for every state it enters
 * with. `tcp` is a constant at both call sites: a table chosen inside the loop would leave the
 * verifier two states per probe, 2^240 paths. */
static __always_inline void EKP_SNATF(walk)(struct EKP_SNATF(state) *s, const int tcp)
{
	/* The invariants in locals, read once: read from the state in each probe (probe_in), they
	 * cost the verifier their loads 240 times per entering state (ekp_from_pod6 542,000
	 * instructions against 455,000; tests/ebpf/test_verifier_cost.py). */
	__u32 off0 = s->off[0], off1 = s->off[1], off2 = s->off[2], off3 = s->off[3];
	__u32 min = s->min, range = s->range;
	__u64 now = s->now, dead_ns = s->dead_ns;
	__s64 orphan_ns = s->orphan_ns;
#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < EKP_SNAT_PROBES; i++) {
		/* Read back from memory each time: the compiler would otherwise turn `i >= probes` into
		 * `i == probes`, an exit the verifier cannot bound (it does not know probes <= 240). */
		if (i >= s->probes)
			break;
		__u16 port = ekp_snat_probe_port(i, off0, off1, off2, off3, min, range);
		if (EKP_SNATF(probe_at)(s, port, now, dead_ns, orphan_ns, tcp))
			break;
	}
}
#endif

/* Finds a source port for a new flow: sets rkey->dport to a port whose reply tuple is free, or
 * held by an entry that may be taken over (dead, or the first unanswered one when nothing else
 * is left: f->early_drop is set then). `rkey` carries backend, SNAT address, protocol and
 * direction. Returns 0 or EKP_DROP_SNAT_PORTS. The caller claims the port (ekp_ct_place).
 *
 * Where the kernel has bpf_loop (EKP_SNAT_BPF_LOOP, chosen by the loader: agent/ebpf/snatloop.py)
 * the probes run in its callback (EKP_SNATF(probe)), which the verifier checks once for every
 * state it is called with, not once per probe: the bounded loop (EKP_SNATF(walk)) is walked once
 * per iteration for every distinct state it is entered with (about half of the tc ingress
 * programs' verified instructions). The table is the state's `tcp`, a value in memory: in the
 * callback it costs one more path; the bounded loop is entered once per table. */
static __always_inline int EKP_SNATF(find)(EKP_CT_KEY *rkey, const EKP_PKT *p,
					 const struct ekp_config *cfg, __u64 now, struct ekp_flow *f)
{
	__u32 min = cfg->snat_port_min, max = cfg->snat_port_max;
	struct EKP_SNATF(state) *s = EKP_SNATF(state_lookup)();

	if (!s || !min || max < min)
		return EKP_DROP_SNAT_PORTS;
	__u32 range = max - min + 1;
	__builtin_memcpy(&s->key, rkey, sizeof(s->key));
	s->now = now;
	s->dead_ns = ekp_ct_timeout_ns(cfg, EKP_PB(p)->proto, EKP_CT_ESTABLISHED);
	s->orphan_ns = (__s64)ekp_ct_orphan_ns(cfg);
	s->off[0] = EKP_FLOW_HASH(p);
	s->off[1] = bpf_get_prandom_u32();
	s->off[2] = bpf_get_prandom_u32();
	s->off[3] = bpf_get_prandom_u32();
	s->min = min;
	s->range = range;
	s->free = 0;
	s->candidate = 0;
	s->idle = 0;
	s->victim = 0;
	s->tcp = EKP_PB(p)->proto == IPPROTO_TCP;
#if EKP_SNAT_BPF_LOOP
	bpf_loop(range <= EKP_SNAT_ATTEMPTS ? range : EKP_SNAT_PROBES, EKP_SNATF(callback), NULL, 0);
#else
	s->probes = range <= EKP_SNAT_ATTEMPTS ? range : EKP_SNAT_PROBES;
	/* The packet's protocol, not s->tcp: where the verifier knows it, the other table's walk is
	 * never entered (s->tcp, in memory, is unknown to it: both walks on every path). */
	if (EKP_PB(p)->proto == IPPROTO_TCP)
		EKP_SNATF(walk)(s, 1);
	else
		EKP_SNATF(walk)(s, 0);
#endif
	if (s->free) {
		rkey->dport = htons(s->free);
		return 0;
	}
	if (s->candidate) {
		rkey->dport = htons(s->candidate);
		EKP_CT_ENTRY *old = EKP_CTF(lookup)(rkey);
		if (!old || EKP_CTF(reusable)(old, rkey, EKP_PB(p), cfg, now))
			return 0;
	}
	if (s->idle) {
		rkey->dport = htons(s->idle);
		EKP_CT_ENTRY *old = EKP_CTF(lookup)(rkey);
		if (!old || EKP_CTF(reusable)(old, rkey, EKP_PB(p), cfg, now))
			return 0;
	}
	if (!s->victim)
		return EKP_DROP_SNAT_PORTS;
	rkey->dport = htons(s->victim);
	f->early_drop = 1;
	return 0;
}
