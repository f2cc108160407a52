/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_abi.h: every key and value stored in an ebpf-kube-proxy BPF map.
 *
 * This is the contract between the C data path and the Python agent. agent/ebpf/abi.py mirrors
 * it once, and tests/ebpf/test_abi.py compiles a probe from this header and checks every size and
 * offset against the mirror, so a layout drift fails the build.
 *
 * Rules: fixed-width types only, explicit padding, no bitfields, every field commented with its
 * byte order ("be" = network order, "host" = CPU order). Changing any layout means bumping
 * EKP_ABI_VERSION: the version is part of every map name, so an old pinned map is never reused
 * with a new layout (bcc's BPF_TABLE_PINNED would reuse it silently).
 *
 * Includable by bcc programs and by a plain userspace compiler (only <linux/types.h>).
 */
#ifndef EKP_ABI_H
#define EKP_ABI_H

#include <linux/types.h>

#define EKP_ABI_VERSION 1

/* ---- frontends: (address, port, protocol, scope) -> service ------------------------------- */

/* Where the packet entered the node: decides which endpoints a Local traffic policy allows. */
enum ekp_scope {
	EKP_SCOPE_EXTERNAL = 0, /* from an external device (--devices): ETP applies */
	EKP_SCOPE_INTERNAL = 1, /* from a pod (or the node itself): ITP applies */
};

struct ekp_frontend_key {
	__be32 addr;  /* be: ClusterIP, node address (NodePort), external IP or LB IP */
	__be16 port;  /* be: service port, or the NodePort */
	__u8 proto;   /* IPPROTO_TCP / IPPROTO_UDP / IPPROTO_SCTP */
	__u8 scope;   /* enum ekp_scope */
};

/* Frontend flags (struct ekp_frontend.flags). */
#define EKP_FE_NODEPORT      (1 << 0) /* a NodePort frontend on a node address */
#define EKP_FE_EXTERNAL_IP   (1 << 1) /* a spec.externalIPs frontend */
#define EKP_FE_LOADBALANCER  (1 << 2) /* a status.loadBalancer.ingress frontend */
#define EKP_FE_LOCAL         (1 << 3) /* traffic policy Local: slots hold only this node's endpoints */
#define EKP_FE_SNAT_REMOTE   (1 << 4) /* source-translate to the node when the backend is remote */
#define EKP_FE_NO_ENDPOINTS  (1 << 5) /* count == 0 because the service has none: reject */
#define EKP_FE_SOURCE_RANGES (1 << 6) /* check the client against ekp_srcr (loadBalancerSourceRanges) */
#define EKP_FE_AFFINITY      (1 << 7) /* sessionAffinity ClientIP: see affinity_timeout */

struct ekp_frontend {
	__u32 set_id;           /* host: backend set; slots are ekp_slot_key{set_id, 1..count} */
	__u16 count;            /* host: live slots; 0 = no usable backend (see flags) */
	__u16 flags;            /* host: EKP_FE_* */
	__u32 affinity_timeout; /* host: seconds a client keeps its backend; 0 = no affinity */
	__u16 rev_nat_id;       /* host: key of ekp_revnat for replies; never 0 */
	__u16 pad;              /* zero */
};

/* ---- backend slots: (set, slot) -> backend id --------------------------------------------- */

struct ekp_slot_key {
	__u32 set_id; /* host: struct ekp_frontend.set_id */
	__u32 slot;   /* host: 1..count (0 is never written) */
};

struct ekp_slot {
	__u32 backend_id; /* host: key of ekp_backends */
};

/* ---- backends: id -> address ----------------------------------------------------------- */

#define EKP_BE_LOCAL       (1 << 0) /* the endpoint runs on this node */
#define EKP_BE_TERMINATING (1 << 1) /* serving but terminating (fallback endpoint) */

struct ekp_backend_key {
	__u32 id; /* host: allocated by the agent, stable across restarts; never 0 */
};

struct ekp_backend {
	__be32 addr; /* be: endpoint IP */
	__be16 port; /* be: endpoint port (targetPort resolved) */
	__u8 proto;  /* IPPROTO_* */
	__u8 flags;  /* EKP_BE_* */
};

/* ---- reverse NAT: id -> the frontend a reply must appear to come from ------------------- */

struct ekp_revnat_key {
	__u32 id; /* host: struct ekp_frontend.rev_nat_id */
};

struct ekp_revnat {
	__be32 addr; /* be: frontend address */
	__be16 port; /* be: frontend port */
	__u16 pad;   /* zero */
};

/* ---- conntrack (LRU): the tuple of a packet as it arrives -> what to rewrite ----------- */

enum ekp_ct_dir {
	EKP_CT_FORWARD = 0, /* client -> frontend: rewrite destination (and source when SNAT) */
	EKP_CT_REPLY = 1,   /* backend -> client: source from ekp_revnat, destination when SNAT */
};

#define EKP_CT_SNAT    (1 << 0) /* the flow's source was translated to the node */
#define EKP_CT_CLOSING (1 << 1) /* a FIN or RST was seen: short timeout */

struct ekp_ct_key {
	__be32 saddr; /* be: source address as on the wire */
	__be32 daddr; /* be: destination address as on the wire */
	__be16 sport; /* be */
	__be16 dport; /* be */
	__u8 proto;   /* IPPROTO_* */
	__u8 pad[3];  /* zero */
};

struct ekp_ct_entry {
	__u64 last_seen_ns; /* host: bpf_ktime_get_ns() of the last packet (refreshed coarsely) */
	__be32 nat_addr;    /* be: FORWARD: backend address; REPLY: client address if SNAT, else 0 */
	__be32 snat_addr;   /* be: FORWARD: node address if SNAT, else 0; REPLY: 0 */
	__be16 nat_port;    /* be: FORWARD: backend port; REPLY: client port if SNAT, else 0 */
	__be16 snat_port;   /* be: FORWARD: translated source port if SNAT, else 0; REPLY: 0 */
	__u32 backend_id;   /* host: backend chosen when the flow began (for inspect) */
	__u16 rev_nat_id;   /* host: frontend of the flow (ekp_revnat key) */
	__u8 dir;           /* enum ekp_ct_dir */
	__u8 flags;         /* EKP_CT_* */
	__u32 pad;          /* zero */
};

/* ---- session affinity (LRU): (client, backend set) -> backend ---------------------------- */

struct ekp_affinity_key {
	__be32 client; /* be: client source address */
	__u32 set_id;  /* host: backend set of the service port */
};

struct ekp_affinity {
	__u64 last_seen_ns; /* host: bpf_ktime_get_ns() of the client's last new flow */
	__u32 backend_id;   /* host */
	__u32 pad;          /* zero */
};

/* ---- loadBalancerSourceRanges (LPM trie): (frontend, client prefix) -> allowed --------- */

struct ekp_srcrange_key {
	__u32 prefixlen;  /* host: 32 (rev_nat_id + pad) + CIDR prefix length */
	__u16 rev_nat_id; /* host: the frontend */
	__u16 pad;        /* zero */
	__be32 addr;      /* be: CIDR network address */
};

struct ekp_srcrange {
	__u8 allow; /* 1 */
	__u8 pad[3];
};

/* ---- per-node configuration (array, one element) ------------------------------------- */

struct ekp_config {
	__be32 node_addr;     /* be: source address for SNAT to remote backends */
	__u16 snat_port_min;  /* host: first port for SNAT (inclusive) */
	__u16 snat_port_max;  /* host: last port for SNAT (inclusive) */
	__u32 tcp_timeout_s;  /* host: idle timeout of an established TCP flow */
	__u32 udp_timeout_s;  /* host: idle timeout of a UDP/SCTP flow */
	__u32 closing_timeout_s; /* host: timeout after FIN/RST */
	__u32 flags;          /* host: reserved, zero */
};

/* ---- counters (per-CPU array indexed by enum ekp_stat) ------------------------------- */

enum ekp_stat {
	EKP_STAT_PACKETS = 0,     /* packets seen by an ekp program */
	EKP_STAT_NEW_FLOWS,       /* flows translated for the first time */
	EKP_STAT_CT_FORWARD,      /* packets translated by a forward conntrack hit */
	EKP_STAT_CT_REPLY,        /* replies reverse-translated */
	EKP_STAT_SNAT,            /* new flows source-translated to the node */
	EKP_STAT_AFFINITY_HIT,    /* new flows that kept their client's backend */
	EKP_STAT_PASS,            /* packets not for a service, passed to the stack */
	/* drop reasons: keep EKP_STAT_DROP_FIRST first, update agent/ebpf/abi.py */
	EKP_STAT_DROP_FIRST,
	EKP_DROP_MALFORMED = EKP_STAT_DROP_FIRST, /* truncated or invalid headers */
	EKP_DROP_NO_ENDPOINTS,    /* service has no endpoints: refused, counts the rejects answered with an
	                           * ICMP port unreachable (verdict redirect) and the packets dropped
	                           * unanswered (TCP RST, non-unicast source, reshaping failed) */
	EKP_DROP_NO_LOCAL,        /* Local policy and no endpoint on this node */
	EKP_DROP_NO_BACKEND,      /* a slot or backend entry missing (mid-update race) */
	EKP_DROP_SOURCE_RANGE,    /* client outside loadBalancerSourceRanges */
	EKP_DROP_FIB,             /* no route to the backend or client */
	EKP_DROP_SNAT_PORTS,      /* no free SNAT port */
	EKP_DROP_CT_FULL,         /* conntrack insert failed */
	EKP_DROP_REVNAT_MISSING,  /* reply of a flow whose frontend is gone */
	EKP_DROP_FRAGMENT,        /* IP fragment of a service flow (not translated) */
	EKP_STAT_MAX,
};

#define EKP_STAT_COUNT EKP_STAT_MAX

#endif /* EKP_ABI_H */
