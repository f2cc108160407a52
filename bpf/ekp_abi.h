/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_abi.h: every key and value stored in an ebpf-kube-proxy BPF map (ABI v2).
 *
 * This is the contract between the C data path and the Python agent. agent/ebpf/abi.py mirrors
 * it once, and tests/ebpf/test_abi.py compiles a probe from this header and checks every size and
 * offset against the mirror, so a layout drift fails the build.
 *
 * Rules: fixed-width types only, explicit padding, no bitfields, every field commented with its
 * byte order ("be" = network order, "host" = CPU order). Changing any layout means bumping
 * EKP_ABI_VERSION: the version is part of every map name, so an old pinned map is never reused
 * with a new layout (the loader reuses a pinned map whose sizes match, and two layouts of one size
 * would pass that check). A change to one map alone bumps that map's own suffix: the counters grew
 * to ekp_stats_v3 (more slots) while every other layout stayed v2. A map added beside the others
 * needs no bump: no older program or pin knows its name.
 *
 * IPv6: Cilium's v4/v6 pairs. Every struct below that holds an address is the IPv4 member of a
 * pair; IPv6 has its own maps beside these with 16-byte addresses (the "IPv6 pairs" section at the
 * end: ekp_fe6, ekp_be6, ekp_rnat6, ekp_aff6, ekp_srcr6, ekp_addr6, ekp_sknat6; the tc programs'
 * ekp_ct6_tcp, ekp_ct6_any and their early-drop rings ekp_ctq6_tcp, ekp_ctq6_any, ekp_ctqh6, ekp_cfg6, ekp_cfg6sel, and legacy host routing's ekp_hostnat6), and
 * changes none of the v2 layouts: an
 * upgrade only adds maps, and no IPv4 flow is touched. Pairs rather than 16-byte unions because the
 * per-packet keys (conntrack, frontend, fragments) stay 16 bytes for IPv4: a 40-byte union key
 * would cost every IPv4 lookup a longer hash and every conntrack entry 24 more bytes.
 *
 * The maps keyed by ids (slots, membership) are paired too (ekp_slot6, ekp_member6), with the v4
 * key and value structs: each family has its own id space. The agent plans each family with its own
 * planner over that family's state (as kube-proxy runs one proxier per family), and two planners
 * sharing one id space would have to allocate every svc, set and backend id together; the C loses
 * nothing by it, since the backend choice (ekp_lb.h) takes the family as a constant parameter and
 * picks the map of that family at each lookup: one copy of the logic, the other family's branch
 * compiled out. The config, counters, rate limiter and socket settings carry no address and are
 * shared by both families.
 *
 * Includable by bcc programs and by a plain userspace compiler (only <linux/types.h>).
 */
#ifndef EKP_ABI_H
#define EKP_ABI_H

#include <linux/types.h>

#define EKP_ABI_VERSION 2

/* ---- frontends: (address, port, protocol, scope) -> service port ------------------------- */

/* Where the packet entered the node: decides which endpoints a Local traffic policy allows. */
enum ekp_scope {
	EKP_SCOPE_EXTERNAL = 0, /* from an external device (--devices): ETP applies */
	EKP_SCOPE_INTERNAL = 1, /* from a pod (or the node itself): ITP applies */
	EKP_SCOPE_HOST = 2,     /* the node's own sockets, where an INTERNAL frontend says so (EKP_FE_HOST_SCOPE) */
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
#define EKP_FE_SNAT_ALL      (1 << 8) /* source-translate to the node whatever the backend (KUBE-MARK-MASQ) */
#define EKP_FE_MAGLEV        (1 << 9) /* choose the backend with the Maglev table of set_id (ekp_maglev), and
				      * let a TCP segment without conntrack resume its flow on it */
#define EKP_FE_HOST_SCOPE    (1 << 10) /* INTERNAL: the node's own sockets use the HOST frontend of this key
					* instead (ETP Local with no local-traffic detector: pods get the local
					* endpoints, the node every endpoint, as kube-proxy's --src-type LOCAL rule) */
#define EKP_FE_HOST_BACKEND  (1 << 11) /* IPv6 frontends (ekp_fe6): its backend set holds an endpoint on a node
					* address (EKP_BE_HOST); read by XDP's IPv6 path, which leaves such a
					* frontend whole to tc (ekp_xdp6.h: one hook chooses its backends); the tc
					* IPv6 path serves it since v6legacy; IPv4 frontends never carry it */

struct ekp_frontend {
	__u32 svc_id;           /* host: the service port (membership, affinity, conntrack); never 0 */
	__u32 set_id;           /* host: backend set; slots are ekp_slot_key{set_id, 1..count} */
	__u16 count;            /* host: live slots; 0 = no usable backend (see flags) */
	__u16 flags;            /* host: EKP_FE_* */
	__u32 affinity_timeout; /* host: seconds a client keeps its backend; 0 = no affinity */
	__u16 rev_nat_id;       /* host: key prefix of ekp_srcr (source ranges); never 0 */
	__u16 pad;              /* zero */
};

/* ---- Maglev lookup tables (hash, written by the agent): set -> backend id per table position */

/* The table's size: a prime, the same on every node (--bpf-lb-maglev-table-size; Cilium's default).
 * The loader passes -DEKP_MAGLEV_TABLE_SIZE; the map's value size follows it, so a pinned map keeps
 * the size it was created with (a change is a pin mismatch, as a resized conntrack table is). */
#ifndef EKP_MAGLEV_TABLE_SIZE
#define EKP_MAGLEV_TABLE_SIZE 16381
#endif

struct ekp_maglev_key {
	__u32 set_id; /* host: struct ekp_frontend.set_id of a frontend with EKP_FE_MAGLEV */
};

/* Position h % EKP_MAGLEV_TABLE_SIZE of a flow's hash (ekp_flow_hash of the tuple as it arrives)
 * names its backend. Built by the agent with Maglev's permutations of the backends' addresses
 * (agent/ebpf/maglev.py), so every node holding the same backends fills the same positions. */
struct ekp_maglev {
	__u32 backend_id[EKP_MAGLEV_TABLE_SIZE]; /* host: keys of ekp_be; never 0 in a written table */
};

/* ---- backend slots: (set, slot) -> backend id --------------------------------------------- */

struct ekp_slot_key {
	__u32 set_id; /* host: struct ekp_frontend.set_id */
	__u32 slot;   /* host: 1..count (0 is never written) */
};

struct ekp_slot {
	__u32 backend_id; /* host: key of ekp_be */
};

/* ---- backends: id -> address ----------------------------------------------------------- */

#define EKP_BE_LOCAL       (1 << 0) /* the endpoint runs on this node */
#define EKP_BE_TERMINATING (1 << 1) /* serving but terminating (fallback endpoint) */
#define EKP_BE_HOST        (1 << 2) /* the endpoint's address is one of this node's own (a host-network
				     * endpoint here, the kubernetes Service's API server): its flows
				     * are handed to the node's stack, never source-translated, and
				     * their replies reverse-translated at tc egress (EKP_CT_HOST) */

struct ekp_backend_key {
	__u32 id; /* host: allocated by the agent, stable across restarts; never 0 */
};

struct ekp_backend {
	__be32 addr; /* be: endpoint IP */
	__be16 port; /* be: endpoint port (targetPort resolved) */
	__u8 proto;  /* IPPROTO_* */
	__u8 flags;  /* EKP_BE_* */
};

/* ---- membership: (service port, backend) -> which of its sets hold the backend ---------- */

#define EKP_MEMBER_CLUSTER (1 << 0) /* in the service port's cluster set (frontends without LOCAL) */
#define EKP_MEMBER_LOCAL   (1 << 1) /* in its local set (frontends with EKP_FE_LOCAL) */

struct ekp_member_key {
	__u32 svc_id;     /* host: struct ekp_frontend.svc_id */
	__u32 backend_id; /* host: key of ekp_be */
};

struct ekp_member {
	__u8 flags;  /* EKP_MEMBER_*; an entry with no flag set means "not a member" */
	__u8 pad[3]; /* zero */
};

/* ---- reverse NAT: id -> the frontend (written by the agent; not read by the data path) ---- */

struct ekp_revnat_key {
	__u32 id; /* host: struct ekp_frontend.rev_nat_id */
};

struct ekp_revnat {
	__be32 addr; /* be: frontend address */
	__be16 port; /* be: frontend port */
	__u16 pad;   /* zero */
};

/* ---- conntrack (LRU, TCP and non-TCP tables): a tuple as it arrives -> what to rewrite --- */

enum ekp_ct_dir {
	EKP_CT_FORWARD = 0, /* client -> frontend: rewrite destination (and source when SNAT) */
	EKP_CT_REPLY = 1,   /* backend -> client: source to the frontend, destination when SNAT */
};

/* Flow state, kept alike on both entries of a flow (struct ekp_ct_entry.flags). */
#define EKP_CT_SNAT        (1 << 0) /* source translated: to the node, or the client's own address
				     * with another port (a reply tuple that was taken) */
#define EKP_CT_SEEN_REPLY  (1 << 1) /* a packet came back from the backend */
#define EKP_CT_ESTABLISHED (1 << 2) /* TCP: the client acked the backend's answer; UDP: replied and
				     * older than 2 s. Never early-dropped; the long timeout */
#define EKP_CT_FIN_FWD     (1 << 3) /* the client sent a FIN */
#define EKP_CT_FIN_REPLY   (1 << 4) /* the backend sent a FIN */
#define EKP_CT_RST         (1 << 5) /* either side sent a RST */
#define EKP_CT_MIGRATED    (1 << 6) /* copied from an ABI v1 entry by the upgrade */
#define EKP_CT_ADOPTED     (1 << 7) /* taken over from nf_conntrack at start (a flow kube-proxy or
				     * iptables mode translated): agent/takeover/flows.py */
#define EKP_CT_ORPHAN      (1 << 8) /* TCP: the backend's address is no Service's backend any more
				     * (ekp_addr): only the backend's packets renew the flow, whose
				     * timeout is at most tcp_orphan_s (a live stream keeps answering) */
#define EKP_CT_HOST        (1 << 9) /* the backend is this node's own address (EKP_BE_HOST): packets
				     * are handed to the node's stack, replies leave by tc egress */
#define EKP_CT_HANDOVER    (1 << 10) /* ADOPTED (legacy host routing, or HOST): the kernel's NAT entry for the flow still holds
				     * the tuple the stack would track the translated packets under
				     * (agent/takeover/flows.py): its forward packets drop
				     * (EKP_DROP_HANDOVER) until the agent replaced that entry and
				     * cleared the flag, EKP_CT_HANDOVER_S after created_s at most */
#define EKP_CT_NFPASS      (1 << 11) /* ADOPTED, legacy host routing or HOST: the flow is still
				     * nf_conntrack's, whose NAT entry translates it as before the
				     * attach: a packet hitting either entry passes untranslated
				     * (EKP_STAT_PASS) until the agent swapped the flag for HANDOVER,
				     * EKP_CT_HANDOVER_S after created_s at most */
#define EKP_CT_HANDOVER_S  10

struct ekp_ct_key {
	__be32 saddr; /* be: source address as on the wire */
	__be32 daddr; /* be: destination address as on the wire */
	__be16 sport; /* be */
	__be16 dport; /* be */
	__u8 proto;   /* IPPROTO_*: TCP entries live in ekp_ct_tcp, the others in ekp_ct_any */
	__u8 dir;     /* enum ekp_ct_dir: an original tuple never matches a reply entry */
	__u16 pad;    /* zero */
};

struct ekp_ct_entry {
	__u64 last_seen_ns; /* host: bpf_ktime_get_ns() of the last packet (refreshed once a second) */
	__be32 nat_addr;    /* be: FORWARD: backend address; REPLY: client address if SNAT, else 0 */
	__be32 snat_addr;   /* be: FORWARD: source after SNAT (node, or client) if SNAT, else 0; REPLY: 0 */
	__be32 fe_addr;     /* be: the frontend: FORWARD key's daddr, the source replies get */
	__be16 nat_port;    /* be: FORWARD: backend port; REPLY: client port if SNAT, else 0 */
	__be16 snat_port;   /* be: FORWARD: source port after SNAT if SNAT, else 0; REPLY: 0 */
	__be16 fe_port;     /* be: the frontend port */
	__u16 flags;        /* host: EKP_CT_* */
	__u32 svc_id;       /* host: service port of the flow (membership); 0 = none (a remapped
			     * direct connection) */
	__u32 backend_id;   /* host: backend chosen when the flow began; 0 = none */
	__u32 created_s;    /* host: bpf_ktime_get_ns() / 1e9 when the flow began */
};

/* ---- the early-drop queues of conntrack (arrays, written by the data path) --------------- */

/* Every flow is queued when it begins and again when it closes, in the ring of its table
 * (ekp_ctq_tcp for ekp_ct_tcp, ekp_ctq_any for ekp_ct_any; ekp_ctqh holds where each ring writes
 * next). When a ring comes round to a slot, the flow named there is deleted unless it is assured
 * (EKP_CT_ESTABLISHED) and not closed: at most one ring's worth of flows is ever unassured or
 * closed, so a flood of them cannot evict established flows (bpf/ekp_ctq.h). */
enum ekp_ctq_ring {
	EKP_CTQ_TCP = 0, /* ekp_ctqh index of ekp_ctq_tcp */
	EKP_CTQ_ANY = 1, /* ekp_ctqh index of ekp_ctq_any */
};

/* An ekp_ctqh entry: the ring's position in its high 32 bits (the programs add 1 << 32 per flow
 * queued: one atomic add, and a position past 2^32 falls off the top, never into the count), its
 * slot count in the low 32 bits, written by the agent when it creates or adopts the maps and
 * before any program of its load runs (agent/ebpf/loader.py write_ring_slots), read back from the
 * ring map's max_entries: the sizes are the loader's, not compiled in, so one object serves every
 * size. A 0 count (a head no agent wrote) is BPF's x % 0 = x: queued at the position while it is
 * inside the ring, in no slot after. (Layout v3: v2 had them the other way round, so its heads
 * are other maps.) */
#define EKP_CTQH_POS_SHIFT 32
#define EKP_CTQH_SLOTS_MASK 0xffffffffULL

struct ekp_ctq_slot {
	__be32 saddr;    /* be: the flow's FORWARD key (struct ekp_ct_key's first fields) */
	__be32 daddr;    /* be */
	__be16 sport;    /* be */
	__be16 dport;    /* be */
	__u8 proto;      /* IPPROTO_*; 0 = an empty slot */
	__u8 dir;        /* EKP_CT_FORWARD */
	__u16 pad;       /* zero */
	__u32 created_s; /* host: the flow's created_s when queued (a later flow on the tuple is not it) */
};

/* ---- IPv4 fragments (LRU): the first fragment's ports for the later ones ----------------- */

struct ekp_frag_key {
	__be32 saddr; /* be: source address as on the wire */
	__be32 daddr; /* be: destination address as on the wire */
	__be16 id;    /* be: IPv4 identification */
	__u8 proto;   /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 pad;     /* zero */
};

struct ekp_frag {
	__be16 sport; /* be: the datagram's L4 ports, from its first fragment */
	__be16 dport; /* be */
	__u32 pad;    /* zero */
};

/* ---- IPv4 fragments that came before their first (LRU): held until it comes ------------- */

/* A later fragment with no record in ekp_frag, to an address a translated flow may use (see
 * ekp_addr), is copied here under the first free slot of its datagram; the datagram's first
 * fragment puts every held one back into the device it came in on (bpf/ekp_tc_frag.h). */
#define EKP_FRAGHOLD_SLOTS 8  /* fragments held per datagram */
#define EKP_FRAGHOLD_LEN 1520 /* largest frame held: Ethernet header + 1,506 bytes of IPv4 */

struct ekp_fraghold_key {
	__be32 saddr; /* be: as ekp_frag_key */
	__be32 daddr; /* be */
	__be16 id;    /* be: IPv4 identification */
	__u8 proto;   /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 slot;    /* host: 0..EKP_FRAGHOLD_SLOTS-1, in the order the fragments came */
};

struct ekp_fraghold {
	__u32 ifindex;                  /* host: the device it came in on (it goes back in there) */
	__u16 len;                      /* host: bytes of `data` in use, the whole frame */
	__u16 pad;                      /* zero */
	__u8 data[EKP_FRAGHOLD_LEN];    /* the frame as it arrived, from its Ethernet header */
};

/* ---- service addresses (hash, written by the agent): which addresses a flow may use ------ */

/* One entry per address that is a frontend or a backend, with what it is. Read for a later
 * fragment that came before its first (one that can belong to no translated flow is passed to the
 * stack untouched, which reassembles it: pod to pod, to the node itself, ...), by the activity
 * check of a whole datagram (is its destination a frontend of this scope? ekp_act.h), and by a
 * TCP flow's refresh (is its backend still some Service's? ekp_ct.h). Frontend bits are
 * 1 << enum ekp_scope. */
#define EKP_ADDR_FRONTEND_EXTERNAL (1 << 0) /* a frontend of scope EXTERNAL is on this address */
#define EKP_ADDR_FRONTEND_INTERNAL (1 << 1) /* a frontend of scope INTERNAL is on this address */
#define EKP_ADDR_BACKEND           (1 << 2) /* a backend's address (its replies come from it) */

struct ekp_addr_key {
	__be32 addr; /* be */
};

struct ekp_addr {
	__u8 flags;  /* EKP_ADDR_* */
	__u8 pad[3]; /* zero */
};

/* ---- legacy host routing (LRU, written by the data path): the source a packet gets at egress */

/* With legacy host routing (EKP_CFG_HOST_LEGACY) a translated packet goes through the node's stack
 * between its translations, as in iptables mode: the destination is translated at tc ingress
 * (DNAT, or a reply's destination back to the client), the source at the tc egress of the device
 * the stack routes it out of (SNAT, or a reply's source to the frontend). The ingress program
 * leaves the new source here, under the tuple the packet leaves with and a tag it also writes in
 * skb->tc_index; the egress program (ekp_egress) looks it up (bpf/ekp_host.h). */
struct ekp_hostnat_key {
	__be32 saddr; /* be: the packet's source as it leaves (untranslated) */
	__be32 daddr; /* be: its destination as it leaves (translated at ingress) */
	__be16 sport; /* be */
	__be16 dport; /* be */
	__u8 proto;   /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 pad;     /* zero */
	__u16 tag;    /* host: the flow's tag (a hash of the tuple as it arrived; never 0), the
	               * skb->tc_index the ingress program set: two flows whose packets leave
	               * with the same tuple (a client port reaching one backend through two
	               * frontends) are told apart. 0: the stack's reply tuple of a SNAT flow, for
	               * the packets the stack itself sends about it (ekp_host_note_stack_reply) */
};

struct ekp_hostnat {
	__be32 saddr; /* be: the source the packet leaves with */
	__be16 sport; /* be */
	__u16 pad;    /* zero */
};

/* ---- flow activity (array, written by the data path): which endpoints may have live flows -- */

/* A packet can belong to a translated flow only when its destination is a frontend of the
 * program's scope (ekp_addr) or an endpoint of a live flow: the frontend a flow was sent through
 * (its FORWARD key's destination) or its backend (its REPLY key's source; also the destination of a
 * direct connection that could collide with the flow). Every time the data path stamps a conntrack
 * entry (last_seen_ns), it stamps both endpoints of the flow here, in the slot a hash of
 * (address, port, protocol) picks (bpf/ekp_act.h): a packet whose source and destination slots were
 * stamped longer ago than the longest conntrack timeout can belong to no live flow, and leaves
 * without a conntrack lookup. Slot 0 is no endpoint's: nonzero once the agent has stamped the
 * flows the tables held before these programs ran (an upgrade, a crash before that); until then
 * every packet takes the conntrack lookups. */
#define EKP_ACT_SLOTS (1 << 16) /* slots of ekp_act (a power of two) */
#define EKP_ACT_SHIFT 30        /* a stamp is bpf_ktime_get_ns() >> 30: units of 1.07 s */

struct ekp_act {
	__u32 stamp; /* host: bpf_ktime_get_ns() >> EKP_ACT_SHIFT of the last flow stamped here; 0 =
		      * never. Slot 0: nonzero when armed (see above) */
};

/* ---- session affinity (LRU): (client, service port) -> backend ---------------------------- */

struct ekp_affinity_key {
	__be32 client; /* be: client source address */
	__u32 svc_id;  /* host: struct ekp_frontend.svc_id (affinity spans the port's frontends) */
};

struct ekp_affinity {
	__u64 last_seen_ns; /* host: bpf_ktime_get_ns() of the client's last new flow */
	__u32 backend_id;   /* host; honoured only while ekp_member{svc_id, backend_id} holds it */
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

/* ---- socket-level load balancing (cgroup connect4/sendmsg4/recvmsg4/getpeername4) ------- */
/* (their IPv6 twins use ekp_sknat6, "IPv6 pairs" below, for real IPv6 frontends) */

/* What a socket was sent to instead of the frontend its application named (LRU, written by the
 * socket programs): recvmsg() and getpeername() show the frontend again, and the UDP socket
 * iterator ends a connected socket whose backend left its service port (bpf/ekp_sock.h). */
struct ekp_sock_key {
	__u64 cookie; /* host: bpf_get_socket_cookie(), unique per socket for the machine's life */
	__be32 addr;  /* be: the backend the socket was sent to */
	__be16 port;  /* be: its port */
	__u8 proto;   /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 pad;     /* zero */
};

struct ekp_sock_nat {
	__be32 fe_addr;   /* be: the frontend the application named */
	__be16 fe_port;   /* be */
	__u16 pad;        /* zero */
	__u32 svc_id;     /* host: its service port: shown again only while the frontend still is it */
	__u32 backend_id; /* host: the backend chosen (membership, for the UDP iterator) */
};

/* The socket programs' settings (array, one element, written by the agent before it attaches
 * them). A socket belongs to the node itself when its network namespace is the node's. */
#define EKP_SOCK_HOST_ONLY (1 << 0) /* translate only the node's own sockets (hostNamespaceOnly): pods
				     * keep the per-packet path, where they see the frontend */

struct ekp_sock_config {
	__u64 host_netns; /* host: netns cookie (SO_NETNS_COOKIE) of the node's network namespace */
	__u32 flags;      /* host: EKP_SOCK_* */
	__u32 pad;        /* zero */
};

/* ---- bridge ports (hash, written by the agent): a pod port's ingress ifindex -> its bridge -- */
/* Pods on a Linux bridge (kubenet's cbr0, --detect-local-mode=BridgeInterface): the node routes
 * their addresses by the bridge, never by the port the tc program runs on, so the bpf host
 * routing's source check (ekp_redirect.h ekp_source_routed_here) also accepts a route back by the
 * port's bridge. Keyed by the port's ifindex (skb->ingress_ifindex, nothing a pod can choose); read
 * only when the route back is not the port itself. A device that is no bridge's port (none, or
 * another kind of master: a bond, a VRF) has no entry. */
struct ekp_port {
	__u32 bridge; /* host: ifindex of the bridge (the port's master) in the agent's netns */
};

/* ---- per-node configuration: two slots and a selector (double buffer) ------------------- */

/* ekp_cfg holds two configs; ekp_cfgsel[0] says which one programs read. The agent writes the
 * other slot, then flips the selector: a program never reads a config while it is rewritten. */
struct ekp_config_sel {
	__u32 slot; /* host: 0 or 1, the live element of ekp_cfg */
};

struct ekp_config {
	__be32 node_addr;         /* be: source address for SNAT (remote backends, masquerade, hairpin) */
	__u16 snat_port_min;      /* host: first port for SNAT (inclusive) */
	__u16 snat_port_max;      /* host: last port for SNAT (inclusive) */
	__u32 tcp_established_s;  /* host: idle timeout of an established TCP flow (conntrack.tcpEstablishedTimeout) */
	__u32 tcp_close_wait_s;   /* host: after a FIN from one side (conntrack.tcpCloseWaitTimeout) */
	__u32 tcp_syn_s;          /* host: handshake not completed (SYN sent, or SYN-ACK not yet acked) */
	__u32 tcp_closed_s;       /* host: after a RST, or FINs both ways */
	__u32 udp_s;              /* host: unreplied or short UDP/SCTP flow (conntrack.udpTimeout) */
	__u32 udp_stream_s;       /* host: replied and older than 2 s (conntrack.udpStreamTimeout) */
	__u32 icmp_rate;          /* host: ICMP rejects per second, per CPU (token bucket refill) */
	__u32 icmp_burst;         /* host: ICMP rejects a CPU may send at once (bucket depth) */
	__be32 local_net;         /* be: the local-traffic detector's network (EKP_CFG_LOCAL_BY_SRC) */
	__u8 local_plen;          /* host: its prefix length, 0..32 */
	__u8 flags;               /* host: EKP_CFG_* (below); the byte that was local_by_src (0 or
	                           * 1), whose meaning bit 0 keeps */
	__u16 tcp_orphan_s;       /* host: most a TCP flow whose backend left every Service
				   * (EKP_CT_ORPHAN) lives after the backend's last packet, up to
				   * 65,535; 0 = 300 (nf_conntrack's unacknowledged-data timeout) */
};

/* Config flags (struct ekp_config.flags). */
#define EKP_CFG_LOCAL_BY_SRC (1 << 0) /* a packet is from a local pod when its source is in
				       * local_net/local_plen (--detect-local-mode ClusterCIDR,
				       * NodeCIDR) and looks up INTERNAL frontends, any other EXTERNAL
				       * ones, whatever the hook; unset: the hook's scope (the
				       * interface modes, no detector) */
#define EKP_CFG_HOST_LEGACY (1 << 1)  /* --bpf-host-routing=legacy: translated packets go through
				       * the node's stack (its netfilter and reverse-path filter)
				       * rather than being redirected (bpf/ekp_host.h) */

/* ---- the reject rate limiter (per-CPU array, one element, written by the data path) ------ */

struct ekp_ratelimit {
	__u64 last_ns;   /* host: bpf_ktime_get_ns() of the last refill */
	__u64 tokens_ns; /* host: credit in ns; one ICMP costs 1e9 / icmp_rate */
};

/* ---- counters (per-CPU array indexed by enum ekp_stat) ------------------------------- */

enum ekp_stat {
	EKP_STAT_PACKETS = 0,     /* packets seen by an ekp program */
	EKP_STAT_NEW_FLOWS,       /* outcome: flows translated for the first time */
	EKP_STAT_CT_FORWARD,      /* outcome: packets translated by a forward conntrack hit */
	EKP_STAT_CT_REPLY,        /* outcome: replies reverse-translated */
	EKP_STAT_SNAT,            /* mark: new flows source-translated */
	EKP_STAT_AFFINITY_HIT,    /* mark: new flows that kept their client's backend */
	EKP_STAT_PASS,            /* outcome: packets not for a service, passed to the stack */
	EKP_STAT_CT_RELATED,      /* outcome: ICMP errors about a translated flow, translated back */
	EKP_STAT_EARLY_DROP,      /* mark: unanswered flows evicted to free a SNAT port */
	EKP_STAT_CT_REBUILT,      /* mark: conntrack entries re-created from their surviving twin */
	EKP_STAT_PORT_REMAP,      /* mark: flows given another source port (their reply tuple was taken) */
	EKP_STAT_FRAGMENTS,       /* mark: non-first fragments translated */
	/* drop reasons (update agent/ebpf/abi.py) */
	EKP_STAT_DROP_FIRST,
	EKP_DROP_MALFORMED = EKP_STAT_DROP_FIRST, /* truncated or invalid headers */
	EKP_DROP_NO_ENDPOINTS,    /* service has no endpoints: refused, counts the rejects answered with an
	                           * ICMP port unreachable (verdict redirect) and the packets dropped
	                           * unanswered (TCP RST, non-unicast source, reshaping failed) */
	EKP_DROP_NO_LOCAL,        /* Local policy and no endpoint on this node */
	EKP_DROP_NO_BACKEND,      /* a slot or backend entry missing (mid-update race) */
	EKP_DROP_SOURCE_RANGE,    /* client outside loadBalancerSourceRanges */
	EKP_DROP_FIB,             /* no route to the backend or client */
	EKP_DROP_SNAT_PORTS,      /* no free source port, none to take over (range full of live flows) */
	EKP_DROP_CT_FULL,         /* conntrack insert failed */
	EKP_DROP_FRAG_NO_FIRST,   /* a later fragment whose first fragment was not seen, that could not be held
	                           * (larger than EKP_FRAGHOLD_LEN, EKP_FRAGHOLD_SLOTS of its datagram held) */
	EKP_DROP_NO_FLOW,         /* a mid-flow TCP segment (or later fragment) to a frontend without conntrack:
	                           * never sent to a new backend (an evicted or expired flow) */
	EKP_DROP_BACKEND_GONE,    /* unused since TCP flows keep a removed backend (kube-proxy); kept so the
	                           * indexes of the later counters stay as pinned */
	EKP_DROP_ICMP_RATE,       /* a reject over the ICMP rate limit: dropped unanswered */
	EKP_DROP_FRAG_NEEDED,     /* too big for the egress MTU with DF: answered with ICMP frag needed */
	/* Since ekp_stats_v3, new counters go at the end whatever their kind (a drop reason is named
	 * EKP_DROP_*, which is how agent/ebpf/abi.py tells it from an outcome or a mark). */
	EKP_STAT_FRAG_HELD,       /* outcome: a later fragment held until its first fragment comes */
	EKP_STAT_FRAG_RELEASED,   /* mark: held fragments put back into their device when their first came */
	EKP_STAT_EVICT_UNREPLIED, /* mark: flows deleted by the early-drop queue, no reply seen */
	EKP_STAT_EVICT_UNASSURED, /* mark: ... replied, never assured (TCP handshake not completed, UDP
	                           * not a stream) */
	EKP_STAT_EVICT_CLOSED,    /* mark: ... closed TCP flows (RST, or FINs both ways) */
	EKP_STAT_TO_TC,           /* outcome (XDP only): a service packet XDP leaves to the tc program
	                           * to carry out (a local backend, a reject, a route XDP cannot send) */
	EKP_STAT_CT_RESUMED,      /* mark: a TCP segment without conntrack resumed its flow on the backend
	                           * Maglev names (the entries were lost: evicted, a restart elsewhere) */
	/* Socket-level load balancing: every connect() and sendmsg() (to an address of either family)
	 * of a socket in the attached cgroup counts SOCK_CALLS and exactly one outcome: SOCK_PASS (not
	 * TCP or UDP, not a frontend, another namespace), SOCK_TRANSLATED or one of the drop reasons above
	 * (NO_ENDPOINTS: refused with ECONNREFUSED; NO_LOCAL, SOURCE_RANGE, NO_BACKEND: EHOSTUNREACH).
	 * The rest are marks. */
	EKP_STAT_SOCK_CALLS,      /* connect()/sendmsg() calls seen by the socket programs */
	EKP_STAT_SOCK_PASS,       /* outcome: not a frontend the socket is translated for: unchanged */
	EKP_STAT_SOCK_TRANSLATED, /* outcome: sent to a backend at connect()/sendmsg() */
	EKP_STAT_SOCK_REVNAT,     /* mark: recvmsg()/getpeername() shown the frontend again */
	EKP_STAT_SOCK_DESTROYED,  /* mark: connected UDP sockets ended because their backend left */
	EKP_DROP_SPOOFED,         /* from a pod device, a source address the node does not route to that
	                           * device, on a packet the program would deliver past the node's
	                           * reverse-path filter (redirected: bpf host routing, ICMP errors).
	                           * A drop reason after the socket counters: added after them, and
	                           * every counter keeps its slot in a pinned ekp_stats_v3 */
	EKP_DROP_HANDOVER,        /* a forward packet of a flow taken over from nf_conntrack to a backend
	                           * on the node's own address, before the agent replaced the kernel's
	                           * NAT entry for it (EKP_CT_HANDOVER): the sender retransmits */
	EKP_DROP_TUPLE_TAKEN,     /* a new flow (either family) whose reply tuple another CPU's new flow
	                           * took between the choice of its port and its write (ekp_ct_place):
	                           * its retransmission tries again. (Before: the tc IPv6 path's flows
	                           * on a tuple another frontend held, which get another source port
	                           * since both families share one conntrack, EKP_STAT_PORT_REMAP.) */
	EKP_DROP_HOP_LIMIT,       /* the tc IPv6 path: a segment of a translated flow whose hop limit this
	                           * hop would spend to 0, answered with a time exceeded (ekp_icmp6.h) */
	EKP_STAT_MAX,
};

#define EKP_STAT_COUNT EKP_STAT_MAX
/* Slots of ekp_stats_v3: room for counters added later without a new map (a size change would
 * need one: a pinned map is never resized). */
#define EKP_STAT_SLOTS 64

/* ---- IPv6 pairs: the same entries with 16-byte addresses (see the header comment) ---------- */

/* An IPv6 address is `__be32 x[4]`, as the socket hooks hold it (struct bpf_sock_addr.user_ip6):
 * the 16 bytes in order, compared and copied a word at a time. */

/* ekp_fe6: (address, port, protocol, scope) -> struct ekp_frontend (the v4 value). */
struct ekp_frontend6_key {
	__be32 addr[4]; /* be: ClusterIP, node address (NodePort), external IP or LB IP */
	__be16 port; /* be */
	__u8 proto; /* IPPROTO_* */
	__u8 scope; /* enum ekp_scope */
};

/* ekp_be6: struct ekp_backend_key (the v4 key) -> the endpoint. */
struct ekp_backend6 {
	__be32 addr[4]; /* be: endpoint IP */
	__be16 port; /* be: endpoint port (targetPort resolved) */
	__u8 proto; /* IPPROTO_* */
	__u8 flags; /* EKP_BE_* */
};

/* ekp_rnat6: struct ekp_revnat_key -> the frontend (not read by the data path). */
struct ekp_revnat6 {
	__be32 addr[4]; /* be: frontend address */
	__be16 port; /* be: frontend port */
	__u16 pad; /* zero */
};

/* ekp_aff6: (client, service port) -> struct ekp_affinity (the v4 value). */
struct ekp_affinity6_key {
	__be32 client[4]; /* be: client source address */
	__u32 svc_id; /* host: struct ekp_frontend.svc_id of ekp_fe6 */
};

/* ekp_srcr6 (LPM trie): (frontend, client prefix) -> struct ekp_srcrange (the v4 value). */
struct ekp_srcrange6_key {
	__u32 prefixlen; /* host: 32 (rev_nat_id + pad) + CIDR prefix length (0..128) */
	__u16 rev_nat_id; /* host: the frontend */
	__u16 pad; /* zero */
	__be32 addr[4]; /* be: CIDR network address */
};

/* ekp_addr6: an IPv6 address -> struct ekp_addr (the v4 value), as ekp_addr for IPv4. */
struct ekp_addr6_key {
	__be32 addr[4]; /* be */
};

/* ekp_sknat6: what an IPv6 socket was sent to instead of the IPv6 frontend it named. */
struct ekp_sock6_key {
	__u64 cookie; /* host: bpf_get_socket_cookie() */
	__be32 addr[4]; /* be: the backend the socket was sent to */
	__be16 port; /* be: its port */
	__u8 proto; /* IPPROTO_TCP / IPPROTO_UDP */
	__u8 pad; /* zero */
	__u32 pad2; /* zero */
};

struct ekp_sock6_nat {
	__be32 fe_addr[4]; /* be: the frontend the application named */
	__be16 fe_port; /* be */
	__u16 pad; /* zero */
	__u32 svc_id; /* host: its service port (ekp_fe6's) */
	__u32 backend_id; /* host: the backend chosen (ekp_be6's key; ekp_member6) */
};

/* ekp_ct6_tcp, ekp_ct6_any (LRU, written by the tc programs' IPv6 path, bpf/ekp_tc6.h): a tuple as
 * it arrives -> what to rewrite, IPv4's ekp_ct_key / ekp_ct_entry field for field with 16-byte
 * addresses: one conntrack code serves both (bpf/ekp_ct_af.h), so every field IPv4's reads is here
 * too, the source translation included (to the node's IPv6 address, ekp_cfg6; or the client's own
 * address with another port when a reply tuple was taken). v3: v2 (64 bytes) had no SNAT fields. */
struct ekp_ct6_key {
	__be32 saddr[4]; /* be: source address as on the wire */
	__be32 daddr[4]; /* be: destination address as on the wire */
	__be16 sport; /* be */
	__be16 dport; /* be */
	__u8 proto; /* IPPROTO_*: TCP entries live in ekp_ct6_tcp, the others in ekp_ct6_any */
	__u8 dir; /* enum ekp_ct_dir */
	__u16 pad; /* zero */
};

struct ekp_ct6_entry {
	__u64 last_seen_ns; /* host: bpf_ktime_get_ns() of the last packet (refreshed once a second) */
	__be32 nat_addr[4]; /* be: FORWARD: backend address; REPLY: client address if SNAT, else zero */
	__be32 snat_addr[4]; /* be: FORWARD: source after SNAT (the node's IPv6 address, or the client's
			      * own with another port) if SNAT, else zero; REPLY: zero */
	__be32 fe_addr[4]; /* be: the frontend: FORWARD key's daddr, the source replies get */
	__be16 nat_port; /* be: FORWARD: backend port; REPLY: client port if SNAT, else 0 */
	__be16 snat_port; /* be: FORWARD: source port after SNAT if SNAT, else 0; REPLY: 0 */
	__be16 fe_port; /* be: the frontend port */
	__u16 flags; /* host: EKP_CT_* */
	__u32 svc_id; /* host: service port of the flow (ekp_fe6's); 0 = none */
	__u32 backend_id; /* host: backend chosen when the flow began (ekp_be6's key); 0 = none */
	__u32 created_s; /* host: bpf_ktime_get_ns() / 1e9 when the flow began */
	__u32 pad; /* zero */
};

/* ekp_ctq6_tcp, ekp_ctq6_any (arrays): the early-drop rings of ekp_ct6_tcp and ekp_ct6_any, as
 * ekp_ctq_tcp / ekp_ctq_any are IPv4's (enum ekp_ctq_ring indexes ekp_ctqh6, where each writes
 * next): an IPv6 flood cannot take IPv4's ring slots, nor the reverse. */
struct ekp_ctq6_slot {
	__be32 saddr[4]; /* be: the flow's FORWARD key (struct ekp_ct6_key's first fields) */
	__be32 daddr[4]; /* be */
	__be16 sport; /* be */
	__be16 dport; /* be */
	__u8 proto; /* IPPROTO_*; 0 = an empty slot */
	__u8 dir; /* EKP_CT_FORWARD */
	__u16 pad; /* zero */
	__u32 created_s; /* host: the flow's created_s when queued */
};

/* ekp_cfg6 (array, two elements) and ekp_cfg6sel[0] (struct ekp_config_sel), written by the agent:
 * what the IPv6 path needs beside the shared struct ekp_config (whose SNAT port range and timeouts
 * serve both families), double-buffered as ekp_cfg is: the agent writes the slot the selector does
 * not name, then flips it, so a program never reads a node address while it is rewritten (16
 * bytes: a torn read would be a source of neither address). A map of its own rather than a wider
 * ekp_config: an upgrade adds it, and no v2 layout changes. */
struct ekp_config6 {
	__be32 node_addr[4]; /* be: the source of IPv6 SNAT (masquerade, remote backends, hairpin): the
			      * node's IPv6 address; zero = none known (such flows are left to the stack) */
};

/* ekp_frag6, ekp_fraghold6 (LRU, written by the tc programs' IPv6 path): IPv6 fragments of UDP
 * datagrams, ekp_frag / ekp_fraghold with 16-byte addresses and IPv6's 32-bit fragment id (the
 * fragment header's identification; RFC 8200 reassembles by addresses and id). The values are
 * IPv4's (struct ekp_frag, struct ekp_fraghold: an IPv6 fragment of a 1,500-byte MTU is a 1,514-byte
 * frame, within EKP_FRAGHOLD_LEN); the time of the last hold (ekp_fraglast) serves both families. */
struct ekp_frag6_key {
	__be32 saddr[4]; /* be: source address as on the wire */
	__be32 daddr[4]; /* be: destination address as on the wire */
	__be32 id; /* be: the fragment header's identification */
	__u8 proto; /* IPPROTO_UDP */
	__u8 pad[3]; /* zero */
};

struct ekp_fraghold6_key {
	__be32 saddr[4]; /* be: as ekp_frag6_key */
	__be32 daddr[4]; /* be */
	__be32 id; /* be */
	__u8 proto; /* IPPROTO_UDP */
	__u8 slot; /* host: 0..EKP_FRAGHOLD_SLOTS-1, in the order the fragments came */
	__u16 pad; /* zero */
};

/* ekp_hostnat6 (LRU, written by the tc programs' IPv6 path): legacy host routing's source at egress
 * for IPv6, ekp_hostnat's key and value with 16-byte addresses (bpf/ekp_host_af.h serves both). */
struct ekp_hostnat6_key {
	__be32 saddr[4]; /* be: the packet's source as it leaves (untranslated) */
	__be32 daddr[4]; /* be: its destination as it leaves (translated at ingress) */
	__be16 sport; /* be */
	__be16 dport; /* be */
	__u8 proto; /* IPPROTO_TCP / IPPROTO_UDP / IPPROTO_SCTP */
	__u8 pad; /* zero */
	__u16 tag; /* host: the flow's tag, as ekp_hostnat_key's; 0: the stack's reply tuple of a
		    * SNAT flow (ekp_host6_note_stack_reply), as ekp_hostnat_key's */
};

struct ekp_hostnat6 {
	__be32 saddr[4]; /* be: the source the packet leaves with */
	__be16 sport; /* be */
	__u16 pad; /* zero */
};

/* ---- the hand-over of an upgrade (one map per build, not in the registry) --------------------- */

/* ekp_handover (array, one entry; ekp_tc.c): how the tc and XDP programs of one build behave while
 * an agent that carries conntrack over from older tables (agent/ebpf/upgrade.py) attaches them in
 * front of the older generation's (agent/ebpf/handover.py). Pinned beside the build's programs, not
 * under a registry name: each build reads its own, so the next upgrade, putting another build in
 * front of this one, cannot switch this one's by the same write. Zero when the build is loaded: a
 * plain start never sees another mode. */
enum ekp_handover_mode {
	EKP_HANDOVER_OFF = 0,  /* alone on its hooks: every packet is decided here */
	EKP_HANDOVER_PASS = 1, /* in front, not yet on every device: every packet goes on to the older
				* program behind (TC_ACT_UNSPEC; XDP_PASS) */
	EKP_HANDOVER_MISS = 2, /* in front on every device: a packet this build's conntrack has no flow
				* for (a segment or a reply of a flow the older program translated) goes on
				* to the older program instead of being dropped (no_flow) or passed untouched;
				* XDP passes every packet to tc */
};

struct ekp_handover {
	__u32 mode; /* host: enum ekp_handover_mode */
};

#endif /* EKP_ABI_H */
