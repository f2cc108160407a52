/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc.c: the programs of ebpf-kube-proxy, bcc's main file (the name is the tc programs', the first
 * ones; every program shares the maps declared once in ekp_maps.h and one build):
 *
 *   ekp_from_pod  ingress of the node side of every pod veth        (scope EKP_SCOPE_INTERNAL)
 *   ekp_from_net  ingress of the node's external devices (--devices) (scope EKP_SCOPE_EXTERNAL)
 *   ekp_egress    egress of both: packets the ingress programs handed to the stack with a tag
 *                 (legacy host routing) get their source (ekp_host.h); the node's own replies
 *                 for flows handed to its stack (a backend on the node's own address) get their
 *                 frontend back (ekp_core.h)
 *   ekp_egress6   legacy host routing's egress half for IPv6, reached from ekp_egress by a tail
 *                 call (ekp_calls6), as ekp_from_pod6 / ekp_from_net6 from the ingress programs
 *   ekp_xdp_net   XDP of the same external devices (--bpf-xdp), ahead of ekp_from_net; IPv6
 *                 continues in ekp_xdp_net6 (ekp_xdp6.h) by a tail call, as the tc programs' does
 *   ekp_sock_conn, ekp_sock_send, ekp_sock_recv, ekp_sock_peer
 *                 cgroup connect4, sendmsg4, recvmsg4, getpeername4 of the node's sockets
 *                 (--bpf-socket-lb-cgroup; ekp_sock.h), and with a 6 their IPv6 hooks, for IPv4
 *                 addresses on IPv6 sockets
 *   ekp_sock_free cgroup sock_release of the same cgroup: forgets a closed socket (ekp_sock.h)
 *   ekp_sock_term iter/udp: ends connected UDP sockets whose backend left (ekp_sock.h)
 *
 * Built by agent/ebpf/compile.py with bcc: BPF(src_file=ekp_tc.c, cflags=[-DEKP_<ROLE>_MAX=...,
 * -I<bpf dir>]), loaded against the pinned maps by agent/ebpf/link.py. The logic lives in the headers (ekp_core.h first); this
 * file holds only what bcc needs in its main file: the map accessors (see ekp_maps.h) and the
 * program entry points.
 */
#include <linux/in.h>

#include "ekp_maps.h"
#include "ekp_tc_scratch.h"

/* Working memory of the apply step (ekp_tc_scratch.h): private to this load, not pinned. */
BPF_PERCPU_ARRAY(ekp_scratch, struct ekp_tc_scratch, 1);

/* ---- map accessors: bcc rewrites these `map.op()` calls because they are in the main file ---- */

static __always_inline struct ekp_frontend *ekp_fe_lookup(struct ekp_frontend_key *k)
{
	return ekp_fe_v2.lookup(k);
}

static __always_inline struct ekp_slot *ekp_slot_lookup(struct ekp_slot_key *k)
{
	return ekp_slot_v2.lookup(k);
}

static __always_inline struct ekp_backend *ekp_be_lookup(struct ekp_backend_key *k)
{
	return ekp_be_v2.lookup(k);
}

static __always_inline struct ekp_member *ekp_member_lookup(struct ekp_member_key *k)
{
	return ekp_member_v2.lookup(k);
}

static __always_inline struct ekp_srcrange *ekp_srcr_lookup(struct ekp_srcrange_key *k)
{
	return ekp_srcr_v2.lookup(k);
}

static __always_inline struct ekp_config *ekp_cfg_lookup(u32 *k)
{
	return ekp_cfg_v2.lookup(k);
}

static __always_inline struct ekp_config_sel *ekp_cfgsel_lookup(u32 *k)
{
	return ekp_cfgsel_v2.lookup(k);
}

/* TCP flows and the others live in separate tables (a UDP flood cannot evict TCP flows). */
static __always_inline struct ekp_ct_entry *ekp_ct_tcp_lookup(struct ekp_ct_key *k)
{
	return ekp_ct_tcp_v2.lookup(k);
}

static __always_inline struct ekp_ct_entry *ekp_ct_any_lookup(struct ekp_ct_key *k)
{
	return ekp_ct_any_v2.lookup(k);
}

static __always_inline struct ekp_ct_entry *ekp_ct_lookup(struct ekp_ct_key *k)
{
	if (k->proto == IPPROTO_TCP)
		return ekp_ct_tcp_v2.lookup(k);
	return ekp_ct_any_v2.lookup(k);
}

static __always_inline int ekp_ct_update(struct ekp_ct_key *k, struct ekp_ct_entry *v)
{
	if (k->proto == IPPROTO_TCP)
		return ekp_ct_tcp_v2.update(k, v);
	return ekp_ct_any_v2.update(k, v);
}

static __always_inline int ekp_ct_insert(struct ekp_ct_key *k, struct ekp_ct_entry *v)
{
	if (k->proto == IPPROTO_TCP)
		return ekp_ct_tcp_v2.insert(k, v);
	return ekp_ct_any_v2.insert(k, v);
}

static __always_inline int ekp_ct_delete(struct ekp_ct_key *k)
{
	if (k->proto == IPPROTO_TCP)
		return ekp_ct_tcp_v2.delete(k);
	return ekp_ct_any_v2.delete(k);
}

static __always_inline struct ekp_frag *ekp_frag_lookup(struct ekp_frag_key *k)
{
	return ekp_frag_v2.lookup(k);
}

static __always_inline int ekp_frag_update(struct ekp_frag_key *k, struct ekp_frag *v)
{
	return ekp_frag_v2.update(k, v);
}

/* Fragments that came before their first, held until it comes (ekp_tc_frag.h). */
static __always_inline struct ekp_fraghold *ekp_fraghold_lookup(struct ekp_fraghold_key *k)
{
	return ekp_fraghold_v2.lookup(k);
}

static __always_inline int ekp_fraghold_insert(struct ekp_fraghold_key *k, struct ekp_fraghold *v)
{
	return ekp_fraghold_v2.insert(k, v);
}

static __always_inline int ekp_fraghold_delete(struct ekp_fraghold_key *k)
{
	return ekp_fraghold_v2.delete(k);
}

static __always_inline u64 *ekp_fraglast_lookup(u32 *k)
{
	return ekp_fraglast_v2.lookup(k);
}

static __always_inline struct ekp_addr *ekp_addr_lookup(struct ekp_addr_key *k)
{
	return ekp_addr_v2.lookup(k);
}

/* The early-drop ring of a conntrack table (enum ekp_ctq_ring), and the rings' write positions. */
static __always_inline struct ekp_ctq_slot *ekp_ctq_lookup(__u32 ring, __u32 *slot)
{
	if (ring == EKP_CTQ_TCP)
		return ekp_ctq_tcp_v3.lookup(slot);
	return ekp_ctq_any_v3.lookup(slot);
}

static __always_inline u64 *ekp_ctqh_lookup(u32 *ring)
{
	return ekp_ctqh_v3.lookup(ring);
}

static __always_inline struct ekp_act *ekp_act_lookup(u32 *k)
{
	return ekp_act_v2.lookup(k);
}

static __always_inline struct ekp_affinity *ekp_aff_lookup(struct ekp_affinity_key *k)
{
	return ekp_aff_v2.lookup(k);
}

static __always_inline int ekp_aff_update(struct ekp_affinity_key *k, struct ekp_affinity *v)
{
	return ekp_aff_v2.update(k, v);
}

static __always_inline struct ekp_hostnat *ekp_hostnat_lookup(struct ekp_hostnat_key *k)
{
	return ekp_hostnat_v2.lookup(k);
}

static __always_inline int ekp_hostnat_update(struct ekp_hostnat_key *k, struct ekp_hostnat *v)
{
	return ekp_hostnat_v2.update(k, v);
}

static __always_inline struct ekp_ratelimit *ekp_icmprl_lookup(u32 *k)
{
	return ekp_icmprl_v2.lookup(k);
}

static __always_inline u64 *ekp_stats_lookup(u32 *k)
{
	return ekp_stats_v3.lookup(k);
}

static __always_inline u64 *ekp_xstats_lookup(u32 *k)
{
	return ekp_xstats_v3.lookup(k);
}

static __always_inline struct ekp_maglev *ekp_maglev_lookup(struct ekp_maglev_key *k)
{
	return ekp_maglev_v2.lookup(k);
}

static __always_inline struct ekp_sock_config *ekp_skcfg_lookup(u32 *k)
{
	return ekp_skcfg_v2.lookup(k);
}

static __always_inline struct ekp_sock_nat *ekp_sknat_lookup(struct ekp_sock_key *k)
{
	return ekp_sknat_v2.lookup(k);
}

static __always_inline int ekp_sknat_update(struct ekp_sock_key *k, struct ekp_sock_nat *v)
{
	return ekp_sknat_v2.update(k, v);
}

static __always_inline int ekp_sknat_delete(struct ekp_sock_key *k)
{
	return ekp_sknat_v2.delete(k);
}

static __always_inline struct ekp_frontend *ekp_fe6_lookup(struct ekp_frontend6_key *k)
{
	return ekp_fe6_v2.lookup(k);
}

static __always_inline struct ekp_slot *ekp_slot6_lookup(struct ekp_slot_key *k)
{
	return ekp_slot6_v2.lookup(k);
}

static __always_inline struct ekp_backend6 *ekp_be6_lookup(struct ekp_backend_key *k)
{
	return ekp_be6_v2.lookup(k);
}

static __always_inline struct ekp_member *ekp_member6_lookup(struct ekp_member_key *k)
{
	return ekp_member6_v2.lookup(k);
}

static __always_inline struct ekp_srcrange *ekp_srcr6_lookup(struct ekp_srcrange6_key *k)
{
	return ekp_srcr6_v2.lookup(k);
}

static __always_inline struct ekp_affinity *ekp_aff6_lookup(struct ekp_affinity6_key *k)
{
	return ekp_aff6_v2.lookup(k);
}

static __always_inline int ekp_aff6_update(struct ekp_affinity6_key *k, struct ekp_affinity *v)
{
	return ekp_aff6_v2.update(k, v);
}

static __always_inline struct ekp_sock6_nat *ekp_sknat6_lookup(struct ekp_sock6_key *k)
{
	return ekp_sknat6_v2.lookup(k);
}

static __always_inline int ekp_sknat6_update(struct ekp_sock6_key *k, struct ekp_sock6_nat *v)
{
	return ekp_sknat6_v2.update(k, v);
}

static __always_inline int ekp_sknat6_delete(struct ekp_sock6_key *k)
{
	return ekp_sknat6_v2.delete(k);
}

static __always_inline struct ekp_addr *ekp_addr6_lookup(struct ekp_addr6_key *k)
{
	return ekp_addr6_v2.lookup(k);
}

/* The early-drop rings of the IPv6 tables (enum ekp_ctq_ring) and their write positions. */
static __always_inline struct ekp_ctq6_slot *ekp_ctq6_lookup(__u32 ring, __u32 *slot)
{
	if (ring == EKP_CTQ_TCP)
		return ekp_ctq6_tcp_v3.lookup(slot);
	return ekp_ctq6_any_v3.lookup(slot);
}

static __always_inline u64 *ekp_ctqh6_lookup(u32 *ring)
{
	return ekp_ctqh6_v3.lookup(ring);
}

/* IPv6 conntrack: TCP and the others apart, as IPv4's. */
static __always_inline struct ekp_ct6_entry *ekp_ct6_lookup(struct ekp_ct6_key *k)
{
	if (k->proto == IPPROTO_TCP)
		return ekp_ct6_tcp_v3.lookup(k);
	return ekp_ct6_any_v3.lookup(k);
}

/* One table each, for the SNAT port walk (ekp_snat.h: a table chosen per probe splits the verifier's
 * states). */
static __always_inline struct ekp_ct6_entry *ekp_ct6_tcp_lookup(struct ekp_ct6_key *k)
{
	return ekp_ct6_tcp_v3.lookup(k);
}

static __always_inline struct ekp_ct6_entry *ekp_ct6_any_lookup(struct ekp_ct6_key *k)
{
	return ekp_ct6_any_v3.lookup(k);
}

static __always_inline int ekp_ct6_update(struct ekp_ct6_key *k, struct ekp_ct6_entry *v)
{
	if (k->proto == IPPROTO_TCP)
		return ekp_ct6_tcp_v3.update(k, v);
	return ekp_ct6_any_v3.update(k, v);
}

static __always_inline int ekp_ct6_delete(struct ekp_ct6_key *k)
{
	if (k->proto == IPPROTO_TCP)
		return ekp_ct6_tcp_v3.delete(k);
	return ekp_ct6_any_v3.delete(k);
}

static __always_inline int ekp_ct6_insert(struct ekp_ct6_key *k, struct ekp_ct6_entry *v)
{
	if (k->proto == IPPROTO_TCP)
		return ekp_ct6_tcp_v3.insert(k, v);
	return ekp_ct6_any_v3.insert(k, v);
}

static __always_inline struct ekp_config6 *ekp_cfg6_lookup(u32 *k)
{
	return ekp_cfg6_v2.lookup(k);
}

static __always_inline struct ekp_config_sel *ekp_cfg6sel_lookup(u32 *k)
{
	return ekp_cfg6sel_v2.lookup(k);
}

/* The IPv6 path's fragments (ekp_frag_af.h), as ekp_frag / ekp_fraghold. */
static __always_inline struct ekp_frag *ekp_frag6_lookup(struct ekp_frag6_key *k)
{
	return ekp_frag6_v2.lookup(k);
}

static __always_inline int ekp_frag6_update(struct ekp_frag6_key *k, struct ekp_frag *v)
{
	return ekp_frag6_v2.update(k, v);
}

static __always_inline struct ekp_fraghold *ekp_fraghold6_lookup(struct ekp_fraghold6_key *k)
{
	return ekp_frhold6_v2.lookup(k);
}

static __always_inline int ekp_fraghold6_insert(struct ekp_fraghold6_key *k, struct ekp_fraghold *v)
{
	return ekp_frhold6_v2.insert(k, v);
}

static __always_inline int ekp_fraghold6_delete(struct ekp_fraghold6_key *k)
{
	return ekp_frhold6_v2.delete(k);
}

static __always_inline struct ekp_hostnat6 *ekp_hostnat6_lookup(struct ekp_hostnat6_key *k)
{
	return ekp_hostnat6_v2.lookup(k);
}

static __always_inline int ekp_hostnat6_update(struct ekp_hostnat6_key *k, struct ekp_hostnat6 *v)
{
	return ekp_hostnat6_v2.update(k, v);
}

static __always_inline struct ekp_port *ekp_port_lookup(u32 *k)
{
	return ekp_port_v2.lookup(k);
}

static __always_inline struct ekp_tc_scratch *ekp_scratch_lookup(void)
{
	u32 zero = 0;
	return ekp_scratch.lookup(&zero);
}

static __always_inline struct ekp_snat_state *ekp_snat_state_lookup(void)
{
	struct ekp_tc_scratch *w = ekp_scratch_lookup();
	return w ? &w->snat : NULL;
}

#if EKP_SNAT_BPF_LOOP
/* The SNAT port walk's probe (ekp_snat_af.h), a bpf_loop callback: not static, so bcc compiles it
 * as a function of its own (a static one lands in .text, which bcc does not hand out), and with
 * one parameter (bcc reads a second one as a kprobe's register); the loader links it into the
 * programs that walk (agent/ebpf/programs.py ProgSpec.callback). */
long ekp_snat_callback(__u32 i)
{
	struct ekp_snat_state *s = ekp_snat_state_lookup();
	return s ? ekp_snat_probe(s, i) : 1;
}
#endif

/* The hand-over mode of this build (struct ekp_handover): private to the build, pinned beside its
 * programs by the loader (agent/ebpf/link.py BUILD_MAPS), so one write switches all of them. */
BPF_ARRAY(ekp_handover, struct ekp_handover, 1);

static __always_inline __u32 ekp_handover_mode(void)
{
	u32 zero = 0;
	struct ekp_handover *h = ekp_handover.lookup(&zero);
	return h ? h->mode : EKP_HANDOVER_OFF;
}

/* ---- programs ---- */

#include "ekp_core.h"
#include "ekp_tc6.h"
#include "ekp_xdp.h"
#include "ekp_xdp6.h"
#include "ekp_decide6.h"

/* The IPv6 path's working memory (ekp_tc6.h), private to this load as ekp_scratch. */
BPF_PERCPU_ARRAY(ekp_scratch6, struct ekp_tc6_scratch, 1);

static __always_inline struct ekp_tc6_scratch *ekp_scratch6_lookup(void)
{
	u32 zero = 0;
	return ekp_scratch6.lookup(&zero);
}

static __always_inline struct ekp_snat6_state *ekp_snat6_state_lookup(void)
{
	struct ekp_tc6_scratch *w = ekp_scratch6_lookup();
	return w ? &w->snat : NULL;
}

#if EKP_SNAT_BPF_LOOP
/* IPv6's walk probe, as ekp_snat_callback. */
long ekp_snat6_callback(__u32 i)
{
	struct ekp_snat6_state *s = ekp_snat6_state_lookup();
	return s ? ekp_snat6_probe(s, i) : 1;
}
#endif

/* The IPv6 programs, by index (EKP_CALL6_*), filled by the loader (agent/ebpf/link.py) and pinned
 * beside the programs of this build: a separate program per family keeps each one's verification
 * and per-packet work its own (ekp_tc6.h). */
#define EKP_CALL6_FROM_POD 0
#define EKP_CALL6_FROM_NET 1
#define EKP_CALL6_EGRESS 2
BPF_PROG_ARRAY(ekp_calls6, 3);

/* An IPv6 packet continues in its family's program; when that is not there (an empty slot), it
 * falls through to the IPv4 program, whose parser passes it to the stack untouched. In front of an
 * older generation (ekp_handover), nothing is decided here until every device has both; then the
 * IPv4 misses go on to the older program (ekp_main). The IPv6 program decides alone: the hand-over
 * is for conntrack carried from older tables, which are IPv4's (agent/ebpf/upgrade.py). */
int ekp_from_pod(struct __sk_buff *skb)
{
	__u32 handover = ekp_handover_mode();

	if (handover == EKP_HANDOVER_PASS)
		return TC_ACT_UNSPEC;
	if (skb->protocol == htons(ETH_P_IPV6))
		ekp_calls6.call(skb, EKP_CALL6_FROM_POD);
	return ekp_main(skb, EKP_SCOPE_INTERNAL, handover);
}

int ekp_from_net(struct __sk_buff *skb)
{
	__u32 handover = ekp_handover_mode();

	if (handover == EKP_HANDOVER_PASS)
		return TC_ACT_UNSPEC;
	if (skb->protocol == htons(ETH_P_IPV6))
		ekp_calls6.call(skb, EKP_CALL6_FROM_NET);
	return ekp_main(skb, EKP_SCOPE_EXTERNAL, handover);
}

int ekp_from_pod6(struct __sk_buff *skb)
{
	return ekp_main6(skb, EKP_SCOPE_INTERNAL);
}

int ekp_from_net6(struct __sk_buff *skb)
{
	return ekp_main6(skb, EKP_SCOPE_EXTERNAL);
}

/* An IPv6 packet with work at egress (a tag: legacy host routing; the node's own, no ingress
 * device: a reply of a backend on its address) continues in ekp_egress6; an untagged forwarded
 * packet of either family leaves after the same two loads as before (the family is looked at
 * only past them). */
int ekp_egress(struct __sk_buff *skb)
{
	__u32 handover = ekp_handover_mode();

	if (handover == EKP_HANDOVER_PASS)
		return TC_ACT_UNSPEC;
	if ((skb->tc_index || !skb->ingress_ifindex) && skb->protocol == htons(ETH_P_IPV6))
		ekp_calls6.call(skb, EKP_CALL6_EGRESS);
	return ekp_egress_main(skb, handover);
}

/* ekp_egress's IPv6 half: a tagged packet gets its source (legacy host routing, ekp_host6.h);
 * the node's own, its frontend when it answers a flow handed to its stack (ekp_tc6_local). A packet
 * it does not translate leaves (TC_ACT_OK) in EKP_HANDOVER_MISS too, where IPv4's miss goes on to
 * the older build (TC_ACT_UNSPEC): as the IPv6 ingress programs, it decides alone, since the IPv6
 * tables (ekp_ct6_*, ekp_hostnat6_v2) are the pinned maps every build of one ABI shares, so an
 * older build's ekp_egress6 would find nothing this one does not. */
int ekp_egress6(struct __sk_buff *skb)
{
	__u16 tag = skb->tc_index;

	if (tag)
		return ekp_host6_egress(skb, tag);
	return ekp_tc6_local(skb);
}

/* The XDP program's IPv6 path (EKP_XCALL6_NET), filled as ekp_calls6 where ekp_xdp_net6 is loaded
 * (agent/ebpf/loader.py: XDP attaches, the kernel has bpf_xdp_load_bytes): a program array holds
 * one program type, so XDP's is an array of its own. An empty slot: IPv6 goes on to IPv4's parser,
 * which passes it to tc. */
#define EKP_XCALL6_NET 0
BPF_PROG_ARRAY(ekp_xcalls6, 1);

/* XDP on the external devices (--bpf-xdp): before the skb exists, the part of ekp_from_net's work
 * that needs no skb (ekp_xdp.h); everything else goes on to ekp_from_net. During a hand-over XDP
 * has no older program behind it (one per device): every packet goes to tc, where the older
 * generation's filter is. */
int ekp_xdp_net(struct xdp_md *ctx)
{
	if (ekp_handover_mode() != EKP_HANDOVER_OFF)
		return XDP_PASS;
	void *data = (void *)(long)ctx->data;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) <= (void *)(long)ctx->data_end && eth->h_proto == htons(ETH_P_IPV6))
		ekp_xcalls6.call(ctx, EKP_XCALL6_NET);
	return ekp_xdp_main(ctx);
}

int ekp_xdp_net6(struct xdp_md *ctx)
{
	return ekp_xdp_main6(ctx);
}

#include "ekp_sock.h"

int ekp_sock_conn(struct bpf_sock_addr *ctx)
{
	return ekp_sock_forward(ctx, 0);
}

int ekp_sock_send(struct bpf_sock_addr *ctx)
{
	return ekp_sock_forward(ctx, 0);
}

int ekp_sock_recv(struct bpf_sock_addr *ctx)
{
	return ekp_sock_reverse(ctx, 0);
}

int ekp_sock_peer(struct bpf_sock_addr *ctx)
{
	return ekp_sock_reverse(ctx, 0);
}

int ekp_sock_conn6(struct bpf_sock_addr *ctx)
{
	return ekp_sock_forward(ctx, 1);
}

int ekp_sock_send6(struct bpf_sock_addr *ctx)
{
	return ekp_sock_forward(ctx, 1);
}

int ekp_sock_recv6(struct bpf_sock_addr *ctx)
{
	return ekp_sock_reverse(ctx, 1);
}

int ekp_sock_peer6(struct bpf_sock_addr *ctx)
{
	return ekp_sock_reverse(ctx, 1);
}

int ekp_sock_free(struct bpf_sock *ctx)
{
	return ekp_sock_release(ctx);
}

int ekp_sock_term(struct ekp_iter_udp *ctx)
{
	return ekp_sock_iter_udp(ctx);
}
