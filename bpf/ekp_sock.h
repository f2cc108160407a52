/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_sock.h: socket-level load balancing, the cgroup hooks of the node's own sockets.
 *
 * Traffic a process of the node sends (a host-network pod, the kubelet, the node's resolver)
 * enters no device the tc programs watch: it is translated where it starts, in the socket calls.
 *
 *   connect4 / sendmsg4   the application names a frontend (connect6 / sendmsg6 for an IPv6 one,
 *                         looked up in the IPv6 maps, and for an IPv4 address on an IPv6 socket,
 *                         ::ffff:a.b.c.d, as Java and dual-stack runtimes dial, in the IPv4 ones):
 *                         the backend is chosen as the packet
 *                         path chooses it (ekp_lb.h: scope INTERNAL, as kube-proxy's OUTPUT chain;
 *                         source ranges, affinity, the traffic policy's set) and written into the
 *                         call; the socket is remembered in ekp_sknat (ekp_sknat6) under that backend
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

/* An address of either family is `__be32 a[4]`: IPv4 in a[0] (the rest zero), IPv6 in all four,
 * network order (ekp_abi.h, "IPv6 pairs"). `v6` says which, a constant at every call. */

/* Remembers where socket `cookie` was sent, writing only when it changed (an unconnected UDP
 * socket comes through here at every datagram). */
static __always_inline void ekp_sock_remember(int v6, __u64 cookie, __u8 proto, const __be32 *fe_addr,
					      __be16 fe_port, const struct ekp_frontend *fe, const struct ekp_flow *f,
					      const __be32 *be_addr)
{
	if (v6) {
		struct ekp_sock6_key k = {};
		struct ekp_sock6_nat v = {};

		k.cookie = cookie;
		__builtin_memcpy(k.addr, be_addr, 16);
		k.port = f->be_port;
		k.proto = proto;
		__builtin_memcpy(v.fe_addr, fe_addr, 16);
		v.fe_port = fe_port;
		v.svc_id = fe->svc_id;
		v.backend_id = f->backend_id;
		struct ekp_sock6_nat *old = ekp_sknat6_lookup(&k);
		if (old && old->fe_addr[0] == v.fe_addr[0] && old->fe_addr[1] == v.fe_addr[1] &&
		    old->fe_addr[2] == v.fe_addr[2] && old->fe_addr[3] == v.fe_addr[3] &&
		    old->fe_port == v.fe_port && old->svc_id == v.svc_id && old->backend_id == v.backend_id)
			return;
		ekp_sknat6_update(&k, &v); /* LRU: cannot be full; a failure only loses the reverse view */
		return;
	}
	struct ekp_sock_key k = {};
	struct ekp_sock_nat v = {};

	k.cookie = cookie;
	k.addr = be_addr[0];
	k.port = f->be_port;
	k.proto = proto;
	v.fe_addr = fe_addr[0];
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
 * field's address from ctx again. An IPv6 socket (`sock6`) holds an IPv4 address (`v6` 0) as the
 * last word of its v4-mapped one (::ffff:a.b.c.d), the only IPv4 form it can dial. */
static __always_inline void ekp_sock_set_addr(struct bpf_sock_addr *ctx, int sock6, int v6, const __be32 *addr,
					      __be16 port)
{
	asm volatile("" : "+r"(ctx));
	if (v6) {
		ctx->user_ip6[0] = addr[0];
		asm volatile("" : "+r"(ctx));
		ctx->user_ip6[1] = addr[1];
		asm volatile("" : "+r"(ctx));
		ctx->user_ip6[2] = addr[2];
		asm volatile("" : "+r"(ctx));
		ctx->user_ip6[3] = addr[3];
	} else if (sock6) {
		ctx->user_ip6[3] = addr[0];
	} else {
		ctx->user_ip4 = addr[0];
	}
	asm volatile("" : "+r"(ctx));
	ctx->user_port = (__u32)port;
}

/* The address an IPv6 socket's call names, in a[]: 0 for a v4-mapped one (::ffff:a.b.c.d, the IPv4
 * address in a[0]), 1 for a real IPv6 one (all four words). */
static __always_inline int ekp_sock_addr6(struct bpf_sock_addr *ctx, __be32 *a)
{
	__be32 w0 = ctx->user_ip6[0], w1 = ctx->user_ip6[1], w2 = ctx->user_ip6[2], w3 = ctx->user_ip6[3];

	if (!w0 && !w1 && w2 == htonl(0x0000ffff)) {
		a[0] = w3;
		return 0;
	}
	a[0] = w0;
	a[1] = w1;
	a[2] = w2;
	a[3] = w3;
	return 1;
}

static __always_inline int ekp_addr_zero(int v6, const __be32 *a)
{
	return v6 ? !(a[0] | a[1] | a[2] | a[3]) : !a[0];
}

/* The frontend (`daddr`, `dport`, `proto`, `scope`) in the family's frontend map. */
static __always_inline struct ekp_frontend *ekp_sock_frontend(int v6, const __be32 *daddr, __be16 dport, __u8 proto,
							      __u8 scope)
{
	if (v6) {
		struct ekp_frontend6_key k = {};
		__builtin_memcpy(k.addr, daddr, 16);
		k.port = dport;
		k.proto = proto;
		k.scope = scope;
		return ekp_fe6_lookup(&k);
	}
	struct ekp_frontend_key k = {};

	k.addr = daddr[0];
	k.port = dport;
	k.proto = proto;
	k.scope = scope;
	return ekp_fe_lookup(&k);
}

/* The decision of connect and sendmsg for `daddr`:`dport` (family `v6`): the outcome (enum
 * ekp_stat), and for SOCK_TRANSLATED the backend in addr[], *port. */
static __always_inline __u32 ekp_sock_decide(struct bpf_sock_addr *ctx, int v6, const __be32 *daddr, __be16 dport,
					     __u32 *marks, __be32 *addr, __be16 *port)
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
	if (!v6 && !host && ekp_is_loopback(daddr[0]))
		return EKP_STAT_SOCK_PASS; /* the pod's own localhost (IPv6 has no localhost frontend) */

	struct ekp_frontend *fe = ekp_sock_frontend(v6, daddr, dport, proto, EKP_SCOPE_INTERNAL);
	if (!fe)
		return EKP_STAT_SOCK_PASS;
	if (!host && (fe->flags & EKP_FE_NEEDS_CLIENT))
		return EKP_STAT_SOCK_PASS; /* left to the pod's tc program (IPv6: ip6tables) */
	if (host && (fe->flags & EKP_FE_HOST_SCOPE)) {
		/* The node's own outcome differs from its pods' (see EKP_FE_HOST_SCOPE). */
		fe = ekp_sock_frontend(v6, daddr, dport, proto, EKP_SCOPE_HOST);
		if (!fe)
			return EKP_STAT_SOCK_PASS;
	}

	/* The client, for source ranges and affinity (nothing else reads it, nor the time: a plain
	 * frontend, most connects, skips both): the address the socket is bound to, else the node's
	 * (the source kube-proxy's OUTPUT chain sees for a node process, in most cases). The config
	 * holds no IPv6 node address: an unbound IPv6 socket is one client (::) for affinity, and its
	 * source ranges are left to ip6tables, which sees the source the route gives it. */
	__be32 client[4] = {};
	__u64 now = 0;
	if (fe->flags & (EKP_FE_SOURCE_RANGES | EKP_FE_AFFINITY)) {
		struct bpf_sock *sk = ctx->sk;
		if (sk && v6) {
			client[0] = sk->src_ip6[0];
			client[1] = sk->src_ip6[1];
			client[2] = sk->src_ip6[2];
			client[3] = sk->src_ip6[3];
		} else if (sk) {
			client[0] = sk->src_ip4;
		}
		if (!v6 && !client[0]) {
			const struct ekp_config *cfg = ekp_config_get();
			client[0] = cfg ? cfg->node_addr : 0;
		}
		if (v6 && (fe->flags & EKP_FE_SOURCE_RANGES) && ekp_addr_zero(1, client))
			return EKP_STAT_SOCK_PASS;
		now = bpf_ktime_get_ns();
	}
	int refusal = ekp_lb_refusal_af(v6, fe, client);
	if (refusal)
		return refusal;

	__u64 cookie = bpf_get_socket_cookie(ctx);
	struct ekp_flow f = {};
	__u32 aff_hit = 0;
	int reason = ekp_pick_backend_af(v6, fe, client, ekp_sock_rnd(proto, cookie), NULL, now, &f, addr, &aff_hit);
	if (reason)
		return reason;
	if (!v6)
		addr[0] = f.be_addr;
	*marks |= aff_hit << EKP_STAT_AFFINITY_HIT;
	ekp_sock_remember(v6, cookie, proto, daddr, dport, fe, &f, addr);
	*port = f.be_port;
	return EKP_STAT_SOCK_TRANSLATED;
}

/* connect / sendmsg of a socket (`sock6`: an IPv6 one) to `daddr` of family `v6`: count the call
 * and its outcome; a refusal fails the call with its errno. */
static __always_inline int ekp_sock_forward_af(struct bpf_sock_addr *ctx, int sock6, int v6, const __be32 *daddr)
{
	__u32 marks = 0;
	__be32 addr[4] = {};
	__be16 port = 0;

	__u32 outcome = ekp_sock_decide(ctx, v6, daddr, ekp_sock_port(ctx), &marks, addr, &port);

	ekp_count(EKP_STAT_SOCK_CALLS);
	ekp_count(outcome);
	ekp_count_marks(marks);
	if (outcome == EKP_STAT_SOCK_TRANSLATED)
		ekp_sock_set_addr(ctx, sock6, v6, addr, port);
	if (outcome == EKP_STAT_SOCK_PASS || outcome == EKP_STAT_SOCK_TRANSLATED)
		return EKP_SYS_PROCEED;
	bpf_set_retval(outcome == EKP_DROP_NO_ENDPOINTS ? -EKP_ECONNREFUSED : -EKP_EHOSTUNREACH);
	return EKP_SYS_REJECT;
}

/* connect4 / sendmsg4, and connect6 / sendmsg6 (`sock6`): an IPv4 address (on an IPv6 socket,
 * v4-mapped) is decided with the IPv4 maps, a real IPv6 one with the IPv6 maps. */
static __always_inline int ekp_sock_forward(struct bpf_sock_addr *ctx, int sock6)
{
	__be32 daddr[4] = {};

	if (!sock6) {
		daddr[0] = ctx->user_ip4;
		return ekp_sock_forward_af(ctx, 0, 0, daddr);
	}
	if (!ekp_sock_addr6(ctx, daddr))
		return ekp_sock_forward_af(ctx, 1, 0, daddr);
	return ekp_sock_forward_af(ctx, 1, 1, daddr);
}

/* The backend's address `a` (family `v6`) shown as the frontend the socket was sent to, while that
 * frontend still belongs to the same service port (else the entry is stale: dropped). */
static __always_inline int ekp_sock_reverse_af(struct bpf_sock_addr *ctx, int sock6, int v6, const __be32 *a,
					       __u32 proto)
{
	__be32 fe_addr[4] = {};
	__be16 fe_port;
	__u32 svc_id;
	__u64 cookie = bpf_get_socket_cookie(ctx);
	__be16 port = ekp_sock_port(ctx);
	struct ekp_sock_key k = {};
	struct ekp_sock6_key k6 = {};

	if (v6) {
		k6.cookie = cookie;
		__builtin_memcpy(k6.addr, a, 16);
		k6.port = port;
		k6.proto = proto;
		struct ekp_sock6_nat *n = ekp_sknat6_lookup(&k6);
		if (!n)
			return EKP_SYS_PROCEED;
		__builtin_memcpy(fe_addr, n->fe_addr, 16);
		fe_port = n->fe_port;
		svc_id = n->svc_id;
	} else {
		k.cookie = cookie;
		k.addr = a[0];
		k.port = port;
		k.proto = proto;
		struct ekp_sock_nat *n = ekp_sknat_lookup(&k);
		if (!n)
			return EKP_SYS_PROCEED;
		fe_addr[0] = n->fe_addr;
		fe_port = n->fe_port;
		svc_id = n->svc_id;
	}
	struct ekp_frontend *fe = ekp_sock_frontend(v6, fe_addr, fe_port, proto, EKP_SCOPE_INTERNAL);
	if (!fe || fe->svc_id != svc_id) {
		if (v6)
			ekp_sknat6_delete(&k6);
		else
			ekp_sknat_delete(&k);
		return EKP_SYS_PROCEED;
	}
	ekp_sock_set_addr(ctx, sock6, v6, fe_addr, fe_port);
	ekp_count(EKP_STAT_SOCK_REVNAT);
	return EKP_SYS_PROCEED;
}

/* recvmsg4 / getpeername4, and their IPv6 twins (`sock6`) for a peer of either family. */
static __always_inline int ekp_sock_reverse(struct bpf_sock_addr *ctx, int sock6)
{
	__u32 proto = ctx->protocol;
	__be32 a[4] = {};

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return EKP_SYS_PROCEED;
	if (!sock6) {
		a[0] = ctx->user_ip4;
		return ekp_sock_reverse_af(ctx, 0, 0, a, proto);
	}
	if (!ekp_sock_addr6(ctx, a))
		return ekp_sock_reverse_af(ctx, 1, 0, a, proto);
	return ekp_sock_reverse_af(ctx, 1, 1, a, proto);
}

/* sock_release (cgroup/sock_release, every inet socket of the cgroup as its file is closed): the
 * entry a connected socket left in ekp_sknat (ekp_sknat6 for an IPv6 peer) goes with it. Without
 * this the table holds every socket that ever dialled a frontend, sits full, and each connect()'s
 * insert takes the LRU's eviction path (the common list's lock, and a shrink of up to 128 entries
 * when a CPU's free list runs dry: see bpf/README.md, "Socket programs", for what it cost). A
 * connected socket's peer is still set here (the hook runs before the protocol's close), and is the
 * backend its entry is keyed by. An unconnected UDP socket's entries (one per backend it sent to)
 * cannot be named from the socket alone: the LRU still forgets those. Looked up before the delete:
 * most sockets were never translated, and a delete takes the bucket's lock even for a miss; with
 * host-namespace-only a pod's socket (never translated) is not looked up at all. */
static __always_inline int ekp_sock_release(struct bpf_sock *ctx)
{
	__u32 proto = ctx->protocol;
	__u32 zero = 0;

	if (proto != IPPROTO_TCP && proto != IPPROTO_UDP)
		return EKP_SYS_PROCEED;
	/* An IPv4 peer is in dst_ip4, on an IPv6 socket (v4-mapped) too; a real IPv6 peer leaves a
	 * placeholder there (127.0.0.6) that no entry holds, and is in dst_ip6. */
	__be32 d4 = ctx->dst_ip4;
	__be32 d6[4] = {};
	int v6 = 0;
	if (ctx->family == EKP_AF_INET6) {
		d6[0] = ctx->dst_ip6[0];
		d6[1] = ctx->dst_ip6[1];
		d6[2] = ctx->dst_ip6[2];
		d6[3] = ctx->dst_ip6[3];
		v6 = !(d6[0] == 0 && d6[1] == 0 && d6[2] == htonl(0x0000ffff)) && !ekp_addr_zero(1, d6);
	}
	if (!v6 && !d4)
		return EKP_SYS_PROCEED;
	struct ekp_sock_config *sc = ekp_skcfg_lookup(&zero);
	if (!sc || ((sc->flags & EKP_SOCK_HOST_ONLY) && bpf_get_netns_cookie(ctx) != sc->host_netns))
		return EKP_SYS_PROCEED;
	__u64 cookie = bpf_get_socket_cookie(ctx);
	if (v6) {
		struct ekp_sock6_key k6 = {};
		__builtin_memcpy(k6.addr, d6, 16);
		k6.port = ctx->dst_port;
		k6.proto = proto;
		k6.cookie = cookie;
		if (ekp_sknat6_lookup(&k6))
			ekp_sknat6_delete(&k6);
		return EKP_SYS_PROCEED;
	}
	struct ekp_sock_key k = {};
	k.addr = d4;
	k.port = ctx->dst_port;
	k.proto = proto;
	k.cookie = cookie;
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

/* The head of struct sock_common, the same in every kernel since the socket iterators exist, up to
 * the IPv6 peer (skc_v6_daddr, after skc_prot and skc_net). The verifier checks each load against
 * the running kernel's BTF of struct udp_sock. */
struct ekp_sock_common {
	__be32 daddr;      /* skc_daddr: the IPv4 peer of a connected socket */
	__be32 rcv_saddr;  /* skc_rcv_saddr */
	__u32 hash;        /* skc_hash */
	__be16 dport;      /* skc_dport */
	__u16 num;         /* skc_num: the local port, host order */
	__u16 family;      /* skc_family */
	__u8 state;        /* skc_state */
	__u8 bits;         /* skc_reuse, skc_reuseport, skc_ipv6only, skc_net_refcnt */
	__s32 bound_dev_if; /* skc_bound_dev_if */
	__u64 bind_node[2]; /* skc_bind_node */
	__u64 prot;        /* skc_prot */
	__u64 net;         /* skc_net */
	__be32 v6_daddr[4]; /* skc_v6_daddr: the IPv6 peer (v4-mapped for an IPv4 one) */
};

/* One UDP socket of the iterator's network namespace: ended when the socket programs sent it to a
 * backend that is no longer a member of the service port (any set: kube-proxy's stale-UDP cleanup
 * and ekp_ct_usable_forward's test). Unconnected sockets (no peer) choose again at each sendmsg. */
static __always_inline int ekp_sock_iter_udp(struct ekp_iter_udp *ctx)
{
	struct ekp_sock_common *sk = ctx->udp_sk;

	if (!sk || (sk->family != EKP_AF_INET && sk->family != EKP_AF_INET6))
		return 0;
	__u64 cookie = bpf_get_socket_cookie(sk);
	struct ekp_member_key mk = {};
	struct ekp_member *m;
	struct ekp_sock_key k = {};
	struct ekp_sock6_key k6 = {};
	__be32 d6[4] = {};
	int v6 = 0;
	if (sk->family == EKP_AF_INET6) {
		/* An IPv6 socket connected to an IPv4 address (v4-mapped) has it in skc_daddr too; one
		 * connected to an IPv6 address has a placeholder there that no entry holds. */
		d6[0] = sk->v6_daddr[0];
		d6[1] = sk->v6_daddr[1];
		d6[2] = sk->v6_daddr[2];
		d6[3] = sk->v6_daddr[3];
		v6 = !(d6[0] == 0 && d6[1] == 0 && d6[2] == htonl(0x0000ffff)) && !ekp_addr_zero(1, d6);
	}
	if (v6) {
		k6.cookie = cookie;
		__builtin_memcpy(k6.addr, d6, 16);
		k6.port = sk->dport;
		k6.proto = IPPROTO_UDP;
		struct ekp_sock6_nat *n = ekp_sknat6_lookup(&k6);
		if (!n)
			return 0;
		mk.svc_id = n->svc_id;
		mk.backend_id = n->backend_id;
		m = ekp_member6_lookup(&mk);
	} else {
		if (!sk->daddr)
			return 0;
		k.cookie = cookie;
		k.addr = sk->daddr;
		k.port = sk->dport;
		k.proto = IPPROTO_UDP;
		struct ekp_sock_nat *n = ekp_sknat_lookup(&k);
		if (!n)
			return 0;
		mk.svc_id = n->svc_id;
		mk.backend_id = n->backend_id;
		m = ekp_member_lookup(&mk);
	}
	if (m && m->flags)
		return 0;
	if (v6)
		ekp_sknat6_delete(&k6);
	else
		ekp_sknat_delete(&k);
	if (ekp_sock_destroy(sk) == 0)
		ekp_count(EKP_STAT_SOCK_DESTROYED);
	return 0;
}

#endif /* EKP_SOCK_H */
