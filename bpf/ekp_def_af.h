/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_def_af.h: the names, types and address operations of one family (EKP_CT_V6 0 or 1) for the
 * per-family templates (ekp_ct_af.h says what each macro means); ekp_undef_af.h takes them back.
 * No include guard: included at the top of each template instance.
 */
#if !defined(EKP_CT_V6)
#error "a per-family template is included with EKP_CT_V6 0 (ekp_ct.h, ekp_ctq.h) or 1 (ekp_ct6.h)"
#endif

#if EKP_CT_V6
#define EKP_CTF(x) ekp_ct6_##x
#define EKP_SNATF(x) ekp_snat6_##x
#define EKP_CT_KEY struct ekp_ct6_key
#define EKP_CT_ENTRY struct ekp_ct6_entry
#define EKP_PKT struct ekp_pkt6
#define EKP_FLOW struct ekp_flow6
#define EKP_PB(p) (&(p)->b)
#define EKP_FB(f) (&(f)->b)
#define EKP_ADDR_KEY struct ekp_addr6_key
#define EKP_ADDR_LOOKUP ekp_addr6_lookup
#define EKP_MEMBER_LOOKUP ekp_member6_lookup
#define EKP_FLOW_HASH ekp_flow6_hash
#define EKP_CTQF(x) ekp_ctq6_##x
#define EKP_CTQ_SLOT struct ekp_ctq6_slot
#define EKP_CTQH_LOOKUP ekp_ctqh6_lookup
#define EKP_A_EQ(a, b) ekp_addr6_eq(a, b)
#define EKP_A_SET(d, s) __builtin_memcpy(d, s, 16)
#define EKP_A_ZERO(d) __builtin_memset(d, 0, 16)
#define EKP_A_SEL(d, c, s)                                                                                     \
	do {                                                                                                   \
		if (c)                                                                                         \
			__builtin_memcpy(d, s, 16);                                                            \
		else                                                                                           \
			__builtin_memset(d, 0, 16);                                                            \
	} while (0)
#define EKP_A_SEL2(d, c, s, t) __builtin_memcpy(d, (c) ? (s) : (t), 16)
#define EKP_A_FOLD(a) ekp_fold6(a)
#define EKP_A_ARG const __be32 *
#define EKP_FRAGF(x) ekp_frag6_##x
#define EKP_FRAGHOLDF(x) ekp_fraghold6_##x
#define EKP_TCFRAGF(x) ekp_tc_frag6_##x
#define EKP_FRAG_KEY struct ekp_frag6_key
#define EKP_FRAGHOLD_KEY struct ekp_fraghold6_key
#define EKP_FRAG_ID(p) ((p)->frag_id)
#define EKP_HOSTF(x) ekp_host6_##x
#define EKP_HOSTNAT_KEY struct ekp_hostnat6_key
#define EKP_HOSTNAT struct ekp_hostnat6
#define EKP_HOSTNAT_KEY_OF ekp_hostnat6_key_of
#define EKP_HOSTNAT_LOOKUP ekp_hostnat6_lookup
#define EKP_HOSTNAT_UPDATE ekp_hostnat6_update
#define EKP_PARSE ekp_parse6
#define EKP_REWRITE ekp_rewrite6
#define EKP_SCRATCH struct ekp_tc6_scratch
#define EKP_SCRATCH_LOOKUP ekp_scratch6_lookup
#define EKP_SCRATCH_PKT(w) (&(w)->pkt)
#define EKP_A_VAR(n) __be32 n[4]
#else
#define EKP_CTF(x) ekp_ct_##x
#define EKP_SNATF(x) ekp_snat_##x
#define EKP_CT_KEY struct ekp_ct_key
#define EKP_CT_ENTRY struct ekp_ct_entry
#define EKP_PKT struct ekp_pkt
#define EKP_FLOW struct ekp_flow
#define EKP_PB(p) (p)
#define EKP_FB(f) (f)
#define EKP_ADDR_KEY struct ekp_addr_key
#define EKP_ADDR_LOOKUP ekp_addr_lookup
#define EKP_MEMBER_LOOKUP ekp_member_lookup
#define EKP_FLOW_HASH ekp_flow_hash
#define EKP_CTQF(x) ekp_ctq_##x
#define EKP_CTQ_SLOT struct ekp_ctq_slot
#define EKP_CTQH_LOOKUP ekp_ctqh_lookup
#define EKP_A_EQ(a, b) ((a) == (b))
#define EKP_A_SET(d, s) ((d) = (s))
#define EKP_A_ZERO(d) ((d) = 0)
#define EKP_A_SEL(d, c, s) ((d) = (c) ? (s) : 0)
#define EKP_A_SEL2(d, c, s, t) ((d) = (c) ? (s) : (t))
#define EKP_A_FOLD(a) (a)
#define EKP_A_ARG __be32
#define EKP_FRAGF(x) ekp_frag_##x
#define EKP_FRAGHOLDF(x) ekp_fraghold_##x
#define EKP_TCFRAGF(x) ekp_tc_frag_##x
#define EKP_FRAG_KEY struct ekp_frag_key
#define EKP_FRAGHOLD_KEY struct ekp_fraghold_key
#define EKP_FRAG_ID(p) ((p)->ip_id)
#define EKP_HOSTF(x) ekp_host_##x
#define EKP_HOSTNAT_KEY struct ekp_hostnat_key
#define EKP_HOSTNAT struct ekp_hostnat
#define EKP_HOSTNAT_KEY_OF ekp_hostnat_key_of
#define EKP_HOSTNAT_LOOKUP ekp_hostnat_lookup
#define EKP_HOSTNAT_UPDATE ekp_hostnat_update
#define EKP_PARSE ekp_parse
#define EKP_REWRITE ekp_rewrite
#define EKP_SCRATCH struct ekp_tc_scratch
#define EKP_SCRATCH_LOOKUP ekp_scratch_lookup
#define EKP_SCRATCH_PKT(w) (&(w)->work.pkt)
#define EKP_A_VAR(n) __be32 n
#endif
