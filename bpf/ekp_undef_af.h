/* SPDX-License-Identifier: Apache-2.0 */
/* ekp_undef_af.h: undefines what ekp_def_af.h defined, at the end of each template instance. */
#undef EKP_CTF
#undef EKP_SNATF
#undef EKP_CT_KEY
#undef EKP_CT_ENTRY
#undef EKP_PKT
#undef EKP_FLOW
#undef EKP_PB
#undef EKP_FB
#undef EKP_ADDR_KEY
#undef EKP_ADDR_LOOKUP
#undef EKP_MEMBER_LOOKUP
#undef EKP_FLOW_HASH
#undef EKP_CTQF
#undef EKP_CTQ_SLOT
#undef EKP_CTQH_LOOKUP
#undef EKP_CTQ_TCP_SLOTS
#undef EKP_CTQ_ANY_SLOTS
#undef EKP_A_EQ
#undef EKP_A_SET
#undef EKP_A_ZERO
#undef EKP_A_SEL
#undef EKP_A_SEL2
#undef EKP_A_FOLD
