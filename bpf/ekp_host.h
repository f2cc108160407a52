/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_host.h: legacy host routing (--bpf-host-routing=legacy, EKP_CFG_HOST_LEGACY): a translated
 * packet goes through the node's own stack, so its netfilter (the FORWARD chain an iptables-based
 * NetworkPolicy engine fills) and its reverse-path filter see it as they see iptables mode's.
 *
 * The translations sit where netfilter's NAT puts them, so the stack sees one consistent flow
 * client <-> backend in both directions:
 *
 *   tc ingress (ekp_from_pod / ekp_from_net)     the stack           tc egress (ekp_egress)
 *   destination: DNAT to the backend, or a   ->  routing, rp_filter, -> source: SNAT to the node,
 *   reply's destination back to the client       conntrack, FORWARD     or a reply's source to
 *   (un-SNAT), then TC_ACT_OK                                           the frontend (un-DNAT)
 *
 * which is PREROUTING's and POSTROUTING's split in iptables mode. Translating everything at
 * ingress instead runs into the node's checks (bpf/README.md, "Host routing"): a SNAT source is the
 * node's own address (a martian unless accept_local), a reply's source is a VIP (strict rp_filter
 * drops it) and nf_conntrack sees a SYN-ACK from an address it never saw a SYN to (`--ctstate
 * INVALID -j DROP`). Here the stack only ever sees real pod and client addresses.
 *
 * What ingress decided for the source travels to egress in two pieces: the new source, in
 * ekp_hostnat_v2 under the tuple the packet leaves with and a 16-bit tag (a hash of the tuple as
 * it arrived, that is of its conntrack key); and the tag, in skb->tc_index, which the kernel keeps
 * from tc ingress through forwarding, GRO/GSO and refragmentation (ip_copy_metadata) to tc egress
 * (no qdisc reads it since Linux 6.3). A direct-action program cannot write tc_index for good:
 * on TC_ACT_OK the kernel sets it from the classid, `skb->tc_index = TC_H_MIN(res.classid)`
 * (tc_run), and cls_bpf takes the classid's minor from skb->tc_classid, which the program may
 * write. So the ingress program writes the tag to tc_classid (0 for every other packet it passes,
 * which also voids whatever came with it: a pod cannot forge one), and the kernel carries it to
 * tc_index. Without the tag, two flows whose packets leave with the same tuple (one client port
 * reaching one backend through two frontends: decide gives the second another source port) could
 * not be told apart at egress. A forwarded packet without a tag (untranslated traffic) costs the
 * egress program two loads (tc_index, then ingress_ifindex: ekp_core.h).
 *
 * Each packet that needs a source at egress writes its entry when it is missing or stale, so an
 * LRU eviction costs one update, never a packet. The egress program is attached to the same
 * devices as the ingress programs (pod devices and --devices): a packet the stack routes out of
 * another device (an overlay's tunnel) leaves without its source translated.
 */
#ifndef EKP_HOST_H
#define EKP_HOST_H

#include <linux/pkt_cls.h>

#include "ekp_decide.h"
#include "ekp_frag.h"
#include "ekp_maps.h"
#include "ekp_nat.h"
#include "ekp_parse.h"
#include "ekp_tc_scratch.h"

#define EKP_HOST_MIX 0x9e3779b1u /* 2^32 / the golden ratio (Fibonacci hashing) */

/* ekp_host_tag, ekp_host_hand_over and ekp_host_note_stack_reply (ingress), ekp_host_egress (egress:
 * ekp_egress, ekp_core.h) and ekp_host_stack_reply (ekp_decide_stack_reply): the per-family code,
 * IPv4's instance (IPv6's: ekp_host6.h). */
#define EKP_CT_V6 0
#include "ekp_host_af.h"
#undef EKP_CT_V6

#endif /* EKP_HOST_H */
