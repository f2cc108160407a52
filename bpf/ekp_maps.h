/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_maps.h: every BPF map of the data path, declared once.
 *
 * Names are exactly agent/ebpf/abi.py's MAPS (`ekp_<role>_v<EKP_ABI_VERSION>`); test_abi.py parses
 * this file and checks names, kinds, key/value structs, size macros and flags against the registry.
 *
 * Nothing here names a pin: the agent pins every map of the registry under its --bpf-pin-path when
 * it loads the compiled programs (agent/ebpf/link.py), reusing a pinned map that is exactly the map
 * declared here (checked, never silently), which is how conntrack survives an agent restart; the
 * version in the name keeps old layouts apart. So one compile serves every pin directory on the
 * machine (agent/ebpf/objcache.py).
 *
 * Sizes come from -D macros (EKP_FE_MAX, ...; see MapSpec.size_macro), never from string
 * substitution of this text.
 */
#ifndef EKP_MAPS_H
#define EKP_MAPS_H

#include "ekp_abi.h"

#if !defined(EKP_FE_MAX) || !defined(EKP_SLOT_MAX) || !defined(EKP_BE_MAX) || !defined(EKP_RNAT_MAX) ||         \
	!defined(EKP_MEMBER_MAX) || !defined(EKP_CT_TCP_MAX) || !defined(EKP_CT_ANY_MAX) ||                     \
	!defined(EKP_FRAG_MAX) || !defined(EKP_AFF_MAX) || !defined(EKP_SRCR_MAX) || !defined(EKP_CFG_MAX) ||  \
	!defined(EKP_CFGSEL_MAX) || !defined(EKP_ICMPRL_MAX) || !defined(EKP_STATS_MAX) ||                      \
	!defined(EKP_ADDR_MAX) || !defined(EKP_CTQ_TCP_MAX) || !defined(EKP_CTQ_ANY_MAX) ||                     \
	!defined(EKP_CTQH_MAX) || !defined(EKP_FRAGHOLD_MAX) || !defined(EKP_FRAGLAST_MAX) ||                  \
	!defined(EKP_MAGLEV_MAX) || !defined(EKP_XSTATS_MAX) || !defined(EKP_ACT_MAX) ||                       \
	!defined(EKP_SKNAT_MAX) || !defined(EKP_SKCFG_MAX) || !defined(EKP_HOSTNAT_MAX) ||                   \
	!defined(EKP_FE6_MAX) || !defined(EKP_SLOT6_MAX) || !defined(EKP_BE6_MAX) || !defined(EKP_RNAT6_MAX) ||     \
	!defined(EKP_MEMBER6_MAX) || !defined(EKP_SRCR6_MAX) || !defined(EKP_ADDR6_MAX) ||                     \
	!defined(EKP_AFF6_MAX) || !defined(EKP_SKNAT6_MAX) || !defined(EKP_CT6_TCP_MAX) ||                     \
	!defined(EKP_CT6_ANY_MAX) || !defined(EKP_CTQ6_TCP_MAX) ||                                               \
	!defined(EKP_CTQ6_ANY_MAX) || !defined(EKP_CTQH6_MAX) || !defined(EKP_CFG6_MAX) || !defined(EKP_CFG6SEL_MAX) || \
	!defined(EKP_FRAG6_MAX) || !defined(EKP_FRHOLD6_MAX) || !defined(EKP_HOSTNAT6_MAX) || !defined(EKP_PORT_MAX)
#error "map sizes must be defined with -DEKP_<ROLE>_MAX=N (the loader passes all of them)"
#endif

_Static_assert(EKP_STATS_MAX == EKP_STAT_SLOTS, "ekp_stats_v3 has EKP_STAT_SLOTS slots");
_Static_assert(EKP_XSTATS_MAX == EKP_STAT_SLOTS, "ekp_xstats_v3 has EKP_STAT_SLOTS slots");
_Static_assert(EKP_STAT_MAX <= EKP_STAT_SLOTS, "a counter beyond the slots of ekp_stats_v3");
_Static_assert(EKP_STAT_MAX <= 64, "struct ekp_decision.marks is a 64-bit set of enum ekp_stat");
_Static_assert(EKP_CTQH_MAX == 2, "ekp_ctqh holds one position per early-drop ring");
_Static_assert(EKP_CTQ_TCP_MAX > 0 && EKP_CTQ_ANY_MAX > 0, "an early-drop ring needs a slot");
_Static_assert(EKP_CTQH6_MAX == 2, "ekp_ctqh6 holds one position per early-drop ring");
_Static_assert(EKP_CTQ6_TCP_MAX > 0 && EKP_CTQ6_ANY_MAX > 0, "an early-drop ring needs a slot");
_Static_assert(EKP_FRAGLAST_MAX == 1, "ekp_fraglast holds one time");
_Static_assert(EKP_ACT_MAX == EKP_ACT_SLOTS, "ekp_act has EKP_ACT_SLOTS slots (the slot hash masks with it)");
_Static_assert(EKP_CFG_MAX == 2, "ekp_cfg_v2 holds exactly two struct ekp_config (double buffer)");
_Static_assert(EKP_CFGSEL_MAX == 1, "ekp_cfgsel_v2 holds exactly one selector");
_Static_assert(EKP_ICMPRL_MAX == 1, "ekp_icmprl_v2 holds one bucket per CPU");
_Static_assert(EKP_SKCFG_MAX == 1, "ekp_skcfg_v2 holds one struct ekp_sock_config");
_Static_assert(EKP_CFG6_MAX == 2, "ekp_cfg6_v2 holds exactly two struct ekp_config6 (double buffer)");
_Static_assert(EKP_CFG6SEL_MAX == 1, "ekp_cfg6sel_v2 holds exactly one selector");

/* Service tables, written by the agent only. */
BPF_TABLE("hash", struct ekp_frontend_key, struct ekp_frontend, ekp_fe_v2, EKP_FE_MAX);
BPF_TABLE("hash", struct ekp_slot_key, struct ekp_slot, ekp_slot_v2, EKP_SLOT_MAX);
BPF_TABLE("hash", struct ekp_backend_key, struct ekp_backend, ekp_be_v2, EKP_BE_MAX);
BPF_TABLE("hash", struct ekp_revnat_key, struct ekp_revnat, ekp_rnat_v2, EKP_RNAT_MAX);
BPF_TABLE("hash", struct ekp_member_key, struct ekp_member, ekp_member_v2, EKP_MEMBER_MAX);
BPF_F_TABLE("lpm_trie", struct ekp_srcrange_key, struct ekp_srcrange, ekp_srcr_v2, EKP_SRCR_MAX, BPF_F_NO_PREALLOC);
BPF_TABLE("array", u32, struct ekp_config, ekp_cfg_v2, EKP_CFG_MAX);
BPF_TABLE("array", u32, struct ekp_config_sel, ekp_cfgsel_v2, EKP_CFGSEL_MAX);
/* Holding a few thousand addresses: entries are allocated as written (preallocated, 262,144 would
 * take 20 MiB; the hash buckets alone take 4 MiB, memlock as measured). Looked up once by a
 * packet that no live flow's stamps claim (ekp_act.h): the frontend check. */
BPF_F_TABLE("hash", struct ekp_addr_key, struct ekp_addr, ekp_addr_v2, EKP_ADDR_MAX, BPF_F_NO_PREALLOC);

/* Maglev tables, one per backend set that a Maglev frontend uses: 64 KiB each at the default size,
 * allocated as written (a table exists only for the sets of external frontends; see
 * bpf/README.md, "Maglev", for the memory measured against a shared array and a map of maps). */
BPF_F_TABLE("hash", struct ekp_maglev_key, struct ekp_maglev, ekp_maglev_v2, EKP_MAGLEV_MAX, BPF_F_NO_PREALLOC);

/* Flow state, written by the data path (LRU: a full table evicts the least recently used). The
 * kernel's common LRU list (no BPF_F_NO_COMMON_LRU): every CPU can use every entry, so the tables
 * hold what their size says (see bpf/README.md, "Conntrack capacity", for the measurement that
 * decided it). TCP and the other protocols have separate tables, as Cilium's, so a UDP flood
 * cannot evict TCP flows. */
BPF_TABLE("lru_hash", struct ekp_ct_key, struct ekp_ct_entry, ekp_ct_tcp_v2, EKP_CT_TCP_MAX);
BPF_TABLE("lru_hash", struct ekp_ct_key, struct ekp_ct_entry, ekp_ct_any_v2, EKP_CT_ANY_MAX);
/* The early-drop rings of the two tables (bpf/ekp_ctq.h) and where each writes next. */
BPF_TABLE("array", u32, struct ekp_ctq_slot, ekp_ctq_tcp_v3, EKP_CTQ_TCP_MAX);
BPF_TABLE("array", u32, struct ekp_ctq_slot, ekp_ctq_any_v3, EKP_CTQ_ANY_MAX);
BPF_TABLE("array", u32, u64, ekp_ctqh_v3, EKP_CTQH_MAX);
BPF_TABLE("lru_hash", struct ekp_frag_key, struct ekp_frag, ekp_frag_v2, EKP_FRAG_MAX);
BPF_TABLE("lru_hash", struct ekp_fraghold_key, struct ekp_fraghold, ekp_fraghold_v2, EKP_FRAGHOLD_MAX);
/* When a fragment was last held (bpf_ktime_get_ns): a first fragment looks for held ones only
 * within the kernel's reassembly time after it, so in-order fragments cost what they did. */
BPF_TABLE("array", u32, u64, ekp_fraglast_v2, EKP_FRAGLAST_MAX);
BPF_TABLE("lru_hash", struct ekp_affinity_key, struct ekp_affinity, ekp_aff_v2, EKP_AFF_MAX);
/* Legacy host routing: the source each translated packet gets at egress (bpf/ekp_host.h). Every
 * packet that needs one writes it back when it is missing, so an eviction costs an update. */
BPF_TABLE("lru_hash", struct ekp_hostnat_key, struct ekp_hostnat, ekp_hostnat_v2, EKP_HOSTNAT_MAX);
/* Flow activity: when a live flow last stamped each endpoint slot (bpf/ekp_act.h); read by every
 * packet before any conntrack lookup, an array the JIT reads in place. */
BPF_TABLE("array", u32, struct ekp_act, ekp_act_v2, EKP_ACT_MAX);

/* Bridge ports: a pod port's bridge (struct ekp_port), for the bpf host routing's source check;
 * one entry per port of a bridge, allocated as written (a node without a bridge holds none). */
BPF_F_TABLE("hash", u32, struct ekp_port, ekp_port_v2, EKP_PORT_MAX, BPF_F_NO_PREALLOC);

/* Socket-level load balancing: its settings (written by the agent) and what each socket was sent to
 * (written by the socket programs; LRU: a full table forgets the least recently used sockets, whose
 * recvmsg() and getpeername() then show the backend). */
BPF_TABLE("array", u32, struct ekp_sock_config, ekp_skcfg_v2, EKP_SKCFG_MAX);
BPF_TABLE("lru_hash", struct ekp_sock_key, struct ekp_sock_nat, ekp_sknat_v2, EKP_SKNAT_MAX);

/* IPv6 (ekp_abi.h, "IPv6 pairs"): the service tables of the family, each sized as its IPv4 twin
 * (the same flag), allocated as written (an IPv4-only node pays for their hash buckets alone); the
 * affinity and socket tables, LRU, preallocated as the IPv4 ones. Read by the socket programs and
 * the tc programs' IPv6 path (bpf/ekp_tc6.h), which alone writes its conntrack tables. */
BPF_F_TABLE("hash", struct ekp_frontend6_key, struct ekp_frontend, ekp_fe6_v2, EKP_FE6_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct ekp_slot_key, struct ekp_slot, ekp_slot6_v2, EKP_SLOT6_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct ekp_backend_key, struct ekp_backend6, ekp_be6_v2, EKP_BE6_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct ekp_revnat_key, struct ekp_revnat6, ekp_rnat6_v2, EKP_RNAT6_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct ekp_member_key, struct ekp_member, ekp_member6_v2, EKP_MEMBER6_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("lpm_trie", struct ekp_srcrange6_key, struct ekp_srcrange, ekp_srcr6_v2, EKP_SRCR6_MAX, BPF_F_NO_PREALLOC);
BPF_F_TABLE("hash", struct ekp_addr6_key, struct ekp_addr, ekp_addr6_v2, EKP_ADDR6_MAX, BPF_F_NO_PREALLOC);
BPF_TABLE("lru_hash", struct ekp_affinity6_key, struct ekp_affinity, ekp_aff6_v2, EKP_AFF6_MAX);
BPF_TABLE("lru_hash", struct ekp_sock6_key, struct ekp_sock6_nat, ekp_sknat6_v2, EKP_SKNAT6_MAX);
BPF_TABLE("lru_hash", struct ekp_ct6_key, struct ekp_ct6_entry, ekp_ct6_tcp_v3, EKP_CT6_TCP_MAX);
BPF_TABLE("lru_hash", struct ekp_ct6_key, struct ekp_ct6_entry, ekp_ct6_any_v3, EKP_CT6_ANY_MAX);
BPF_TABLE("array", u32, struct ekp_ctq6_slot, ekp_ctq6_tcp_v3, EKP_CTQ6_TCP_MAX);
BPF_TABLE("array", u32, struct ekp_ctq6_slot, ekp_ctq6_any_v3, EKP_CTQ6_ANY_MAX);
BPF_TABLE("array", u32, u64, ekp_ctqh6_v3, EKP_CTQH6_MAX);
/* The IPv6 path's own settings (the node's IPv6 address for SNAT), written by the agent: two slots
 * and their selector, as ekp_cfg_v2 / ekp_cfgsel_v2. */
BPF_TABLE("array", u32, struct ekp_config6, ekp_cfg6_v2, EKP_CFG6_MAX);
/* IPv6 fragments of the tc IPv6 path's UDP flows (ekp_frag_af.h), as ekp_frag / ekp_fraghold. */
BPF_TABLE("lru_hash", struct ekp_frag6_key, struct ekp_frag, ekp_frag6_v2, EKP_FRAG6_MAX);
BPF_TABLE("lru_hash", struct ekp_fraghold6_key, struct ekp_fraghold, ekp_frhold6_v2, EKP_FRHOLD6_MAX);
BPF_TABLE("array", u32, struct ekp_config_sel, ekp_cfg6sel_v2, EKP_CFG6SEL_MAX);
/* Legacy host routing's egress source for IPv6 (ekp_host_af.h), as ekp_hostnat_v2. */
BPF_TABLE("lru_hash", struct ekp_hostnat6_key, struct ekp_hostnat6, ekp_hostnat6_v2, EKP_HOSTNAT6_MAX);

/* The reject rate limiter's bucket, one per CPU; counters, per CPU, indexed by enum ekp_stat. */
BPF_TABLE("percpu_array", u32, struct ekp_ratelimit, ekp_icmprl_v2, EKP_ICMPRL_MAX);
BPF_TABLE("percpu_array", u32, u64, ekp_stats_v3, EKP_STATS_MAX);
/* The XDP program's counters, the same enum ekp_stat as the tc programs' (beside them, not mixed). */
BPF_TABLE("percpu_array", u32, u64, ekp_xstats_v3, EKP_XSTATS_MAX);

/*
 * Map access. bcc rewrites `map.lookup(...)` into helper calls only inside the main source file
 * (its rewrite of an included header is discarded, leaving an indirect call the verifier rejects
 * as "unknown opcode 8d"), so the headers reach the maps only through these one-line functions,
 * defined in ekp_tc.c. update = BPF_ANY, insert = BPF_NOEXIST. The conntrack accessors pick the
 * TCP or the other table by the key's protocol.
 */
static __always_inline struct ekp_frontend *ekp_fe_lookup(struct ekp_frontend_key *k);
static __always_inline struct ekp_slot *ekp_slot_lookup(struct ekp_slot_key *k);
static __always_inline struct ekp_backend *ekp_be_lookup(struct ekp_backend_key *k);
static __always_inline struct ekp_member *ekp_member_lookup(struct ekp_member_key *k);
static __always_inline struct ekp_srcrange *ekp_srcr_lookup(struct ekp_srcrange_key *k);
static __always_inline struct ekp_config *ekp_cfg_lookup(u32 *k);
static __always_inline struct ekp_config_sel *ekp_cfgsel_lookup(u32 *k);
static __always_inline struct ekp_ct_entry *ekp_ct_lookup(struct ekp_ct_key *k);
static __always_inline struct ekp_ct_entry *ekp_ct_tcp_lookup(struct ekp_ct_key *k);
static __always_inline struct ekp_ct_entry *ekp_ct_any_lookup(struct ekp_ct_key *k);
static __always_inline int ekp_ct_update(struct ekp_ct_key *k, struct ekp_ct_entry *v);
static __always_inline int ekp_ct_insert(struct ekp_ct_key *k, struct ekp_ct_entry *v);
static __always_inline int ekp_ct_delete(struct ekp_ct_key *k);
static __always_inline struct ekp_frag *ekp_frag_lookup(struct ekp_frag_key *k);
static __always_inline int ekp_frag_update(struct ekp_frag_key *k, struct ekp_frag *v);
static __always_inline struct ekp_fraghold *ekp_fraghold_lookup(struct ekp_fraghold_key *k);
static __always_inline int ekp_fraghold_insert(struct ekp_fraghold_key *k, struct ekp_fraghold *v);
static __always_inline int ekp_fraghold_delete(struct ekp_fraghold_key *k);
static __always_inline u64 *ekp_fraglast_lookup(u32 *k);
static __always_inline struct ekp_addr *ekp_addr_lookup(struct ekp_addr_key *k);
static __always_inline struct ekp_ctq_slot *ekp_ctq_lookup(__u32 ring, __u32 *slot);
static __always_inline u64 *ekp_ctqh_lookup(u32 *ring);
static __always_inline struct ekp_act *ekp_act_lookup(u32 *k);
static __always_inline struct ekp_affinity *ekp_aff_lookup(struct ekp_affinity_key *k);
static __always_inline int ekp_aff_update(struct ekp_affinity_key *k, struct ekp_affinity *v);
static __always_inline struct ekp_hostnat *ekp_hostnat_lookup(struct ekp_hostnat_key *k);
static __always_inline struct ekp_port *ekp_port_lookup(u32 *k);
static __always_inline int ekp_hostnat_update(struct ekp_hostnat_key *k, struct ekp_hostnat *v);
static __always_inline struct ekp_ratelimit *ekp_icmprl_lookup(u32 *k);
static __always_inline u64 *ekp_stats_lookup(u32 *k);
static __always_inline u64 *ekp_xstats_lookup(u32 *k);
static __always_inline struct ekp_maglev *ekp_maglev_lookup(struct ekp_maglev_key *k);
static __always_inline struct ekp_sock_config *ekp_skcfg_lookup(u32 *k);
static __always_inline struct ekp_sock_nat *ekp_sknat_lookup(struct ekp_sock_key *k);
static __always_inline int ekp_sknat_update(struct ekp_sock_key *k, struct ekp_sock_nat *v);
static __always_inline int ekp_sknat_delete(struct ekp_sock_key *k);

static __always_inline struct ekp_frontend *ekp_fe6_lookup(struct ekp_frontend6_key *k);
static __always_inline struct ekp_slot *ekp_slot6_lookup(struct ekp_slot_key *k);
static __always_inline struct ekp_backend6 *ekp_be6_lookup(struct ekp_backend_key *k);
static __always_inline struct ekp_member *ekp_member6_lookup(struct ekp_member_key *k);
static __always_inline struct ekp_srcrange *ekp_srcr6_lookup(struct ekp_srcrange6_key *k);
static __always_inline struct ekp_affinity *ekp_aff6_lookup(struct ekp_affinity6_key *k);
static __always_inline int ekp_aff6_update(struct ekp_affinity6_key *k, struct ekp_affinity *v);
static __always_inline struct ekp_sock6_nat *ekp_sknat6_lookup(struct ekp_sock6_key *k);
static __always_inline int ekp_sknat6_update(struct ekp_sock6_key *k, struct ekp_sock6_nat *v);
static __always_inline int ekp_sknat6_delete(struct ekp_sock6_key *k);
static __always_inline struct ekp_addr *ekp_addr6_lookup(struct ekp_addr6_key *k);
static __always_inline struct ekp_ct6_entry *ekp_ct6_lookup(struct ekp_ct6_key *k);
static __always_inline struct ekp_ct6_entry *ekp_ct6_tcp_lookup(struct ekp_ct6_key *k);
static __always_inline struct ekp_ct6_entry *ekp_ct6_any_lookup(struct ekp_ct6_key *k);
static __always_inline struct ekp_ctq6_slot *ekp_ctq6_lookup(__u32 ring, __u32 *slot);
static __always_inline u64 *ekp_ctqh6_lookup(u32 *ring);
static __always_inline int ekp_ct6_update(struct ekp_ct6_key *k, struct ekp_ct6_entry *v);
static __always_inline int ekp_ct6_insert(struct ekp_ct6_key *k, struct ekp_ct6_entry *v);
static __always_inline int ekp_ct6_delete(struct ekp_ct6_key *k);
static __always_inline struct ekp_config6 *ekp_cfg6_lookup(u32 *k);
static __always_inline struct ekp_config_sel *ekp_cfg6sel_lookup(u32 *k);
static __always_inline struct ekp_frag *ekp_frag6_lookup(struct ekp_frag6_key *k);
static __always_inline int ekp_frag6_update(struct ekp_frag6_key *k, struct ekp_frag *v);
static __always_inline struct ekp_fraghold *ekp_fraghold6_lookup(struct ekp_fraghold6_key *k);
static __always_inline int ekp_fraghold6_insert(struct ekp_fraghold6_key *k, struct ekp_fraghold *v);
static __always_inline int ekp_fraghold6_delete(struct ekp_fraghold6_key *k);
static __always_inline struct ekp_hostnat6 *ekp_hostnat6_lookup(struct ekp_hostnat6_key *k);
static __always_inline int ekp_hostnat6_update(struct ekp_hostnat6_key *k, struct ekp_hostnat6 *v);

#endif /* EKP_MAPS_H */
