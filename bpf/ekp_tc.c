/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc.c: the two tc ingress programs (clsact, direct-action cls_bpf) of ebpf-kube-proxy.
 *
 *   ekp_from_pod  ingress of the node side of every pod veth        (scope EKP_SCOPE_INTERNAL)
 *   ekp_from_net  ingress of the node's external devices (--devices) (scope EKP_SCOPE_EXTERNAL)
 *
 * Built by agent/ebpf/loader.py with bcc: BPF(src_file=ekp_tc.c, cflags=[-DEKP_PIN_DIR=...,
 * -DEKP_<ROLE>_MAX=..., -I<bpf dir>]). The logic lives in the headers (ekp_core.h first); this
 * file holds only what bcc needs in its main file: the map accessors (see ekp_maps.h) and the
 * program entry points.
 */
#include "ekp_maps.h"

/* ---- map accessors: bcc rewrites these `map.op()` calls because they are in the main file ---- */

static __always_inline struct ekp_frontend *ekp_fe_lookup(struct ekp_frontend_key *k)
{
	return ekp_fe_v1.lookup(k);
}

static __always_inline struct ekp_slot *ekp_slot_lookup(struct ekp_slot_key *k)
{
	return ekp_slot_v1.lookup(k);
}

static __always_inline struct ekp_backend *ekp_be_lookup(struct ekp_backend_key *k)
{
	return ekp_be_v1.lookup(k);
}

static __always_inline struct ekp_revnat *ekp_rnat_lookup(struct ekp_revnat_key *k)
{
	return ekp_rnat_v1.lookup(k);
}

static __always_inline struct ekp_srcrange *ekp_srcr_lookup(struct ekp_srcrange_key *k)
{
	return ekp_srcr_v1.lookup(k);
}

static __always_inline struct ekp_config *ekp_cfg_lookup(u32 *k)
{
	return ekp_cfg_v1.lookup(k);
}

static __always_inline struct ekp_ct_entry *ekp_ct_lookup(struct ekp_ct_key *k)
{
	return ekp_ct_v1.lookup(k);
}

static __always_inline int ekp_ct_update(struct ekp_ct_key *k, struct ekp_ct_entry *v)
{
	return ekp_ct_v1.update(k, v);
}

static __always_inline int ekp_ct_insert(struct ekp_ct_key *k, struct ekp_ct_entry *v)
{
	return ekp_ct_v1.insert(k, v);
}

static __always_inline int ekp_ct_delete(struct ekp_ct_key *k)
{
	return ekp_ct_v1.delete(k);
}

static __always_inline struct ekp_affinity *ekp_aff_lookup(struct ekp_affinity_key *k)
{
	return ekp_aff_v1.lookup(k);
}

static __always_inline int ekp_aff_update(struct ekp_affinity_key *k, struct ekp_affinity *v)
{
	return ekp_aff_v1.update(k, v);
}

static __always_inline u64 *ekp_stats_lookup(u32 *k)
{
	return ekp_stats_v1.lookup(k);
}

/* ---- programs ---- */

#include "ekp_core.h"

int ekp_from_pod(struct __sk_buff *skb)
{
	return ekp_main(skb, EKP_SCOPE_INTERNAL);
}

int ekp_from_net(struct __sk_buff *skb)
{
	return ekp_main(skb, EKP_SCOPE_EXTERNAL);
}
