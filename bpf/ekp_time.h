/* Time of the data path: bpf_ktime_get_ns(), CLOCK_MONOTONIC, nanoseconds since boot. */
#ifndef EKP_TIME_H
#define EKP_TIME_H

#include <linux/types.h>

#define EKP_NSEC 1000000000ULL

/* How long ago `then` was, signed, in serial-number arithmetic (the kernel's time_after): negative
 * when another CPU stored a later time than the `now` this one read, and right across a wrap, so a
 * stamp written as "N seconds before now" is N seconds old even when the machine has been up for
 * less than N seconds (the agent and the tests age entries that way). */
static __always_inline __s64 ekp_age_ns(__u64 now, __u64 then)
{
	return (__s64)(now - then);
}

#endif
