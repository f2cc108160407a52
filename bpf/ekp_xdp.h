/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_xdp.h: the XDP program of the external devices (ekp_xdp_net), ahead of their tc program.
 *
 *   parse (ekp_parse.h, from the XDP buffer) -> decide (ekp_decide.h, as EKP_HOOK_XDP, scope
 *   EXTERNAL: the same lookups, policy, Maglev and conntrack as ekp_from_net) -> apply
 *   (ekp_xdp_apply.h: drop, send back out with XDP_TX, or pass on to tc) -> count (ekp_xstats_v3)
 *
 * What it finishes itself: drops (source ranges, mid-flow segments without a flow, malformed
 * headers, a full SNAT range or table) and the flows between an outside client and a backend on
 * another node, both ways (to the backend, source-translated under ETP Cluster, and the replies
 * that come back to this node's SNAT address), whenever the route leaves by the device the packet
 * came in by. Everything else passes to ekp_from_net unchanged, which decides it again from the
 * same maps: a conntrack entry either hook wrote is the entry both read.
 */
#ifndef EKP_XDP_H
#define EKP_XDP_H

#include "ekp_decide.h"
#include "ekp_parse.h"
#include "ekp_stats.h"
#include "ekp_tc_scratch.h"
#include "ekp_xdp_apply.h"

static __always_inline int ekp_xdp_main(struct xdp_md *ctx)
{
	struct ekp_tc_scratch *w = ekp_scratch_lookup();

	if (!w)
		return XDP_PASS; /* cannot happen: a one-element per-CPU array */
	__builtin_memset(&w->work.pkt, 0, sizeof(w->work.pkt));
	int parsed = ekp_parse_xdp(ctx, &w->work.pkt);

	ekp_decide(&w->work, parsed, EKP_SCOPE_EXTERNAL, EKP_HOOK_XDP);
	int verdict = ekp_xdp_apply(ctx, w);

	ekp_count_in(EKP_COUNT_XDP, EKP_STAT_PACKETS);
	ekp_count_in(EKP_COUNT_XDP, w->work.dec.outcome);
	ekp_count_marks_in(EKP_COUNT_XDP, w->work.dec.marks);
	return verdict;
}

#endif /* EKP_XDP_H */
