/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_ct.h: connection tracking of translated flows (ekp_ct_tcp_v2 / ekp_ct_any_v2, LRU hashes).
 * Both families: everything below that reads a key or an entry is written once, in ekp_ct_af.h,
 * instantiated here for IPv4 (ekp_ct_*) and in ekp_ct6.h for the tc IPv6 path (ekp_ct6_* on
 * ekp_ct6_tcp_v2 / ekp_ct6_any_v2, the same layouts with 16-byte addresses).
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
enum ekp_ct_life {
	EKP_CT_LIVE = 0,
	EKP_CT_EXPIRED,   /* idle past the timeout of its state: a miss, overwritten later */
	EKP_CT_ABANDONED, /* TCP, its backend gone and silent past tcp_orphan_s: deleted when found */
};

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

/* ---- new flows ---------------------------------------------------------------------------- */

static __always_inline __u32 ekp_flow_hash(const struct ekp_pkt *p)
{
	__u32 h = p->saddr * 0x9e3779b1u;

	h ^= p->daddr + 0x7f4a7c15u + (h << 6) + (h >> 2);
	h ^= ((__u32)p->sport << 16 | p->dport) + 0x7f4a7c15u + (h << 6) + (h >> 2);
	h ^= p->proto;
	h ^= h >> 16;
	h *= 0x85ebca6bu;
	h ^= h >> 13;
	h *= 0xc2b2ae35u;
	h ^= h >> 16;
	return h;
}

/* ---- a direct connection on a translated flow's tuple ------------------------------------ */

enum ekp_reclaim {
	EKP_RECLAIM_NONE = 0, /* no flow of ours holds the tuple, or a stale one was cleared */
	EKP_RECLAIM_LIVE = 1, /* a live translated flow holds it: the newcomer needs another port */
};

/* Everything that reads a conntrack key or entry, written once for both families (ekp_ct_af.h):
 * IPv4's instance here (ekp_ct_*), IPv6's in ekp_ct6.h (ekp_ct6_*). */
#define EKP_CT_V6 0
#include "ekp_ct_af.h"
#undef EKP_CT_V6

#endif /* EKP_CT_H */
