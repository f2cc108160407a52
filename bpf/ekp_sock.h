/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_sock.h: socket-level load balancing, the cgroup hooks of the node's own sockets.
 *
 * Traffic a process of the node sends (a host-network pod, the kubelet, the node's resolver)
 * enters no device the tc programs watch: it is translated where it starts, in the socket calls.
 *
 *   connect4 / sendmsg4   the application names a frontend (connect6 / sendmsg6 too, for an IPv4
 *                         address on an IPv6 socket, ::ffff:a.b.c.d, as Java and dual-stack
 *                         runtimes dial): the backend is chosen as the packet
 *                         path chooses it (ekp_lb.h: scope INTERNAL, as kube-proxy's OUTPUT chain;
 *                         source ranges, affinity, the traffic policy's set) and written into the
 *                         call; the socket is remembered in ekp_sknat under that backend
 *   recvmsg4 / getpeername4  the address the kernel reports (a UDP reply's source, the peer of a
 *                         connected socket) is the backend's: shown as the frontend again while
 *                         the frontend still belongs to the service port the socket was sent to
 *   sock_release          a connected socket's entry goes when the socket is closed: the table
 *                         holds live sockets, not every socket that ever dialled a frontend
 *   UDP iterator          a connected UDP socket stays on the backend chosen at connect(): when
 *                         that backend leaves its service port (ekp_member_v2), the socket is ended
 *                         (bpf_sock_destroy; the application sees ECONNABORTED and opens a new
 *                         one), as kube-proxy clears the conntrack entries of a stale UDP endpoint
 *
 * Who is translated: every socket of the node's network namespace (ekp_sock_config.host_netns);
 * sockets of other namespaces (pods in the attached cgroup) unless EKP_SOCK_HOST_ONLY, and then
 * only for frontends whose outcome does not depend on the client's address or on source
 * translation (affinity, source ranges, SNAT: the socket does not know its pod's address yet at
 * connect(), and the packet path keeps kube-proxy's exact behaviour for them). 127.0.0.0/8 is the
 * node's localhost only in the node's namespace: localhost NodePorts are served there alone.
 *
 * Refusals: NO_ENDPOINTS fails the call with ECONNREFUSED (what kube-proxy's ICMP reject gives a
 * TCP client); the drops (NO_LOCAL, SOURCE_RANGE, NO_BACKEND) with EHOSTUNREACH at once, where
 * kube-proxy's dropped SYNs end in a timeout. The drop reasons count in the one enum (ekp_abi.h).
 *
 * Socket programs run in process context and may be preempted: they keep their state on the stack,
 * never in the tc programs' per-CPU scratch (a tc program on the same CPU could overwrite it).
 */
#ifndef EKP_SOCK_H
#define EKP_SOCK_H

#include <linux/bpf.h>
#include <linux/in.h>

#include "ekp_abi.h"
#include "ekp_decide.h"
#include "ekp_lb.h"
#include "ekp_maps.h"
#include "ekp_stats.h"

#define EKP_SYS_REJECT 0
#define EKP_SYS_PROCEED 1

#define EKP_ECONNREFUSED 111
#define EKP_EHOSTUNREACH 113
#define EKP_AF_INET 2
#define EKP_AF_INET6 10

/* bcc 0.26 cannot emit a call to a kernel function (kfunc): the iterator calls this marker helper
 * number instead, and the loader turns each such call into a kfunc call of bpf_sock_destroy
 * (agent/ebpf/kfunc.py: src_reg BPF_PSEUDO_KFUNC_CALL, imm its BTF id in the running kernel). */
#define EKP_KFUNC_SOCK_DESTROY 0x1ea7
static int (*ekp_sock_destroy)(void *sk) = (void *)EKP_KFUNC_SOCK_DESTROY;

/* The frontend flags whose outcome depends on the client's address or on source translation. */
#define EKP_FE_NEEDS_CLIENT (EKP_FE_AFFINITY | EKP_FE_SOURCE_RANGES | EKP_FE_SNAT_ALL | EKP_FE_SNAT_REMOTE)

static __always_inline int ekp_is_loopback(__be32 addr)
{
	return (addr & htonl(0xff000000)) == htonl(0x7f000000);
}

/* The ctx's 32-bit port field holds the port in network order in its low 16 bits (read whole:
 * narrower loads of it are refused). */
static __always_inline __be16 ekp_sock_port(struct bpf_sock_addr *ctx)
{
	volatile __u32 port = ctx->user_port;

	return (__be16)port;
}

/* A slot for the socket: random per TCP connection (as a packet path flow); per socket for UDP,
 * so that every datagram of an unconnected socket goes to one backend while the set holds, as one
 * conntrack entry keeps a UDP flow on one backend (the cookie, mixed: cookies count up). */
static __always_inline __u32 ekp_sock_rnd(__u32 proto, __u64 cookie)
{
	if (proto == IPPROTO_UDP)
		return (__u32)((cookie * 0x9e3779b97f4a7c15ULL) >> 32);
	return bpf_get_prandom_u32();
}

/* Remembers where socket `cookie` was sent, writing only when it changed (an unconnected UDP
 * socket comes through here at every datagram). */
static __always_inline void ekp_sock_remember(__u64 cookie, __u8 proto, __be32 fe_addr, __be16 fe_port,
					      const struct ekp_frontend *fe, const struct ekp_flow *f)
{
	struct ekp_sock_key k = {};
	struct ekp_sock_nat v = {};

	k.cookie = cookie;
	k.addr = f->be_addr;
	k.port = f->be_port;
	k.proto = proto;
	v.fe_addr = fe_addr;
	v.fe_port = fe_port;
	v.svc_id = fe->svc_id;
	v.backend_id = f->backend_id;
	struct ekp_sock_nat *old = ekp_sknat_lookup(&k);
	if (old && old->fe_addr == v.fe_addr && old->fe_port == v.fe_port && old->svc_id == v.svc_id &&
	    old->backend_id == v.backend_id)
		return;
	ekp_sknat_update(&k, &v); /* LRU: cannot be full; a failure only loses the reverse view */
}

/* The stores into the ctx: LLVM keeps a pointer to a field it computed before a helper call, and
 * the verifier refuses stores through a modified ctx pointer; the empty asm makes it compute each
 * field's address from ctx again. An IPv6 socket (`v6`) holds the IPv4 address as the last word of
 * its v4-mapped one (::ffff:a.b.c.d), the only IPv4 form it can dial. */
static __always_inline void ekp_sock_set_addr(struct bpf_sock_addr *ctx, int v6, __be32 addr, __be16 port)
{
	asm volatile("" : "+r"(ctx));
	if (v6)
		ctx->user_ip6[3] = addr;
	else
		ctx->user_ip4 = addr;
	asm volatile("" : "+r"(ctx));
	ctx->user_port = (__u32)port;
}

/* The IPv4 address an IPv6 socket's call names (v4-mapped, ::ffff:a.b.c.d), in *addr; 0 when the
 * address is a real IPv6 one (no IPv6 Service is served). */
static __always_inline int ekp_sock_v4_mapped(struct bpf_sock_addr *ctx, __be32 *addr)
{
	if (ctx->user_ip6[0] || ctx->user_ip6[1] || ctx->user_ip6[2] != htonl(0x0000ffff))
		return 0;
	*addr = ctx->user_ip6[3];
	return 1;
}

/* The decision of connect and sendmsg for `daddr`:`dport`: the outcome (enum ekp_stat), and for
 * SOCK_TRANSLATED the backend in *addr, *port. */
static __always_inline __u32 ekp_sock_decide(struct bpf_sock_addr *ctx, __be32 daddr, __be16 dport, __u32 *marks,
					     __be32 *addr, __be16 *port)
{
	__u32 proto = ctx->protocol;
	__u32 zero = 0;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return EKP_STAT_SOCK_PASS;
	struct ekp_sock_config *sc = ekp_skcfg_lookup(&zero);
	if (!sc)
		return EKP_STAT_SOCK_PASS;
	int host = bpf_get_netns_cookie(ctx) == sc->host_netns;
	if (!host && (sc->flags & EKP_SOCK_HOST_ONLY))
		return EKP_STAT_SOCK_PASS;
	if (!host && ekp_is_loopback(daddr))
		return EKP_STAT_SOCK_PASS; /* the pod's own localhost */

	struct ekp_frontend_key fk = {};
	fk.addr = daddr;
	fk.port = dport;
	fk.proto = proto;
	fk.scope = EKP_SCOPE_INTERNAL;
	struct ekp_frontend *fe = ekp_fe_lookup(&fk);
	if (!fe)
		return EKP_STAT_SOCK_PASS;
	if (!host && (fe->flags & EKP_FE_NEEDS_CLIENT))
		return EKP_STAT_SOCK_PASS; /* left to the pod's tc program */
	if (host && (fe->flags & EKP_FE_HOST_SCOPE)) {
		/* The node's own outcome differs from its pods' (see EKP_FE_HOST_SCOPE). */
		fk.scope = EKP_SCOPE_HOST;
		fe = ekp_fe_lookup(&fk);
		if (!fe)
			return EKP_STAT_SOCK_PASS;
	}

	/* The client, for source ranges and affinity (nothing else reads it, nor the time: a plain
	 * frontend, most connects, skips both): the address the socket is bound to, else the node's
	 * (the source kube-proxy's OUTPUT chain sees for a node process, in most cases). */
	__be32 client = 0;
	__u64 now = 0;
	if (fe->flags & (EKP_FE_SOURCE_RANGES | EKP_FE_AFFINITY)) {
		client = ctx->sk ? ctx->sk->src_ip4 : 0;
		if (!client) {
			const struct ekp_config *cfg = ekp_config_get();
			client = cfg ? cfg->node_addr : 0;
		}
		now = bpf_ktime_get_ns();
	}
	int refusal = ekp_lb_refusal(fe, client);
	if (refusal)
		return refusal;

	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct ekp_flow f = {};
	__u32 aff_hit = 0;
	int reason = ekp_pick_backend(fe, client, ekp_sock_rnd(proto, cookie), NULL, now, &f, &aff_hit);
	if (reason)
		return reason;
	*marks |= aff_hit << EKP_STAT_AFFINITY_HIT;
	ekp_sock_remember(cookie, proto, daddr, dport, fe, &f);
	*addr = f.be_addr;
	*port = f.be_port;
	return EKP_STAT_SOCK_TRANSLATED;
}

/* connect4 / sendmsg4, and connect6 / sendmsg6 for an IPv4 address on an IPv6 socket (`v6`): count
 * the call and its outcome; a refusal fails the call with its errno. An IPv6 socket's call to a real
 * IPv6 address is not counted (no IPv6 Service is served). */
static __always_inline int ekp_sock_forward(struct bpf_sock_addr *ctx, int v6)
{
	__u32 marks = 0;
	__be32 addr = 0, daddr = 0;
	__be16 port = 0;

	if (v6) {
		if (!ekp_sock_v4_mapped(ctx, &daddr))
			return EKP_SYS_PROCEED;
	} else {
		daddr = ctx->user_ip4;
	}
	__u32 outcome = ekp_sock_decide(ctx, daddr, ekp_sock_port(ctx), &marks, &addr, &port);

	ekp_count(EKP_STAT_SOCK_CALLS);
	ekp_count(outcome);
	ekp_count_marks(marks);
	if (outcome == EKP_STAT_SOCK_TRANSLATED)
		ekp_sock_set_addr(ctx, v6, addr, port);
	if (outcome == EKP_STAT_SOCK_PASS || outcome == EKP_STAT_SOCK_TRANSLATED)
		return EKP_SYS_PROCEED;
	bpf_set_retval(outcome == EKP_DROP_NO_ENDPOINTS ? -EKP_ECONNREFUSED : -EKP_EHOSTUNREACH);
	return EKP_SYS_REJECT;
}

/* recvmsg4 / getpeername4 (and their IPv6 twins for an IPv4 peer of an IPv6 socket, `v6`): the
 * backend's address shown as the frontend the socket was sent to, while that frontend still belongs
 * to the same service port (else the entry is stale: dropped). */
static __always_inline int ekp_sock_reverse(struct bpf_sock_addr *ctx, int v6)
{
	struct ekp_sock_key k = {};
	__u32 proto = ctx->protocol;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return EKP_SYS_PROCEED;
	if (v6) {
		if (!ekp_sock_v4_mapped(ctx, &k.addr))
			return EKP_SYS_PROCEED;
	} else {
		k.addr = ctx->user_ip4;
	}
	k.cookie = bpf_get_socket_cookie(ctx);
	k.port = ekp_sock_port(ctx);
	k.proto = proto;
	struct ekp_sock_nat *n = ekp_sknat_lookup(&k);
	if (!n)
		return EKP_SYS_PROCEED;

	struct ekp_frontend_key fk = {};
	fk.addr = n->fe_addr;
	fk.port = n->fe_port;
	fk.proto = proto;
	fk.scope = EKP_SCOPE_INTERNAL;
	struct ekp_frontend *fe = ekp_fe_lookup(&fk);
	if (!fe || fe->svc_id != n->svc_id) {
		ekp_sknat_delete(&k);
		return EKP_SYS_PROCEED;
	}
	ekp_sock_set_addr(ctx, v6, n->fe_addr, n->fe_port);
	ekp_count(EKP_STAT_SOCK_REVNAT);
	return EKP_SYS_PROCEED;
}

/* sock_release (cgroup/sock_release, every inet socket of the cgroup as its file is closed): the
 * entry a connected socket left in ekp_sknat goes with it. Without this the table holds every socket
 * that ever dialled a frontend, sits full, and each connect()'s insert takes the LRU's eviction path
 * (the common list's lock, and a shrink of up to 128 entries when a CPU's free list runs dry: see
 * bpf/README.md, "Socket programs", for what it cost). A connected socket's peer is still set here
 * (the hook runs before the protocol's close), and is the backend its entry is keyed by. An
 * unconnected UDP socket's entries (one per backend it sent to) cannot be named from the socket
 * alone: the LRU still forgets those. Looked up before the delete: most sockets were never
 * translated, and a delete takes the bucket's lock even for a miss; with host-namespace-only a
 * pod's socket (never translated) is not looked up at all. */
static __always_inline int ekp_sock_release(struct bpf_sock *ctx)
{
	struct ekp_sock_key k = {};
	__u32 proto = ctx->protocol;
	__u32 zero = 0;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return EKP_SYS_PROCEED;
	k.addr = ctx->dst_ip4; /* an IPv6 socket connected to a v4-mapped address has it here too */
	if (!k.addr)
		return EKP_SYS_PROCEED;
	struct ekp_sock_config *sc = ekp_skcfg_lookup(&zero);
	if (!sc || ((sc->flags & EKP_SOCK_HOST_ONLY) && bpf_get_netns_cookie(ctx) != sc->host_netns))
		return EKP_SYS_PROCEED;
	k.port = ctx->dst_port;
	k.proto = proto;
	k.cookie = bpf_get_socket_cookie(ctx);
	if (ekp_sknat_lookup(&k))
		ekp_sknat_delete(&k);
	return EKP_SYS_PROCEED;
}

/* ---- the UDP socket iterator (iter/udp) ---- */

/* The context of an iter/udp program (the kernel's struct bpf_iter__udp, which no header has). */
struct bpf_iter_meta;
struct ekp_iter_udp {
	struct bpf_iter_meta *meta;
	void *udp_sk; /* struct udp_sock *: begins with struct sock_common */
	__u32 uid __attribute__((aligned(8)));
	int bucket __attribute__((aligned(8)));
};

/* The head of struct sock_common, the same in every kernel since the socket iterators exist. The
 * verifier checks each load against the running kernel's BTF of struct udp_sock. */
struct ekp_sock_common {
	__be32 daddr;     /* skc_daddr: the peer of a connected socket */
	__be32 rcv_saddr; /* skc_rcv_saddr */
	__u32 hash;       /* skc_hash */
	__be16 dport;     /* skc_dport */
	__u16 num;        /* skc_num: the local port, host order */
	__u16 family;     /* skc_family */
};

/* One UDP socket of the iterator's network namespace: ended when the socket programs sent it to a
 * backend that is no longer a member of the service port (any set: kube-proxy's stale-UDP cleanup
 * and ekp_ct_usable_forward's test). Unconnected sockets (daddr 0) choose again at each sendmsg. */
static __always_inline int ekp_sock_iter_udp(struct ekp_iter_udp *ctx)
{
	struct ekp_sock_common *sk = ctx->udp_sk;

	/* An IPv6 socket connected to an IPv4 address (v4-mapped) has it in skc_daddr too; one connected
	 * to an IPv6 address has a placeholder there that no entry holds. */
	if (!sk || (sk->family != EKP_AF_INET && sk->family != EKP_AF_INET6) || !sk->daddr)
		return 0;
	struct ekp_sock_key k = {};
	k.cookie = bpf_get_socket_cookie(sk);
	k.addr = sk->daddr;
	k.port = sk->dport;
	k.proto = IPPROTO_UDP;
	struct ekp_sock_nat *n = ekp_sknat_lookup(&k);
	if (!n)
		return 0;
	struct ekp_member_key mk = {};
	mk.svc_id = n->svc_id;
	mk.backend_id = n->backend_id;
	struct ekp_member *m = ekp_member_lookup(&mk);
	if (m && m->flags)
		return 0;
	ekp_sknat_delete(&k);
	if (ekp_sock_destroy(sk) == 0)
		ekp_count(EKP_STAT_SOCK_DESTROYED);
	return 0;
}

#endif /* EKP_SOCK_H */
