/* SPDX-License-Identifier: Apache-2.0 */
/*
 * ekp_sctp.h: keeping an SCTP packet's CRC32c right when its ports change, without reading the
 * packet.
 *
 * SCTP's checksum is CRC32c (Castagnoli, reflected polynomial 0x82f63b78, register preset and
 * final value inverted) over the whole SCTP packet, common header with the checksum field zeroed
 * and every chunk, stored little-endian (RFC 9260 appendix A; the kernel's sctp_compute_cksum).
 * Unlike TCP and UDP it covers no pseudo header: rewriting IP addresses leaves it valid. Ports
 * are its first four bytes. A CRC is affine over GF(2): for two messages M and M' of the same
 * length, crc(M) ^ crc(M') = raw(M ^ M'), raw being the CRC with neither preset nor final
 * inversion. M ^ M' is the four bytes D = old ports ^ new ports followed by L - 4 zero bytes;
 * loading D into the register and shifting it 32 times multiplies it by x^32, and each zero byte
 * after it by x^8, modulo the polynomial. So
 *
 *     new checksum = old checksum ^ (D * x^(8 L) mod P)
 *
 * x^(8 L) for L < 65,536 is the product of x^(8 j 16^k) over the hexadecimal digits j of L
 * (k = 0..3): four multiplications (ekp_crc32c_mul, zlib's multmodp: 32 branch-free steps), each
 * by a constant of a 16-entry table picked by its digit, without a branch.
 * The verifier walks this once per state reaching a rewrite (two sites in ekp_tc6.h, many states
 * after the SNAT port walk's exits), so its cost there is what it costs the verifier, not the
 * CPU: every 0/1 choice is a multiplication by the bit (ekp_crc32c_bit), never the mask
 * `x & -bit` (zlib's form): this kernel's verifier (6.18) forks its state on each AND with such a
 * mask of an unknown bit, which is 64 forks per loop. Standalone, one update took the verifier
 * 14,243 instructions as 17 masked loops behind 16 branches on the length, 123,820 as four
 * masked loops, 2,812 as four loops of multiplications; the tc programs' totals are in
 * bpf/README.md ("SCTP").
 * Nothing of the payload is read, and the packet's own checksum is updated, not recomputed, so a
 * packet that arrived corrupt stays corrupt. The constants are checked against a bitwise CRC32c
 * by the packet tests.
 *
 * An SCTP skb from a local socket whose device offloads the CRC (CHECKSUM_PARTIAL with
 * csum_not_inet; veth offers it) carries no checksum yet, the field 0: the kernel computes it when
 * the packet leaves by a device without the offload (skb_crc32c_csum_help, over the field as it
 * stands, not zeroed first), or the receiving stack accepts the packet unchecked. So a field of 0
 * is left 0 (ekp_set_sctp_ports): an update there would make the fallback's CRC wrong and the
 * backend drop every translated packet. A real CRC of 0 (one packet in 2^32) is left unupdated:
 * that packet is dropped by its receiver and retransmitted.
 *
 * IP fragments of SCTP packets are not translated (ekp_parse.h passes them): the first fragment
 * holds the checksum but not the packet's length, which the update needs. Linux's SCTP sizes its
 * packets to the path MTU and sets DF; Cilium translates SCTP only without port changes for want
 * of exactly this update (cilium/cilium#20490).
 */
#ifndef EKP_SCTP_H
#define EKP_SCTP_H

#include <linux/types.h>

#define EKP_CRC32C_POLY 0x82f63b78u /* reflected Castagnoli polynomial */
#define EKP_SCTP_CSUM_OFF 8         /* the checksum field in the SCTP common header */
#define EKP_SCTP_HDR_LEN 12         /* ports, verification tag, checksum */
#define EKP_SCTP_CID_INIT 1         /* the chunk that starts an association */

/* Bit `k` of `v`, 0 or 1, as a value LLVM cannot tell is a bit: it would make `x * bit` the mask
 * `x & -bit`, and this kernel's verifier (6.18) forks its state on an AND with a mask of unknown
 * sign (one state for 0, one for all ones), where it follows a multiplication as one. */
static __always_inline __u32 ekp_crc32c_bit(__u32 v, __u32 k)
{
	__u32 bit = (v >> k) & 1;

	asm volatile("" : "+r"(bit));
	return bit;
}

/* a * b modulo the polynomial, bit 31 being x^0 (zlib's multmodp), in 32 branch-free steps. */
static __always_inline __u32 ekp_crc32c_mul(__u32 a, __u32 b)
{
	__u32 p = 0;

#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < 32; i++) {
		p ^= b * ekp_crc32c_bit(a, 31 - i);
		b = (b >> 1) ^ (EKP_CRC32C_POLY * ekp_crc32c_bit(b, 0));
	}
	return p;
}

/* b when `bit` is 1, a when it is 0, without a branch or a mask (ekp_crc32c_bit). */
#define EKP_CRC32C_SEL(bit, a, b) ((a) ^ (((a) ^ (b)) * (bit)))

/* c_j of c0..c15 for j the low four bits of `v`, by a tree of branch-free selections, one level
 * per bit. */
static __always_inline __u32 ekp_crc32c_pick16(__u32 v, __u32 c0, __u32 c1, __u32 c2, __u32 c3, __u32 c4,
						 __u32 c5, __u32 c6, __u32 c7, __u32 c8, __u32 c9, __u32 c10,
						 __u32 c11, __u32 c12, __u32 c13, __u32 c14, __u32 c15)
{
	__u32 m0 = ekp_crc32c_bit(v, 0), m1 = ekp_crc32c_bit(v, 1);
	__u32 m2 = ekp_crc32c_bit(v, 2), m3 = ekp_crc32c_bit(v, 3);
	__u32 q0 = EKP_CRC32C_SEL(m1, EKP_CRC32C_SEL(m0, c0, c1), EKP_CRC32C_SEL(m0, c2, c3));
	__u32 q1 = EKP_CRC32C_SEL(m1, EKP_CRC32C_SEL(m0, c4, c5), EKP_CRC32C_SEL(m0, c6, c7));
	__u32 q2 = EKP_CRC32C_SEL(m1, EKP_CRC32C_SEL(m0, c8, c9), EKP_CRC32C_SEL(m0, c10, c11));
	__u32 q3 = EKP_CRC32C_SEL(m1, EKP_CRC32C_SEL(m0, c12, c13), EKP_CRC32C_SEL(m0, c14, c15));

	return EKP_CRC32C_SEL(m3, EKP_CRC32C_SEL(m2, q0, q1), EKP_CRC32C_SEL(m2, q2, q3));
}

/* x^(8 j 16^k) mod P for j = 0..15 (j = 0: 1, bit 31), one table per hexadecimal digit k of a
 * length; checked against a bitwise CRC32c by the packet tests. */
#define EKP_CRC32C_X8_0 \
	0x80000000u, 0x00800000u, 0x00008000u, 0x00000080u, 0x82f63b78u, 0xfbc3faf9u, 0x8b277743u, 0x52a0c93fu, \
		0x6ea2d55cu, 0x1c08b7d6u, 0xf56e0ef4u, 0x34019664u, 0xa66805ebu, 0x7a1f6b24u, 0xe75d06aau, 0xc94ec098u
#define EKP_CRC32C_X8_1 \
	0x80000000u, 0x18b8ea18u, 0x510ac59au, 0xb2dea967u, 0xb82be955u, 0x36c41f1cu, 0x19b29a35u, 0xc9e90b9eu, \
		0xb8fdb1e7u, 0xe55ef1f3u, 0x1fe0b5c3u, 0xe0553f1eu, 0x18e4a304u, 0x2b830011u, 0x56993a31u, 0x0246e2e6u
#define EKP_CRC32C_X8_2 \
	0x80000000u, 0x88e56f72u, 0x74c360a4u, 0x631bb273u, 0xe4172b16u, 0x71892b1bu, 0x835305c9u, 0x196b1eaeu, \
		0x0d65762au, 0xafc81338u, 0xb5a50ab7u, 0xf373c3acu, 0x5f60970fu, 0xd46d3063u, 0x3a5275eau, 0x02331c01u
#define EKP_CRC32C_X8_3 \
	0x80000000u, 0x35d73a62u, 0x28461564u, 0x43eefc9fu, 0xbf455269u, 0x5edcdeb9u, 0x65059450u, 0x4e6f41a4u, \
		0xe2ea32dcu, 0xf5b95b32u, 0x695a4c87u, 0xf204502cu, 0x9a4f01b6u, 0x941a0916u, 0x4303cb97u, 0x4c3d3d65u

/* What the checksum (as the little-endian word stored) of an SCTP packet `len` bytes long
 * (common header included, len < 65,536) changes by when its ports word goes from `old_ports` to
 * `new_ports` (the little-endian words of the four port bytes in wire order). */
static __always_inline __u32 ekp_sctp_csum_delta(__u32 old_ports, __u32 new_ports, __u32 len)
{
	__u32 n = len & 0xffff, r = old_ports ^ new_ports;

	r = ekp_crc32c_mul(ekp_crc32c_pick16(n, EKP_CRC32C_X8_0), r);
	r = ekp_crc32c_mul(ekp_crc32c_pick16(n >> 4, EKP_CRC32C_X8_1), r);
	r = ekp_crc32c_mul(ekp_crc32c_pick16(n >> 8, EKP_CRC32C_X8_2), r);
	r = ekp_crc32c_mul(ekp_crc32c_pick16(n >> 12, EKP_CRC32C_X8_3), r);
	return r;
}

#endif /* EKP_SCTP_H */
