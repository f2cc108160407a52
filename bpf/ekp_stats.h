/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_stats.h: per-CPU counters indexed by enum ekp_stat.
 *
 * Accounting rule: every packet counts EKP_STAT_PACKETS and exactly one outcome
 * (PASS, NEW_FLOWS, CT_FORWARD, CT_REPLY or one EKP_DROP_*), so
 *   PACKETS == PASS + NEW_FLOWS + CT_FORWARD + CT_REPLY + sum(drops).
 * SNAT and AFFINITY_HIT are extra marks on new flows, outside that sum.
 */
#ifndef EKP_STATS_H
#define EKP_STATS_H

#include "ekp_maps.h"

static __always_inline void ekp_count(__u32 stat)
{
	u64 *v = ekp_stats_lookup(&stat);
	if (v)
		*v += 1; /* per-CPU slot: no atomic needed */
}

#endif /* EKP_STATS_H */
