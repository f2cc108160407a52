/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_ct_af.h: conntrack's per-family code (lookups, twins, refresh, orphans, create with a port
 * remapped on a reply-tuple clash, reclaim), written once and included twice: by ekp_ct.h with
 * EKP_CT_V6 0 (IPv4: ekp_ct_*, struct ekp_ct_key / ekp_ct_entry, struct ekp_pkt / ekp_flow) and by
 * ekp_ct6.h with EKP_CT_V6 1 (IPv6: ekp_ct6_*, struct ekp_ct6_key / ekp_ct6_entry, struct ekp_pkt6
 * / ekp_flow6). See ekp_ct.h for what conntrack does; this file only says it once for both.
 *
 * Why a template, not functions taking the family as an `int v6` (ekp_lb.h's _af functions): a
 * key or entry of either family would be a `void *` with every field read through a cast, and
 * every address a pointer even for IPv4, whose scalar compares and copies then depend on the
 * optimiser to come back as they were. Here the IPv4 instance is, after the preprocessor, the very
 * text it was (the address macros below expand to `a == b`, `d = s`, `d = c ? s : 0`), and its
 * compiled programs are the same instructions, byte for byte (bpf/README.md, "One conntrack for
 * both families", says how that was checked).
 *
 * Names: ekp_ct_x is ekp_ct_x / ekp_ct6_x, ekp_snat_x ekp_snat_x / ekp_snat6_x. Types:
 * key, entry, EKP_PKT (a packet of the family; EKP_PB(p) its struct ekp_pkt: ports,
 * protocol, flags), EKP_FLOW (a new flow; EKP_FB(f) its struct ekp_flow: ids, ports, flags, the
 * SNAT port the walk chose; the walk's own state is struct ekp_snat_state, in per-CPU scratch:
 * ekp_snat_af.h). An address field has the same name in both families, `__be32` or `__be32[4]`:
 * EKP_A_EQ(a, b), EKP_A_SET(d, s), EKP_A_ZERO(d), EKP_A_SEL(d, c, s) (d = c ? s : zero),
 * EKP_A_SEL2(d, c, s, t) (d = c ? s : t), EKP_A_FOLD(a) (the 32 bits ekp_act stamps): all of
 * them in ekp_def_af.h, undefined again by ekp_undef_af.h. ekp_ctq_af.h (the early-drop rings) and
 * ekp_snat_af.h (the SNAT port walk) are written the same way.
 *
 * No include guard: included once per family.
 */
#include "ekp_def_af.h"

static __always_inline int EKP_CTF(expired)(const EKP_CT_ENTRY *e, const struct ekp_config *cfg,
					  __u8 proto, __u64 now)
{
	/* another CPU may have refreshed it after we read the clock: a negative age, not expired */
	return ekp_age_ns(now, e->last_seen_ns) > (__s64)ekp_ct_timeout_ns(cfg, proto, e->flags);
}

static __always_inline int EKP_CTF(backend_listed)(const EKP_CT_ENTRY *e, const EKP_CT_KEY *k)
{
	EKP_ADDR_KEY ak = {};

	if (!e->svc_id)
		return 1;
	EKP_A_SEL2(ak.addr, k->dir == EKP_CT_FORWARD, e->nat_addr, k->saddr);
	struct ekp_addr *a = EKP_ADDR_LOOKUP(&ak);
	return a && (a->flags & EKP_ADDR_BACKEND);
}

/* Whether the entry `e` under `k` is alive (enum ekp_ct_life). An entry flagged ORPHAN, or idle
 * past tcp_orphan_s while its backend is unlisted, is abandoned tcp_orphan_s after its last
 * renewal (only the backend's packets renew an ORPHAN flow, see ekp_ct_refresh). */
static __always_inline int EKP_CTF(life)(const EKP_CT_ENTRY *e, const EKP_CT_KEY *k,
				       const struct ekp_config *cfg, __u64 now)
{
	__s64 age = ekp_age_ns(now, e->last_seen_ns);

	if (k->proto == IPPROTO_TCP && age > (__s64)ekp_ct_orphan_ns(cfg) &&
	    ((e->flags & EKP_CT_ORPHAN) || !EKP_CTF(backend_listed)(e, k)))
		return EKP_CT_ABANDONED;
	if (age > (__s64)ekp_ct_timeout_ns(cfg, k->proto, e->flags))
		return EKP_CT_EXPIRED;
	return EKP_CT_LIVE;
}

/* Stamps both endpoints of the flow stored as `e` under `k` in ekp_act (see ekp_act.h): its
 * frontend, and its backend (the FORWARD entry's rewrite, the REPLY key's source). */
static __always_inline void EKP_CTF(stamp_flow)(const EKP_CT_ENTRY *e, const EKP_CT_KEY *k, __u64 now)
{
	__u32 t = ekp_act_stamp_of(now);

	ekp_act_stamp(EKP_A_FOLD(e->fe_addr), e->fe_port, k->proto, t);
	if (k->dir == EKP_CT_FORWARD)
		ekp_act_stamp(EKP_A_FOLD(e->nat_addr), e->nat_port, k->proto, t);
	else
		ekp_act_stamp(EKP_A_FOLD(k->saddr), k->sport, k->proto, t);
}

/* Renews the entry `e` under `k` at `now`: its last_seen_ns, and its flow's endpoints in ekp_act. */
static __always_inline void EKP_CTF(stamp)(EKP_CT_ENTRY *e, const EKP_CT_KEY *k, __u64 now)
{
	e->last_seen_ns = now;
	EKP_CTF(stamp_flow)(e, k, now);
}

static __always_inline void EKP_CTF(key_of)(EKP_CT_KEY *k, const EKP_PKT *p, __u8 dir)
{
	EKP_A_SET(k->saddr, p->saddr);
	EKP_A_SET(k->daddr, p->daddr);
	k->sport = EKP_PB(p)->sport;
	k->dport = EKP_PB(p)->dport;
	k->proto = EKP_PB(p)->proto;
	k->dir = dir;
}

/* The key of the other entry of the flow that stores `e` under `k`. */
static __always_inline void EKP_CTF(twin_key)(EKP_CT_KEY *t, const EKP_CT_KEY *k,
					    const EKP_CT_ENTRY *e)
{
	int snat = e->flags & EKP_CT_SNAT;

	t->proto = k->proto;
	if (k->dir == EKP_CT_FORWARD) {
		t->dir = EKP_CT_REPLY;
		EKP_A_SET(t->saddr, e->nat_addr);
		t->sport = e->nat_port;
		EKP_A_SEL2(t->daddr, snat, e->snat_addr, k->saddr);
		t->dport = snat ? e->snat_port : k->sport;
	} else {
		t->dir = EKP_CT_FORWARD;
		EKP_A_SEL2(t->saddr, snat, e->nat_addr, k->daddr);
		t->sport = snat ? e->nat_port : k->dport;
		EKP_A_SET(t->daddr, e->fe_addr);
		t->dport = e->fe_port;
	}
}

/* The twin's value, rebuilt from `e` stored under `k` (the state and times are shared). */
static __always_inline void EKP_CTF(twin_value)(EKP_CT_ENTRY *t, const EKP_CT_KEY *k,
					      const EKP_CT_ENTRY *e)
{
	int snat = e->flags & EKP_CT_SNAT;

	*t = *e;
	if (k->dir == EKP_CT_FORWARD) { /* build the REPLY entry */
		EKP_A_SEL(t->nat_addr, snat, k->saddr);
		t->nat_port = snat ? k->sport : 0;
		EKP_A_ZERO(t->snat_addr);
		t->snat_port = 0;
	} else { /* build the FORWARD entry */
		EKP_A_SET(t->nat_addr, k->saddr);
		t->nat_port = k->sport;
		EKP_A_SEL(t->snat_addr, snat, k->daddr);
		t->snat_port = snat ? k->dport : 0;
	}
}

/* Whether `t` stored under `tk` is the twin of `e` stored under `k` (not a later flow that took
 * the key): its own twin key is `k`, and it serves the same frontend and backend. */
static __always_inline int EKP_CTF(is_twin)(const EKP_CT_ENTRY *t, const EKP_CT_KEY *tk,
					  const EKP_CT_ENTRY *e, const EKP_CT_KEY *k)
{
	EKP_CT_KEY back = {};

	if (!EKP_A_EQ(t->fe_addr, e->fe_addr) || t->fe_port != e->fe_port || t->backend_id != e->backend_id ||
	    (t->flags & EKP_CT_SNAT) != (e->flags & EKP_CT_SNAT))
		return 0;
	EKP_CTF(twin_key)(&back, tk, t);
	return EKP_A_EQ(back.saddr, k->saddr) && EKP_A_EQ(back.daddr, k->daddr) && back.sport == k->sport &&
	       back.dport == k->dport && back.dir == k->dir;
}

/* The twin of `e` under `k` when it is there and still its twin, else NULL. */
static __always_inline EKP_CT_ENTRY *EKP_CTF(twin)(const EKP_CT_ENTRY *e, const EKP_CT_KEY *k)
{
	EKP_CT_KEY tk = {};

	EKP_CTF(twin_key)(&tk, k, e);
	EKP_CT_ENTRY *t = EKP_CTF(lookup)(&tk);
	if (t && EKP_CTF(is_twin)(t, &tk, e, k))
		return t;
	return NULL;
}

/* Sets `set` and clears `clear` on the entry `e` under `k` and on its twin (left alone if absent). */
static __always_inline void EKP_CTF(mark)(EKP_CT_ENTRY *e, const EKP_CT_KEY *k, __u16 set,
					__u16 clear)
{
	e->flags = (e->flags | set) & ~clear;
	EKP_CT_ENTRY *t = EKP_CTF(twin)(e, k);
	if (t)
		t->flags = (t->flags | set) & ~clear;
}

/* Deletes the twin of `e` under `k` when it is still its twin. */
static __always_inline void EKP_CTF(delete_twin)(const EKP_CT_ENTRY *e, const EKP_CT_KEY *k)
{
	EKP_CT_KEY tk = {};

	EKP_CTF(twin_key)(&tk, k, e);
	EKP_CT_ENTRY *t = EKP_CTF(lookup)(&tk);
	if (t && EKP_CTF(is_twin)(t, &tk, e, k))
		EKP_CTF(delete)(&tk);
}

/* A TCP flow's ORPHAN flag follows its backend (listed or not), checked at each refresh. Returns
 * whether this packet renews the entry: not a client's packet on an ORPHAN flow (only the backend
 * renews it then, its FORWARD twin included). */
static __always_inline int EKP_CTF(follow_backend)(EKP_CT_ENTRY *e, const EKP_CT_KEY *k, __u64 now)
{
	if (k->proto != IPPROTO_TCP)
		return 1;
	int listed = EKP_CTF(backend_listed)(e, k);
	int orphan = (e->flags & EKP_CT_ORPHAN) != 0;

	if (listed && orphan)
		EKP_CTF(mark)(e, k, 0, EKP_CT_ORPHAN);
	else if (!listed && !orphan)
		EKP_CTF(mark)(e, k, EKP_CT_ORPHAN, 0);
	if (listed)
		return 1;
	if (k->dir == EKP_CT_FORWARD)
		return 0;
	EKP_CT_ENTRY *t = EKP_CTF(twin)(e, k);
	if (t)
		t->last_seen_ns = now; /* the backend answered: the client's entry lives on too */
	return 1;
}

/* Once a second per entry: refresh last_seen (ekp_ct_follow_backend says whether), re-create a
 * missing twin. Returns 1 when the twin was rebuilt, -1 when the entry was deleted (its twin key
 * holds another flow's): the caller must not translate from it, a deleted LRU element being
 * handed out again at once. */
static __always_inline int EKP_CTF(refresh)(EKP_CT_ENTRY *e, const EKP_CT_KEY *k, __u64 now)
{
	if (ekp_age_ns(now, e->last_seen_ns) <= (__s64)EKP_CT_REFRESH_NS)
		return 0;
	if (!EKP_CTF(follow_backend)(e, k, now))
		return 0;
	EKP_CTF(stamp)(e, k, now);

	EKP_CT_KEY tk = {};
	EKP_CTF(twin_key)(&tk, k, e);
	EKP_CT_ENTRY *t = EKP_CTF(lookup)(&tk);
	if (t) {
		/* Another flow's: this entry's flow is gone (a later flow took the twin key as this one
		 * ended; a FORWARD entry written as another CPU's new flow took its reply tuple,
		 * ekp_ct_create). It goes, rather than translate one side of a flow whose other side
		 * translates as another's. */
		if (!EKP_CTF(is_twin)(t, &tk, e, k)) {
			EKP_CTF(delete)(k);
			return -1;
		}
		return 0;
	}
	EKP_CT_ENTRY twin;
	EKP_CTF(twin_value)(&twin, k, e);
	return EKP_CTF(insert)(&tk, &twin) == 0;
}

/* ---- using a hit -------------------------------------------------------------------------- */

/* Whether the entry `e` found under `k` is alive (ekp_ct_life). An abandoned flow (ORPHAN, its
 * backend silent past tcp_orphan_s) is deleted here, both entries: its SNAT port is free again and
 * `agent inspect conntrack` no longer lists it. */
static __always_inline int EKP_CTF(alive)(EKP_CT_ENTRY *e, EKP_CT_KEY *k, const struct ekp_config *cfg,
					__u64 now)
{
	int life = EKP_CTF(life)(e, k, cfg, now);

	if (life == EKP_CT_ABANDONED) {
		EKP_CTF(delete_twin)(e, k);
		EKP_CTF(delete)(k);
	}
	return life == EKP_CT_LIVE;
}

static __always_inline int EKP_CTF(usable_forward)(const EKP_CT_ENTRY *e, const struct ekp_pkt *p)
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
	struct ekp_member *m = EKP_MEMBER_LOOKUP(&mk);
	return m && m->flags;
}

/* What of a live hit's flow is still nf_conntrack's (EKP_CT_NFPASS, EKP_CT_HANDOVER: a flow taken
 * over from it that meets the node's stack between its translations, legacy host routing or a
 * backend on the node's own address), 0 when nothing. NFPASS: the kernel's NAT entry for the flow
 * still translates it, so a packet of either direction passes untranslated and the stack treats it
 * as before the attach. HANDOVER: the agent is replacing that entry by the plain one; a forward
 * packet translated now would reach the stack as a flow whose reply tuple the NAT entry holds, and
 * the stack's NAT would give it another source port (which the backend resets), and one passed
 * untranslated could find no entry left: dropped (the sender retransmits). Either holds until the
 * agent clears it, or EKP_CT_HANDOVER_S after the entry was made should it never come. */
static __always_inline __u16 EKP_CTF(nf_held)(const EKP_CT_ENTRY *e, __u64 now)
{
	__u16 held = e->flags & (EKP_CT_NFPASS | EKP_CT_HANDOVER);

	if (held && (__u32)(now / EKP_NSEC) - e->created_s >= EKP_CT_HANDOVER_S)
		return 0;
	return held;
}

/* Whether a live REPLY hit may translate this packet: no SYN-ACK on a flow that saw a FIN or RST:
 * that answers some other connection on the tuple (a direct connection from the client's old
 * port, see ekp_ct_reclaim), passes untranslated and does not refresh the entry. */
static __always_inline int EKP_CTF(usable_reply)(const EKP_CT_ENTRY *e, const struct ekp_pkt *p)
{
	return !(p->proto == IPPROTO_TCP && (p->tcp_flags & EKP_TCP_SYN) && (e->flags & EKP_CT_ENDING));
}

/* The state a packet moves its flow to (flags to add to both entries), 0 when none. */
static __always_inline __u16 EKP_CTF(transition)(const EKP_CT_ENTRY *e, const struct ekp_pkt *p, __u8 dir,
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

/* Whether the entry `e` under `k`, holding a reply tuple a new flow wants, may be taken over:
 * dead (expired or abandoned), or a TCP flow that closed while the newcomer is a SYN (the kernel's
 * NAT takes a TIME_WAIT tuple the same way, nf_nat_used_tuple_harder). */
static __always_inline int EKP_CTF(reusable)(const EKP_CT_ENTRY *e, const EKP_CT_KEY *k,
					   const struct ekp_pkt *p, const struct ekp_config *cfg, __u64 now)
{
	if (EKP_CTF(life)(e, k, cfg, now) != EKP_CT_LIVE)
		return 1;
	return ekp_pure_syn(p) && ekp_ct_closed(e->flags);
}

#include "ekp_snat_af.h"

/* Writes a new flow's entry under `k`. When the entry there already translates exactly the same
 * way (the tuple of an ended flow reused for the same backend, the common case of a busy client:
 * its ports come round again while the last flow on them is still closing), only the state and
 * times are rewritten in place, which a concurrent reader may see in either order. Any other
 * entry is replaced by a map update: an LRU map update takes a new node and frees the old one,
 * ~2 us more per connect() in the bench when both entries of every flow were replaced. */
static __always_inline int EKP_CTF(write)(EKP_CT_KEY *k, EKP_CT_ENTRY *v)
{
	EKP_CT_ENTRY *old = EKP_CTF(lookup)(k);

	if (old && EKP_A_EQ(old->nat_addr, v->nat_addr) && old->nat_port == v->nat_port &&
	    EKP_A_EQ(old->snat_addr, v->snat_addr) && old->snat_port == v->snat_port &&
	    EKP_A_EQ(old->fe_addr, v->fe_addr) && old->fe_port == v->fe_port &&
	    old->backend_id == v->backend_id && old->svc_id == v->svc_id &&
	    (old->flags & EKP_CT_SNAT) == (v->flags & EKP_CT_SNAT)) {
		old->last_seen_ns = v->last_seen_ns;
		old->created_s = v->created_s;
		old->flags = v->flags;
		return 0;
	}
	return EKP_CTF(update)(k, v);
}

/* Deletes the FORWARD entry under `tk` if its twin key is `rkey`: the other half of the flow that
 * held `rkey`, whose REPLY entry is gone. */
static __always_inline void EKP_CTF(delete_forward_of)(const EKP_CT_KEY *tk, const EKP_CT_KEY *rkey)
{
	EKP_CT_ENTRY *t = EKP_CTF(lookup)(tk);
	EKP_CT_KEY back = {};

	if (!t)
		return;
	EKP_CTF(twin_key)(&back, tk, t);
	if (EKP_A_EQ(back.saddr, rkey->saddr) && EKP_A_EQ(back.daddr, rkey->daddr) && back.sport == rkey->sport &&
	    back.dport == rkey->dport)
		EKP_CTF(delete)(tk);
}

#ifndef EKP_EEXIST
#define EKP_EEXIST 17 /* errno's EEXIST: a BPF_NOEXIST insert on a key that is there */
#endif

/* Inserts `rent` under `rkey` if free: 0, EKP_DROP_TUPLE_TAKEN when another CPU's flow is there
 * now, EKP_DROP_CT_FULL when the map could not take it (an LRU map out of free nodes: ENOMEM). */
static __always_inline int EKP_CTF(claim)(EKP_CT_KEY *rkey, EKP_CT_ENTRY *rent)
{
	int rc = EKP_CTF(insert)(rkey, rent);

	if (!rc)
		return 0;
	return rc == -EKP_EEXIST ? EKP_DROP_TUPLE_TAKEN : EKP_DROP_CT_FULL;
}

/* Puts the REPLY entry `rent` under `rkey`, the tuple the new flow was given (the SNAT walk's port,
 * or the client's own), which another CPU's new flow may have taken since it was chosen. So only
 * what the choice allowed is replaced, again checked here: an entry of this very tuple's earlier
 * flow (same frontend, same client: rewritten, in place when it translates the same, its FORWARD
 * twin being the key the new flow writes next); one that may be taken over (ekp_ct_reusable: dead,
 * or closed and the packet a SYN); with `early_drop` (the walk chose an unanswered holder), one
 * still unanswered. Such another flow's entry is deleted, the tuple claimed, free or freed, with
 * BPF_NOEXIST (of two CPUs claiming it, the second's insert fails), and then its FORWARD twin. Anything else
 * took the tuple since the choice: EKP_DROP_TUPLE_TAKEN, the packet drops and its retransmission's
 * walk finds the tuple taken and moves on (walking on here would verify the walk twice: over the
 * verifier budgets, bpf/README.md). Left: a
 * flow another CPU writes between the lookup here and the delete (no map has a compare-and-delete);
 * its window is this function's few instructions, where it was the whole walk. */
static __always_inline int EKP_CTF(place)(EKP_CT_KEY *rkey, EKP_CT_ENTRY *rent, const EKP_PKT *p,
					const struct ekp_config *cfg, __u64 now, __u8 *early_drop)
{
	EKP_CT_ENTRY *old = EKP_CTF(lookup)(rkey);
	__u8 may_drop = *early_drop;

	/* counted only for an unanswered holder deleted here, not one gone since; counted by the
	 * caller whether or not the claim and ekp_ct_create's later check then fail */
	*early_drop = 0;
	if (old) {
		if (EKP_A_EQ(old->fe_addr, rent->fe_addr) && old->fe_port == rent->fe_port &&
		    (old->flags & EKP_CT_SNAT) == (rent->flags & EKP_CT_SNAT) &&
		    EKP_A_EQ(old->nat_addr, rent->nat_addr) && old->nat_port == rent->nat_port)
			return EKP_CTF(write)(rkey, rent) == 0 ? 0 : EKP_DROP_CT_FULL;
		int dead = EKP_CTF(reusable)(old, rkey, EKP_PB(p), cfg, now);
		if (!dead && !(may_drop && !(old->flags & EKP_CT_ESTABLISHED)))
			return EKP_DROP_TUPLE_TAKEN;
		*early_drop = !dead;
		EKP_CT_KEY tk = {};
		EKP_CTF(twin_key)(&tk, rkey, old);
		EKP_CTF(delete)(rkey);
		int reason = EKP_CTF(claim)(rkey, rent);
		/* The holder's FORWARD entry goes after its REPLY, whatever the insert did: a holder
		 * still being created on another CPU may have written it since the lookup (deleted
		 * first, it would come back). Once the REPLY entry is gone, that creation's own check
		 * (ekp_ct_create) deletes any FORWARD entry written later. */
		EKP_CTF(delete_forward_of)(&tk, rkey);
		return reason;
	}
	return EKP_CTF(claim)(rkey, rent);
}

/* Inserts the REPLY then the FORWARD entry of a new flow (a reply can never beat its entry).
 * Source-translated flows (EKP_CT_SNAT) get a port from the SNAT range, their source the node's
 * address (IPv4: ekp_config's; IPv6: f->snat_addr, set by the caller from ekp_cfg6). An untranslated flow
 * whose reply tuple is held by a live flow of another frontend (one client port reaching one
 * backend through two frontends; a direct connection on a live flow's tuple) keeps its client
 * address but gets another source port (EKP_STAT_PORT_REMAP), as the kernel's NAT would: a
 * hijacked reply is never an option. Returns 0 or a drop reason. */
static __always_inline int EKP_CTF(create)(const EKP_PKT *p, EKP_FLOW *f, const struct ekp_config *cfg,
					 __u64 now)
{
	EKP_CT_KEY rkey = {};
	EKP_CT_ENTRY rent = {};
	int reason;

	EKP_A_SET(rkey.saddr, f->be_addr);
	rkey.sport = EKP_FB(f)->be_port;
	rkey.proto = EKP_PB(p)->proto;
	rkey.dir = EKP_CT_REPLY;

	if (!(EKP_FB(f)->ct_flags & EKP_CT_SNAT)) {
		EKP_A_SET(rkey.daddr, p->saddr);
		rkey.dport = EKP_PB(p)->sport;
		EKP_CT_ENTRY *old = EKP_CTF(lookup)(&rkey);
		/* Taken by a live flow of another frontend: keep the client's address, move its port. */
		if (old &&
		    (!EKP_A_EQ(old->fe_addr, f->fe_addr) || old->fe_port != EKP_FB(f)->fe_port ||
		     (old->flags & EKP_CT_SNAT)) &&
		    !EKP_CTF(reusable)(old, &rkey, EKP_PB(p), cfg, now)) {
			EKP_FB(f)->ct_flags |= EKP_CT_SNAT;
			EKP_FB(f)->remapped = 1;
			EKP_A_SET(f->snat_addr, p->saddr);
		}
	} else if (!EKP_FB(f)->remapped) { /* a remapped direct connection keeps its own address */
#if EKP_CT_V6
		/* the node's IPv6 address, put there by the caller (ekp_tc6.h, from ekp_cfg6) */
		if (!(f->snat_addr[0] | f->snat_addr[1] | f->snat_addr[2] | f->snat_addr[3]))
			return EKP_DROP_SNAT_PORTS;
#else
		f->snat_addr = cfg->node_addr;
		if (!f->snat_addr)
			return EKP_DROP_SNAT_PORTS;
#endif
	}
	if (EKP_FB(f)->ct_flags & EKP_CT_SNAT) {
		EKP_A_SET(rkey.daddr, f->snat_addr);
		reason = EKP_SNATF(find)(&rkey, p, cfg, now, EKP_FB(f));
		if (reason)
			return reason;
		EKP_FB(f)->snat_port = rkey.dport;
		EKP_A_SET(rent.nat_addr, p->saddr);
		rent.nat_port = EKP_PB(p)->sport;
	}
	rent.last_seen_ns = now;
	rent.created_s = now / EKP_NSEC;
	EKP_A_SET(rent.fe_addr, f->fe_addr);
	rent.fe_port = EKP_FB(f)->fe_port;
	rent.svc_id = EKP_FB(f)->svc_id;
	rent.backend_id = EKP_FB(f)->backend_id;
	rent.flags = EKP_FB(f)->ct_flags;
	EKP_CTF(stamp_flow)(&rent, &rkey, now); /* before the entries: no packet of the flow leaves before */
	reason = EKP_CTF(place)(&rkey, &rent, p, cfg, now, &EKP_FB(f)->early_drop);
	if (reason)
		return reason;

	/* The FORWARD entry: the REPLY one rebuilt from its own key (ekp_ct_twin_value). */
	EKP_CT_KEY fkey = {};
	EKP_CTF(key_of)(&fkey, p, EKP_CT_FORWARD);
	EKP_CTF(twin_value)(&rent, &rkey, &rent);
	if (EKP_CTF(write)(&fkey, &rent)) {
		EKP_CTF(delete)(&rkey);
		return EKP_DROP_CT_FULL;
	}
	/* Another CPU's ekp_ct_place may have taken the REPLY entry between its write and this one's
	 * (an unestablished holder it may drop early: this flow's own, before it had a FORWARD twin
	 * to delete with it). The FORWARD entry would then translate this client's packets while the
	 * answers go to the other flow's: it goes, and the packet drops as the loser of the race. */
	EKP_CT_ENTRY *mine = EKP_CTF(lookup)(&rkey);
	if (!mine) {
		/* Gone, not taken: the FORWARD insert evicted it from the full LRU table (another CPU's
		 * place claims the key again at once, so its window is a few instructions). */
		EKP_CTF(delete)(&fkey);
		return EKP_DROP_CT_FULL;
	}
	if (!EKP_CTF(is_twin)(mine, &rkey, &rent, &fkey)) {
		EKP_CTF(delete)(&fkey);
		return EKP_DROP_TUPLE_TAKEN;
	}
	return 0;
}

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
static __always_inline int EKP_CTF(reclaim)(const EKP_PKT *p, const struct ekp_config *cfg, __u64 now,
					  __u16 *held_by)
{
	EKP_CT_KEY rkey = {};

	/* A REPLY entry is keyed by its backend, which every write of the entry stamps (ekp_act.h): a
	 * destination no live flow stamped is no live flow's backend, and an expired entry on it
	 * translates nothing. An array load instead of a hash lookup for what a direct flow's server
	 * sends (a UDP answer misses conntrack as its request did; the request's destination, the
	 * backend, is the stamped end). */
	if (ekp_act_armed() &&
	    ekp_act_idle(EKP_A_FOLD(p->daddr), EKP_PB(p)->dport, EKP_PB(p)->proto, ekp_act_stamp_of(now),
			 ekp_ct_longest_stamps(cfg, EKP_PB(p)->proto)))
		return EKP_RECLAIM_NONE;
	EKP_A_SET(rkey.saddr, p->daddr);
	EKP_A_SET(rkey.daddr, p->saddr);
	rkey.sport = EKP_PB(p)->dport;
	rkey.dport = EKP_PB(p)->sport;
	rkey.proto = EKP_PB(p)->proto;
	rkey.dir = EKP_CT_REPLY;
	EKP_CT_ENTRY *rp = EKP_CTF(lookup)(&rkey);
	if (!rp)
		return EKP_RECLAIM_NONE;
	int stale = (rp->flags & EKP_CT_ENDING) || EKP_CTF(life)(rp, &rkey, cfg, now) != EKP_CT_LIVE;
	int twin = 0;
	EKP_CT_KEY fkey = {};

	EKP_CTF(twin_key)(&fkey, &rkey, rp);
	EKP_CT_ENTRY *fp = EKP_CTF(lookup)(&fkey);
	if (fp && EKP_CTF(is_twin)(fp, &fkey, rp, &rkey)) {
		twin = 1;
		if ((fp->flags & EKP_CT_ENDING) || EKP_CTF(life)(fp, &fkey, cfg, now) != EKP_CT_LIVE)
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
	EKP_CTF(delete)(&rkey);
	if (twin)
		EKP_CTF(delete)(&fkey);
	return EKP_RECLAIM_NONE;
}


#include "ekp_undef_af.h"
