/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_ct.h: connection tracking of translated flows (ekp_ct_tcp_v2 / ekp_ct_any_v2, LRU hashes).
 *
 * A flow owns two entries, each keyed by a tuple exactly as it appears on the wire when the
 * packet reaches an ekp program, and by its direction (so an original tuple never matches a
 * reply entry):
 *   FORWARD  {client, frontend, cport, fport, FORWARD}                 -> backend (+ SNAT source)
 *   REPLY    {backend, client|snat addr, bport, cport|snat port, REPLY} -> frontend (+ client)
 * Each entry holds everything needed to rebuild the other (its "twin"): the frontend, the
 * backend, the client and the SNAT source. Replies need no service map: a flow keeps working
 * while its Service is deleted and created again.
 *
 * State (EKP_CT_*), kept alike on both entries (a change is written to the twin too, at most a
 * few times per flow): SEEN_REPLY, ESTABLISHED (the client acked the backend's answer: the
 * kernel's "assured"), FIN_FWD / FIN_REPLY, RST. The timeout follows the state, as the kernel's
 * and Cilium's conntrack do: handshake not completed tcp_syn_s (60 s), established
 * tcp_established_s (24 h), one FIN tcp_close_wait_s (1 h), RST or FINs both ways tcp_closed_s
 * (10 s); UDP udp_s (30 s) until replied and older than 2 s, then udp_stream_s (120 s).
 *
 * A TCP flow whose backend address left every Service (ekp_addr: the pod was deleted) is
 * ORPHAN: from then on only the backend's packets renew it, and it lives at most tcp_orphan_s
 * (300 s, nf_conntrack's timeout for unacknowledged data) after the backend's last one. A live
 * stream keeps answering, so it survives its Service being deleted and created again; a dead one
 * (its client retransmitting into the void, or idle) frees its entries and its SNAT port. The
 * flag follows the backend: set or cleared at each refresh. An idle flow that no packet flagged is
 * ORPHAN all the same once it is older than tcp_orphan_s and its backend is unlisted
 * (ekp_ct_life: one ekp_addr lookup, only for entries that idle).
 *
 * Expiry is computed on lookup (last_seen_ns + timeout); an expired entry is a miss and is
 * overwritten by the next flow on its tuple; an abandoned one (ORPHAN, past tcp_orphan_s) is
 * deleted by the lookup that finds it; the early-drop queue deletes flows that never became
 * assured, or closed, a ring after they began or closed (ekp_ctq.h); the LRU evicts the rest.
 * last_seen_ns is refreshed at most once a second; the refresh also checks that the twin exists
 * (re-creating it when the LRU evicted it: EKP_STAT_CT_REBUILT) and, for TCP, whether the backend
 * is still listed. Every write of last_seen_ns stamps both endpoints of the flow in ekp_act
 * (ekp_ct_stamp), which lets packets of no live flow skip the lookups (ekp_act.h).
 */
#ifndef EKP_CT_H
#define EKP_CT_H

#include "ekp_act.h"
#include "ekp_maps.h"
#include "ekp_parse.h"
#include "ekp_time.h"

#define EKP_CT_REFRESH_NS EKP_NSEC
/* Used when ekp_config holds 0 (the agent has not written it yet): kube-proxy's and the kernel's
 * defaults, as agent/ebpf/plan.py's config_entry writes them. */
#define EKP_DEFAULT_TCP_ESTABLISHED_S 86400
#define EKP_DEFAULT_TCP_CLOSE_WAIT_S 3600
#define EKP_DEFAULT_TCP_SYN_S 60
#define EKP_DEFAULT_TCP_CLOSED_S 10
#define EKP_DEFAULT_UDP_S 30
#define EKP_DEFAULT_UDP_STREAM_S 120
#define EKP_DEFAULT_TCP_ORPHAN_S 300
/* A replied UDP flow becomes a stream (long timeout) once it is this old (the kernel's rule). */
#define EKP_UDP_STREAM_AFTER_S 2

#define EKP_CT_ENDING (EKP_CT_FIN_FWD | EKP_CT_FIN_REPLY | EKP_CT_RST)

/* The decision taken for a new flow, from backend choice to conntrack entries. */
struct ekp_flow {
	__u32 svc_id;
	__u32 backend_id;
	__be32 be_addr;
	__be32 fe_addr;
	__be32 snat_addr;
	__be16 be_port;
	__be16 fe_port;
	__be16 snat_port; /* chosen by ekp_ct_create when EKP_CT_SNAT */
	__u16 ct_flags;   /* EKP_CT_* */
	__u8 be_flags;
	__u8 remapped;    /* the reply tuple was taken: moved to another source port */
	__u8 early_drop;  /* an unanswered flow was evicted for the port */
	__u8 pad;
	/* The SNAT port walk's running values (ekp_snat.h: why they live here, not in registers) */
	__u32 snat_probes;
	__u16 snat_candidate;
	__u16 snat_idle;
	__u16 snat_victim;
	__u16 pad2;
};

static __always_inline __u32 ekp_cfg_or(__u32 value, __u32 dflt)
{
	return value ? value : dflt;
}

/* Closed: a RST, or FINs both ways. */
static __always_inline int ekp_ct_closed(__u16 flags)
{
	return (flags & EKP_CT_RST) || ((flags & EKP_CT_FIN_FWD) && (flags & EKP_CT_FIN_REPLY));
}

static __always_inline __u64 ekp_ct_timeout_ns(const struct ekp_config *cfg, __u8 proto, __u16 flags)
{
	__u32 s;

	if (proto == IPPROTO_TCP) {
		if (ekp_ct_closed(flags))
			s = ekp_cfg_or(cfg->tcp_closed_s, EKP_DEFAULT_TCP_CLOSED_S);
		else if (flags & (EKP_CT_FIN_FWD | EKP_CT_FIN_REPLY))
			s = ekp_cfg_or(cfg->tcp_close_wait_s, EKP_DEFAULT_TCP_CLOSE_WAIT_S);
		else if (flags & EKP_CT_ESTABLISHED)
			s = ekp_cfg_or(cfg->tcp_established_s, EKP_DEFAULT_TCP_ESTABLISHED_S);
		else
			s = ekp_cfg_or(cfg->tcp_syn_s, EKP_DEFAULT_TCP_SYN_S);
	} else if (flags & EKP_CT_ESTABLISHED) {
		s = ekp_cfg_or(cfg->udp_stream_s, EKP_DEFAULT_UDP_STREAM_S);
	} else {
		s = ekp_cfg_or(cfg->udp_s, EKP_DEFAULT_UDP_S);
	}
	return (__u64)s * EKP_NSEC;
}

static __always_inline int ekp_ct_expired(const struct ekp_ct_entry *e, const struct ekp_config *cfg,
					  __u8 proto, __u64 now)
{
	/* another CPU may have refreshed it after we read the clock: a negative age, not expired */
	return ekp_age_ns(now, e->last_seen_ns) > (__s64)ekp_ct_timeout_ns(cfg, proto, e->flags);
}

static __always_inline __u64 ekp_ct_orphan_ns(const struct ekp_config *cfg)
{
	return (__u64)ekp_cfg_or(cfg->tcp_orphan_s, EKP_DEFAULT_TCP_ORPHAN_S) * EKP_NSEC;
}

/* The longest a flow of protocol `proto`, in any state, lives without a packet, in ekp_act stamps
 * (a stamp is 1.07 s: seconds overstate it), with a margin for the coarse clock and concurrent
 * stamps. Stamps are per protocol (ekp_act_slot hashes it), and a live flow stamped its slot
 * within its own protocol's lifetime: a slot shared with another protocol's older stamp only
 * looks idle sooner, never wrongly. Other protocols than TCP live by UDP's timeouts
 * (ekp_ct_timeout_ns), so a backend's translated UDP flow makes direct datagrams to it take the
 * conntrack lookup for two minutes after it ended, not for TCP's day. */
static __always_inline __u32 ekp_ct_longest_stamps(const struct ekp_config *cfg, __u8 proto)
{
	__u32 s = ekp_cfg_or(cfg->udp_s, EKP_DEFAULT_UDP_S);
	__u32 v = ekp_cfg_or(cfg->udp_stream_s, EKP_DEFAULT_UDP_STREAM_S);

	s = v > s ? v : s;
	if (proto == IPPROTO_TCP) {
		v = ekp_cfg_or(cfg->tcp_established_s, EKP_DEFAULT_TCP_ESTABLISHED_S);
		s = v;
		v = ekp_cfg_or(cfg->tcp_close_wait_s, EKP_DEFAULT_TCP_CLOSE_WAIT_S);
		s = v > s ? v : s;
		v = ekp_cfg_or(cfg->tcp_syn_s, EKP_DEFAULT_TCP_SYN_S);
		s = v > s ? v : s;
		v = ekp_cfg_or(cfg->tcp_closed_s, EKP_DEFAULT_TCP_CLOSED_S);
		s = v > s ? v : s;
	}
	return s + 2;
}

/* Whether the backend of the flow stored as `e` under `k` is still some Service's backend
 * (ekp_addr). A direct flow (svc_id 0: a port remapped around a live flow) has none to lose. */
static __always_inline int ekp_ct_backend_listed(const struct ekp_ct_entry *e, const struct ekp_ct_key *k)
{
	struct ekp_addr_key ak = {};

	if (!e->svc_id)
		return 1;
	ak.addr = k->dir == EKP_CT_FORWARD ? e->nat_addr : k->saddr;
	struct ekp_addr *a = ekp_addr_lookup(&ak);
	return a && (a->flags & EKP_ADDR_BACKEND);
}

enum ekp_ct_life {
	EKP_CT_LIVE = 0,
	EKP_CT_EXPIRED,   /* idle past the timeout of its state: a miss, overwritten later */
	EKP_CT_ABANDONED, /* TCP, its backend gone and silent past tcp_orphan_s: deleted when found */
};

/* Whether the entry `e` under `k` is alive (enum ekp_ct_life). An entry flagged ORPHAN, or idle
 * past tcp_orphan_s while its backend is unlisted, is abandoned tcp_orphan_s after its last
 * renewal (only the backend's packets renew an ORPHAN flow, see ekp_ct_refresh). */
static __always_inline int ekp_ct_life(const struct ekp_ct_entry *e, const struct ekp_ct_key *k,
				       const struct ekp_config *cfg, __u64 now)
{
	__s64 age = ekp_age_ns(now, e->last_seen_ns);

	if (k->proto == IPPROTO_TCP && age > (__s64)ekp_ct_orphan_ns(cfg) &&
	    ((e->flags & EKP_CT_ORPHAN) || !ekp_ct_backend_listed(e, k)))
		return EKP_CT_ABANDONED;
	if (age > (__s64)ekp_ct_timeout_ns(cfg, k->proto, e->flags))
		return EKP_CT_EXPIRED;
	return EKP_CT_LIVE;
}

/* Stamps both endpoints of the flow stored as `e` under `k` in ekp_act (see ekp_act.h): its
 * frontend, and its backend (the FORWARD entry's rewrite, the REPLY key's source). */
static __always_inline void ekp_ct_stamp_flow(const struct ekp_ct_entry *e, const struct ekp_ct_key *k, __u64 now)
{
	__u32 t = ekp_act_stamp_of(now);

	ekp_act_stamp(e->fe_addr, e->fe_port, k->proto, t);
	if (k->dir == EKP_CT_FORWARD)
		ekp_act_stamp(e->nat_addr, e->nat_port, k->proto, t);
	else
		ekp_act_stamp(k->saddr, k->sport, k->proto, t);
}

/* Renews the entry `e` under `k` at `now`: its last_seen_ns, and its flow's endpoints in ekp_act. */
static __always_inline void ekp_ct_stamp(struct ekp_ct_entry *e, const struct ekp_ct_key *k, __u64 now)
{
	e->last_seen_ns = now;
	ekp_ct_stamp_flow(e, k, now);
}

static __always_inline int ekp_pure_syn(const struct ekp_pkt *p)
{
	return p->proto == IPPROTO_TCP && (p->tcp_flags & (EKP_TCP_SYN | EKP_TCP_ACK)) == EKP_TCP_SYN;
}

/* Whether a packet that claims no conntrack entry and no frontend opens a flow of its own, whose
 * reply tuple a translated flow may hold (ekp_ct_reclaim): a TCP SYN (without ACK), an SCTP INIT
 * (what starts an association, as for a frontend: ekp_decide.h), or a UDP datagram, whole or its
 * first fragment (the later ones follow the entry it leaves). UDP has no handshake: any datagram
 * without an entry is one nf_conntrack starts a flow with. */
static __always_inline int ekp_opens_flow(const struct ekp_pkt *p)
{
	if (p->frag == EKP_FRAG_LATER)
		return 0;
	if (p->proto == IPPROTO_UDP)
		return 1;
	if (p->proto == IPPROTO_SCTP)
		return p->chunk == EKP_SCTP_CID_INIT;
	return ekp_pure_syn(p);
}

static __always_inline void ekp_ct_key_of(struct ekp_ct_key *k, const struct ekp_pkt *p, __u8 dir)
{
	k->saddr = p->saddr;
	k->daddr = p->daddr;
	k->sport = p->sport;
	k->dport = p->dport;
	k->proto = p->proto;
	k->dir = dir;
}

/* The key of the other entry of the flow that stores `e` under `k`. */
static __always_inline void ekp_ct_twin_key(struct ekp_ct_key *t, const struct ekp_ct_key *k,
					    const struct ekp_ct_entry *e)
{
	int snat = e->flags & EKP_CT_SNAT;

	t->proto = k->proto;
	if (k->dir == EKP_CT_FORWARD) {
		t->dir = EKP_CT_REPLY;
		t->saddr = e->nat_addr;
		t->sport = e->nat_port;
		t->daddr = snat ? e->snat_addr : k->saddr;
		t->dport = snat ? e->snat_port : k->sport;
	} else {
		t->dir = EKP_CT_FORWARD;
		t->saddr = snat ? e->nat_addr : k->daddr;
		t->sport = snat ? e->nat_port : k->dport;
		t->daddr = e->fe_addr;
		t->dport = e->fe_port;
	}
}

/* The twin's value, rebuilt from `e` stored under `k` (the state and times are shared). */
static __always_inline void ekp_ct_twin_value(struct ekp_ct_entry *t, const struct ekp_ct_key *k,
					      const struct ekp_ct_entry *e)
{
	int snat = e->flags & EKP_CT_SNAT;

	*t = *e;
	if (k->dir == EKP_CT_FORWARD) { /* build the REPLY entry */
		t->nat_addr = snat ? k->saddr : 0;
		t->nat_port = snat ? k->sport : 0;
		t->snat_addr = 0;
		t->snat_port = 0;
	} else { /* build the FORWARD entry */
		t->nat_addr = k->saddr;
		t->nat_port = k->sport;
		t->snat_addr = snat ? k->daddr : 0;
		t->snat_port = snat ? k->dport : 0;
	}
}

/* The part of the twin test both families share (ekp_ct_is_twin, IPv6's ekp_ct6_is_twin): the two
 * entries serve the same frontend (its address compared by the caller, `same_fe_addr`) and backend,
 * with the same source translation. A later flow that took the twin key differs here. */
#define EKP_CT_SAME_FLOW(t, e, same_fe_addr)                                                   \
	((same_fe_addr) && (t)->fe_port == (e)->fe_port && (t)->backend_id == (e)->backend_id && \
	 ((t)->flags & EKP_CT_SNAT) == ((e)->flags & EKP_CT_SNAT))

/* Whether `t` stored under `tk` is the twin of `e` stored under `k` (not a later flow that took
 * the key): its own twin key is `k`, and it serves the same frontend and backend. */
static __always_inline int ekp_ct_is_twin(const struct ekp_ct_entry *t, const struct ekp_ct_key *tk,
					  const struct ekp_ct_entry *e, const struct ekp_ct_key *k)
{
	struct ekp_ct_key back = {};

	if (!EKP_CT_SAME_FLOW(t, e, t->fe_addr == e->fe_addr))
		return 0;
	ekp_ct_twin_key(&back, tk, t);
	return back.saddr == k->saddr && back.daddr == k->daddr && back.sport == k->sport &&
	       back.dport == k->dport && back.dir == k->dir;
}

/* The twin of `e` under `k` when it is there and still its twin, else NULL. */
static __always_inline struct ekp_ct_entry *ekp_ct_twin(const struct ekp_ct_entry *e, const struct ekp_ct_key *k)
{
	struct ekp_ct_key tk = {};

	ekp_ct_twin_key(&tk, k, e);
	struct ekp_ct_entry *t = ekp_ct_lookup(&tk);
	if (t && ekp_ct_is_twin(t, &tk, e, k))
		return t;
	return NULL;
}

/* Sets `set` and clears `clear` on the entry `e` under `k` and on its twin (left alone if absent). */
static __always_inline void ekp_ct_mark(struct ekp_ct_entry *e, const struct ekp_ct_key *k, __u16 set,
					__u16 clear)
{
	e->flags = (e->flags | set) & ~clear;
	struct ekp_ct_entry *t = ekp_ct_twin(e, k);
	if (t)
		t->flags = (t->flags | set) & ~clear;
}

/* Deletes the twin of `e` under `k` when it is still its twin. */
static __always_inline void ekp_ct_delete_twin(const struct ekp_ct_entry *e, const struct ekp_ct_key *k)
{
	struct ekp_ct_key tk = {};

	ekp_ct_twin_key(&tk, k, e);
	struct ekp_ct_entry *t = ekp_ct_lookup(&tk);
	if (t && ekp_ct_is_twin(t, &tk, e, k))
		ekp_ct_delete(&tk);
}

/* A TCP flow's ORPHAN flag follows its backend (listed or not), checked at each refresh. Returns
 * whether this packet renews the entry: not a client's packet on an ORPHAN flow (only the backend
 * renews it then, its FORWARD twin included). */
static __always_inline int ekp_ct_follow_backend(struct ekp_ct_entry *e, const struct ekp_ct_key *k, __u64 now)
{
	if (k->proto != IPPROTO_TCP)
		return 1;
	int listed = ekp_ct_backend_listed(e, k);
	int orphan = (e->flags & EKP_CT_ORPHAN) != 0;

	if (listed && orphan)
		ekp_ct_mark(e, k, 0, EKP_CT_ORPHAN);
	else if (!listed && !orphan)
		ekp_ct_mark(e, k, EKP_CT_ORPHAN, 0);
	if (listed)
		return 1;
	if (k->dir == EKP_CT_FORWARD)
		return 0;
	struct ekp_ct_entry *t = ekp_ct_twin(e, k);
	if (t)
		t->last_seen_ns = now; /* the backend answered: the client's entry lives on too */
	return 1;
}

/* Once a second per entry: refresh last_seen (ekp_ct_follow_backend says whether), re-create a
 * missing twin. Returns 1 when the twin was rebuilt. */
static __always_inline int ekp_ct_refresh(struct ekp_ct_entry *e, const struct ekp_ct_key *k, __u64 now)
{
	if (ekp_age_ns(now, e->last_seen_ns) <= (__s64)EKP_CT_REFRESH_NS)
		return 0;
	if (!ekp_ct_follow_backend(e, k, now))
		return 0;
	ekp_ct_stamp(e, k, now);

	struct ekp_ct_key tk = {};
	ekp_ct_twin_key(&tk, k, e);
	if (ekp_ct_lookup(&tk))
		return 0; /* present (ours, or a later flow's: then not ours to replace) */
	struct ekp_ct_entry twin;
	ekp_ct_twin_value(&twin, k, e);
	return ekp_ct_insert(&tk, &twin) == 0;
}

/* ---- using a hit -------------------------------------------------------------------------- */

/* Whether the entry `e` found under `k` is alive (ekp_ct_life). An abandoned flow (ORPHAN, its
 * backend silent past tcp_orphan_s) is deleted here, both entries: its SNAT port is free again and
 * `agent inspect conntrack` no longer lists it. */
static __always_inline int ekp_ct_alive(struct ekp_ct_entry *e, struct ekp_ct_key *k, const struct ekp_config *cfg,
					__u64 now)
{
	int life = ekp_ct_life(e, k, cfg, now);

	if (life == EKP_CT_ABANDONED) {
		ekp_ct_delete_twin(e, k);
		ekp_ct_delete(k);
	}
	return life == EKP_CT_LIVE;
}

/* Whether a live FORWARD hit may translate this packet. Not for a TCP SYN (without ACK) on a flow
 * that saw a FIN or RST: the client reusing its port is a new flow and a new backend choice, as
 * nf_conntrack does. UDP flows follow their backend's membership: kube-proxy deletes the
 * conntrack entries of a UDP endpoint that left the service, so a resolver that keeps its source
 * port moves on (TCP and SCTP flows keep their backend, as with kube-proxy: a terminating pod
 * finishes its connections, a Service deleted and recreated keeps its streams).
 * ekp_ct_syn_reopens is its TCP half, for conntrack entries of another layout (ekp_tc6.h). */
static __always_inline int ekp_ct_syn_reopens(__u16 flags, const struct ekp_pkt *p)
{
	return p->proto == IPPROTO_TCP && ekp_pure_syn(p) && (flags & EKP_CT_ENDING);
}

static __always_inline int ekp_ct_usable_forward(const struct ekp_ct_entry *e, const struct ekp_pkt *p)
{
	if (p->proto == IPPROTO_TCP)
		return !ekp_ct_syn_reopens(e->flags, p);
	if (p->proto != IPPROTO_UDP)
		return 1; /* SCTP keeps its backend: kube-proxy clears the conntrack of UDP alone */
	if (!e->svc_id || !e->backend_id)
		return 1; /* a remapped direct flow: no service to be a member of */

	struct ekp_member_key mk = {};
	mk.svc_id = e->svc_id;
	mk.backend_id = e->backend_id;
	struct ekp_member *m = ekp_member_lookup(&mk);
	return m && m->flags;
}

/* Whether a live FORWARD hit belongs to a flow being handed over (EKP_CT_HANDOVER): taken over
 * from nf_conntrack, to a backend on the node's own address, whose NAT entry in the kernel the
 * agent has not replaced yet. Translated now, the packet would reach the node's stack as a flow
 * whose reply tuple that entry holds; the stack's NAT would give it another source port and the
 * backend's socket would answer with a RST. Dropped instead (the sender retransmits), until the
 * agent clears the flag, or EKP_CT_HANDOVER_S after the entry was made should it never come. */
static __always_inline int ekp_ct_handing_over(const struct ekp_ct_entry *e, __u64 now)
{
	return (e->flags & EKP_CT_HANDOVER) && (__u32)(now / EKP_NSEC) - e->created_s < EKP_CT_HANDOVER_S;
}

/* Whether a live REPLY hit may translate this packet: no SYN-ACK on a flow that saw a FIN or RST:
 * that answers some other connection on the tuple (a direct connection from the client's old
 * port, see ekp_ct_reclaim), passes untranslated and does not refresh the entry. */
static __always_inline int ekp_ct_usable_reply(const struct ekp_ct_entry *e, const struct ekp_pkt *p)
{
	return !(p->proto == IPPROTO_TCP && (p->tcp_flags & EKP_TCP_SYN) && (e->flags & EKP_CT_ENDING));
}

/* The state a packet moves its flow to (flags to add to both entries), 0 when none. */
static __always_inline __u16 ekp_ct_transition(const struct ekp_ct_entry *e, const struct ekp_pkt *p, __u8 dir,
					       __u64 now)
{
	__u16 set = 0, f = e->flags;

	if (dir == EKP_CT_REPLY)
		set |= EKP_CT_SEEN_REPLY;
	if (p->proto == IPPROTO_TCP) {
		if (p->tcp_flags & EKP_TCP_RST)
			set |= EKP_CT_RST;
		if (p->tcp_flags & EKP_TCP_FIN)
			set |= dir == EKP_CT_FORWARD ? EKP_CT_FIN_FWD : EKP_CT_FIN_REPLY;
		/* The client's ACK of the backend's SYN-ACK completes the handshake. */
		if (dir == EKP_CT_FORWARD && (f & EKP_CT_SEEN_REPLY) && (p->tcp_flags & EKP_TCP_ACK) &&
		    !(p->tcp_flags & EKP_TCP_SYN))
			set |= EKP_CT_ESTABLISHED;
	} else if ((f & EKP_CT_SEEN_REPLY) && (__u32)(now / EKP_NSEC) - e->created_s >= EKP_UDP_STREAM_AFTER_S) {
		set |= EKP_CT_ESTABLISHED;
	}
	return set & ~f;
}

/* ---- new flows ---------------------------------------------------------------------------- */

/* A hash of a flow's tuple (Maglev's table position, where the SNAT port walk starts). IPv6 passes
 * its addresses folded to 32 bits (ekp_fold6). */
static __always_inline __u32 ekp_tuple_hash(__be32 saddr, __be32 daddr, __be16 sport, __be16 dport, __u8 proto)
{
	__u32 h = saddr * 0x9e3779b1u;

	h ^= daddr + 0x7f4a7c15u + (h << 6) + (h >> 2);
	h ^= ((__u32)sport << 16 | dport) + 0x7f4a7c15u + (h << 6) + (h >> 2);
	h ^= proto;
	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return h;
}

static __always_inline __u32 ekp_flow_hash(const struct ekp_pkt *p)
{
	return ekp_tuple_hash(p->saddr, p->daddr, p->sport, p->dport, p->proto);
}

/* Whether the entry `e` under `k`, holding a reply tuple a new flow wants, may be taken over:
 * dead (expired or abandoned), or a TCP flow that closed while the newcomer is a SYN (the kernel's
 * NAT takes a TIME_WAIT tuple the same way, nf_nat_used_tuple_harder). */
static __always_inline int ekp_ct_reusable(const struct ekp_ct_entry *e, const struct ekp_ct_key *k,
					   const struct ekp_pkt *p, const struct ekp_config *cfg, __u64 now)
{
	if (ekp_ct_life(e, k, cfg, now) != EKP_CT_LIVE)
		return 1;
	return ekp_pure_syn(p) && ekp_ct_closed(e->flags);
}

#include "ekp_snat.h"

/* Writes a new flow's entry under `k`. When the entry there already translates exactly the same
 * way (the tuple of an ended flow reused for the same backend, the common case of a busy client:
 * its ports come round again while the last flow on them is still closing), only the state and
 * times are rewritten in place, which a concurrent reader may see in either order. Any other
 * entry is replaced by a map update: an LRU map update takes a new node and frees the old one,
 * ~2 us more per connect() in the bench when both entries of every flow were replaced. */
static __always_inline int ekp_ct_write(struct ekp_ct_key *k, struct ekp_ct_entry *v)
{
	struct ekp_ct_entry *old = ekp_ct_lookup(k);

	if (old && old->nat_addr == v->nat_addr && old->nat_port == v->nat_port && old->snat_addr == v->snat_addr &&
	    old->snat_port == v->snat_port && old->fe_addr == v->fe_addr && old->fe_port == v->fe_port &&
	    old->backend_id == v->backend_id && old->svc_id == v->svc_id &&
	    (old->flags & EKP_CT_SNAT) == (v->flags & EKP_CT_SNAT)) {
		old->last_seen_ns = v->last_seen_ns;
		old->created_s = v->created_s;
		old->flags = v->flags;
		return 0;
	}
	return ekp_ct_update(k, v);
}

/* Puts the REPLY entry `rent` under `rkey`. A free tuple is claimed with BPF_NOEXIST (another CPU
 * may have taken it since the lookup: the packet drops then, its retransmission tries again); an
 * entry of another flow there (dead, or early-dropped) is replaced and its twin deleted; an entry
 * of this very tuple's earlier flow (same frontend, same client) is rewritten (in place when it
 * translates the same), its FORWARD twin being the key the new flow writes next. */
static __always_inline int ekp_ct_place(struct ekp_ct_key *rkey, struct ekp_ct_entry *rent)
{
	struct ekp_ct_entry *old = ekp_ct_lookup(rkey);

	if (!old)
		return ekp_ct_insert(rkey, rent) == 0 ? 0 : EKP_DROP_SNAT_PORTS;
	if (old->fe_addr != rent->fe_addr || old->fe_port != rent->fe_port ||
	    (old->flags & EKP_CT_SNAT) != (rent->flags & EKP_CT_SNAT) || old->nat_addr != rent->nat_addr ||
	    old->nat_port != rent->nat_port)
		ekp_ct_delete_twin(old, rkey);
	return ekp_ct_write(rkey, rent) == 0 ? 0 : EKP_DROP_CT_FULL;
}

/* Inserts the REPLY then the FORWARD entry of a new flow (a reply can never beat its entry).
 * Source-translated flows (EKP_CT_SNAT) get a port from the SNAT range. An untranslated flow
 * whose reply tuple is held by a live flow of another frontend (one client port reaching one
 * backend through two frontends; a direct connection on a live flow's tuple) keeps its client
 * address but gets another source port (EKP_STAT_PORT_REMAP), as the kernel's NAT would: a
 * hijacked reply is never an option. Returns 0 or a drop reason. */
static __always_inline int ekp_ct_create(const struct ekp_pkt *p, struct ekp_flow *f, const struct ekp_config *cfg,
					 __u64 now)
{
	struct ekp_ct_key rkey = {};
	struct ekp_ct_entry rent = {};
	int reason;

	rkey.saddr = f->be_addr;
	rkey.sport = f->be_port;
	rkey.proto = p->proto;
	rkey.dir = EKP_CT_REPLY;

	if (!(f->ct_flags & EKP_CT_SNAT)) {
		rkey.daddr = p->saddr;
		rkey.dport = p->sport;
		struct ekp_ct_entry *old = ekp_ct_lookup(&rkey);
		/* Taken by a live flow of another frontend: keep the client's address, move its port. */
		if (old && (old->fe_addr != f->fe_addr || old->fe_port != f->fe_port || (old->flags & EKP_CT_SNAT)) &&
		    !ekp_ct_reusable(old, &rkey, p, cfg, now)) {
			f->ct_flags |= EKP_CT_SNAT;
			f->remapped = 1;
			f->snat_addr = p->saddr;
		}
	} else if (!f->remapped) { /* a remapped direct connection keeps its own address */
		f->snat_addr = cfg->node_addr;
		if (!f->snat_addr)
			return EKP_DROP_SNAT_PORTS;
	}
	if (f->ct_flags & EKP_CT_SNAT) {
		rkey.daddr = f->snat_addr;
		reason = ekp_snat_find(&rkey, p, cfg, now, f);
		if (reason)
			return reason;
		f->snat_port = rkey.dport;
		rent.nat_addr = p->saddr;
		rent.nat_port = p->sport;
	}
	rent.last_seen_ns = now;
	rent.created_s = now / EKP_NSEC;
	rent.fe_addr = f->fe_addr;
	rent.fe_port = f->fe_port;
	rent.svc_id = f->svc_id;
	rent.backend_id = f->backend_id;
	rent.flags = f->ct_flags;
	ekp_ct_stamp_flow(&rent, &rkey, now); /* before the entries: no packet of the flow leaves before */
	reason = ekp_ct_place(&rkey, &rent);
	if (reason)
		return reason;

	/* The FORWARD entry: the REPLY one rebuilt from its own key (ekp_ct_twin_value). */
	struct ekp_ct_key fkey = {};
	ekp_ct_key_of(&fkey, p, EKP_CT_FORWARD);
	ekp_ct_twin_value(&rent, &rkey, &rent);
	if (ekp_ct_write(&fkey, &rent)) {
		ekp_ct_delete(&rkey);
		return EKP_DROP_CT_FULL;
	}
	return 0;
}

/* ---- a direct connection on a translated flow's tuple ------------------------------------ */

enum ekp_reclaim {
	EKP_RECLAIM_NONE = 0, /* no flow of ours holds the tuple, or a stale one was cleared */
	EKP_RECLAIM_LIVE = 1, /* a live translated flow holds it: the newcomer needs another port */
};

/* A packet that opens a flow of its own (ekp_opens_flow: a TCP SYN, an SCTP INIT, a UDP datagram)
 * and is no service flow (it missed conntrack and the frontends), client:P -> server:port, may
 * reuse the tuple of a translated flow seen from the server's side: the flow client:P -> frontend
 * -> server:port left the REPLY entry {server, client, port, P} (on this node, while the newcomer's
 * own frontend was translated on another: a pod's ClusterIP there, the same server here through
 * this node's NodePort). If that flow has ended (the REPLY entry expired or closing, or its FORWARD
 * twin taken by another flow, expired or closing), its REPLY entry would reverse-translate
 * the newcomer's answers to come from the frontend: both entries are deleted. If it is live, the
 * server holds a flow on this very 4-tuple, which the newcomer cannot share: the caller gives the
 * newcomer another source port (*held_by gets the live flow's flags), as nf_nat's unique tuple
 * does. For UDP "live" is nf_conntrack's: not expired (udp_s unreplied, udp_stream_s a stream),
 * answered or not: nf_nat takes over a tuple in use only for a TCP SYN on a closing flow
 * (nf_nat_used_tuple_harder), so a UDP flow keeps its tuple until it times out and the newcomer
 * moves; an SCTP INIT on a live association's tuple moves the same way. One lookup per such SYN,
 * INIT or datagram whose destination a live flow stamped (ekp_act.h), a miss unless the tuple was
 * used before. */
static __always_inline int ekp_ct_reclaim(const struct ekp_pkt *p, const struct ekp_config *cfg, __u64 now,
					  __u16 *held_by)
{
	struct ekp_ct_key rkey = {};

	/* A REPLY entry is keyed by its backend, which every write of the entry stamps (ekp_act.h): a
	 * destination no live flow stamped is no live flow's backend, and an expired entry on it
	 * translates nothing. An array load instead of a hash lookup for what a direct flow's server
	 * sends (a UDP answer misses conntrack as its request did; the request's destination, the
	 * backend, is the stamped end). */
	if (ekp_act_armed() &&
	    ekp_act_idle(p->daddr, p->dport, p->proto, ekp_act_stamp_of(now), ekp_ct_longest_stamps(cfg, p->proto)))
		return EKP_RECLAIM_NONE;
	rkey.saddr = p->daddr;
	rkey.daddr = p->saddr;
	rkey.sport = p->dport;
	rkey.dport = p->sport;
	rkey.proto = p->proto;
	rkey.dir = EKP_CT_REPLY;
	struct ekp_ct_entry *rp = ekp_ct_lookup(&rkey);
	if (!rp)
		return EKP_RECLAIM_NONE;
	int stale = (rp->flags & EKP_CT_ENDING) || ekp_ct_life(rp, &rkey, cfg, now) != EKP_CT_LIVE;
	int twin = 0;
	struct ekp_ct_key fkey = {};

	ekp_ct_twin_key(&fkey, &rkey, rp);
	struct ekp_ct_entry *fp = ekp_ct_lookup(&fkey);
	if (fp && ekp_ct_is_twin(fp, &fkey, rp, &rkey)) {
		twin = 1;
		if ((fp->flags & EKP_CT_ENDING) || ekp_ct_life(fp, &fkey, cfg, now) != EKP_CT_LIVE)
			stale = 1;
	} else if (fp) {
		stale = 1; /* its twin key is another flow's now: this one ended */
	}
	/* No twin at all: evicted by the LRU, most likely from a live flow (its next packet rebuilds
	 * it, ekp_ct_refresh). Moving the newcomer is right either way; clearing would hand a live
	 * flow's tuple to it. */
	if (!stale) {
		*held_by = rp->flags;
		return EKP_RECLAIM_LIVE;
	}
	ekp_ct_delete(&rkey);
	if (twin)
		ekp_ct_delete(&fkey);
	return EKP_RECLAIM_NONE;
}

#endif /* EKP_CT_H */
