/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_tc_scratch.h: working memory of the tc programs, kept in a per-CPU array (ekp_scratch)
 * rather than on the stack: the decision's work (struct ekp_work, see ekp_decide.h for why), the
 * route lookup's parameters and the ICMP error under construction; with decide and apply inlined
 * into one function they do not fit the verifier's 512 bytes.
 *
 * Not part of the ABI: the map is private to one load of the programs (not pinned, never read by
 * the agent). A tc program runs to completion on its CPU (softirq, no nesting; redirects are
 * carried out after it returns), so one element per CPU is enough.
 */
#ifndef EKP_TC_SCRATCH_H
#define EKP_TC_SCRATCH_H

#include <linux/bpf.h>

#include "ekp_decide.h"
#include "ekp_icmp.h"

struct ekp_tc_scratch {
	struct ekp_work work; /* the packet, its decision and a new flow (ekp_decide.h) */
	struct bpf_fib_lookup fib;
	struct ekp_icmp_work icmp;
	struct ekp_fraghold frag; /* a fragment to hold, or a first fragment saved while the held go back */
	struct ekp_snat_state snat; /* the SNAT port walk's (ekp_snat_af.h) */
};

static __always_inline struct ekp_tc_scratch *ekp_scratch_lookup(void);

#endif /* EKP_TC_SCRATCH_H */
