/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_stats.h: per-CPU counters indexed by enum ekp_stat.
 *
 * Accounting rule: every packet counts EKP_STAT_PACKETS and exactly one outcome
 * (PASS, NEW_FLOWS, CT_FORWARD, CT_REPLY, CT_RELATED, FRAG_HELD or one EKP_DROP_*), so
 *   PACKETS == PASS + NEW_FLOWS + CT_FORWARD + CT_REPLY + CT_RELATED + FRAG_HELD + sum(drops).
 * A held fragment counts again when it is put back (as the packet it then is).
 * The XDP program counts alike in its own map (ekp_xstats_v3), with one more outcome, TO_TC (a
 * service packet it left to the tc program, which counts it again), and never CT_RELATED nor
 * FRAG_HELD (it passes ICMP errors and fragments on).
 * SNAT, AFFINITY_HIT, EARLY_DROP, CT_REBUILT, PORT_REMAP, FRAGMENTS, FRAG_RELEASED, CT_RESUMED and
 * the EVICT_* counters are extra marks, outside that sum. The socket programs count their calls alike
 * (ekp_sock.h): SOCK_CALLS and one of SOCK_PASS, SOCK_TRANSLATED or a drop reason, so with both
 *   PACKETS + SOCK_CALLS == PASS + NEW_FLOWS + CT_FORWARD + CT_REPLY + CT_RELATED + FRAG_HELD
 *                           + SOCK_PASS + SOCK_TRANSLATED + sum(drops).
 */
#ifndef EKP_STATS_H
#define EKP_STATS_H

#include "ekp_maps.h"

/* Which counters: the tc programs' (ekp_stats_v3) or the XDP program's (ekp_xstats_v3). */
enum ekp_counters {
	EKP_COUNT_TC = 0,
	EKP_COUNT_XDP = 1,
};

static __always_inline void ekp_count_in(__u8 counters, __u32 stat)
{
	u64 *v = counters == EKP_COUNT_XDP ? ekp_xstats_lookup(&stat) : ekp_stats_lookup(&stat);
	if (v)
		*v += 1; /* per-CPU slot: no atomic needed */
}

static __always_inline void ekp_count(__u32 stat)
{
	ekp_count_in(EKP_COUNT_TC, stat);
}

/* The marks of a decision (a bit per stat index, see struct ekp_decision.marks). */
static __always_inline void ekp_count_marks_in(__u8 counters, __u64 marks)
{
#define ekp_count(stat) ekp_count_in(counters, stat)
	if (marks & (1ULL << EKP_STAT_SNAT))
		ekp_count(EKP_STAT_SNAT);
	if (marks & (1ULL << EKP_STAT_AFFINITY_HIT))
		ekp_count(EKP_STAT_AFFINITY_HIT);
	if (marks & (1ULL << EKP_STAT_EARLY_DROP))
		ekp_count(EKP_STAT_EARLY_DROP);
	if (marks & (1ULL << EKP_STAT_CT_REBUILT))
		ekp_count(EKP_STAT_CT_REBUILT);
	if (marks & (1ULL << EKP_STAT_PORT_REMAP))
		ekp_count(EKP_STAT_PORT_REMAP);
	if (marks & (1ULL << EKP_STAT_FRAGMENTS))
		ekp_count(EKP_STAT_FRAGMENTS);
	if (marks & (1ULL << EKP_STAT_EVICT_UNREPLIED))
		ekp_count(EKP_STAT_EVICT_UNREPLIED);
	if (marks & (1ULL << EKP_STAT_EVICT_UNASSURED))
		ekp_count(EKP_STAT_EVICT_UNASSURED);
	if (marks & (1ULL << EKP_STAT_EVICT_CLOSED))
		ekp_count(EKP_STAT_EVICT_CLOSED);
	if (marks & (1ULL << EKP_STAT_CT_RESUMED))
		ekp_count(EKP_STAT_CT_RESUMED);
#undef ekp_count
}

static __always_inline void ekp_count_marks(__u64 marks)
{
	ekp_count_marks_in(EKP_COUNT_TC, marks);
}

#endif /* EKP_STATS_H */
