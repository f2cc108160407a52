/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_frag6.h: IPv6 fragments of the tc IPv6 path's TCP/UDP datagrams (ekp_frag6_v2,
 * ekp_frhold6_v2): IPv4's code (ekp_frag_af.h, ekp_tc_frag_af.h) instantiated with EKP_CT_V6 1,
 * keyed by the 16-byte addresses and the fragment header's 32-bit identification. What it does is
 * said once, in ekp_frag.h and ekp_tc_frag.h: the first fragment records its ports, later ones
 * follow it, and those that come before it are held until it comes.
 */
#ifndef EKP_FRAG6_H
#define EKP_FRAG6_H

#include "ekp_ct6.h"
#include "ekp_frag.h"
#include "ekp_parse6.h"
#include "ekp_tc_frag.h"

#define EKP_CT_V6 1
#include "ekp_frag_af.h"
#include "ekp_tc_frag_af.h"
#undef EKP_CT_V6

#endif /* EKP_FRAG6_H */
