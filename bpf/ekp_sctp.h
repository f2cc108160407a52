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
 * inversion. M ^ M' is the four bytes D = old ports ^ new ports followed by L - 4 zero bytes, and
 * appending n zero bytes multiplies a raw register by x^(8n) modulo the polynomial. So
 *
 *     new checksum = old checksum ^ (raw(D) * x^(8 (L - 4)) mod P)
 *
 * raw(D) is 32 shift steps of the register loaded with D (ekp_crc32c_word); x^(8n) is a product
 * of the constants x^(8 * 2^k) for the bits k of n (ekp_crc32c_zeros; L < 65,536 needs 16), each
 * multiplication 32 branch-free shift-and-add steps (ekp_crc32c_mul, zlib's multmodp). At most
 * 17 loops of 32 steps per translated packet, whatever its size; nothing of the payload is read,
 * and the packet's own checksum is updated, not recomputed, so a packet that arrived corrupt
 * stays corrupt. The constants are checked against a bitwise CRC32c by the packet tests.
 *
 * An SCTP skb from a local socket whose device offloads the CRC (CHECKSUM_PARTIAL with
 * csum_not_inet; veth offers it) carries no checksum yet: the kernel computes it when the packet
 * leaves by a device without the offload, or the receiving stack accepts the packet unchecked.
 * The update changes a field that is overwritten then: harmless.
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

/* a * b modulo the polynomial, bit 31 being x^0 (zlib's multmodp), in 32 branch-free steps. */
static __always_inline __u32 ekp_crc32c_mul(__u32 a, __u32 b)
{
	__u32 p = 0;

#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < 32; i++) {
		p ^= b & -((a >> (31 - i)) & 1);
		b = (b >> 1) ^ (EKP_CRC32C_POLY & -(b & 1));
	}
	return p;
}

/* raw(D) of four bytes D, given as the little-endian word of their wire order. */
static __always_inline __u32 ekp_crc32c_word(__u32 d)
{
#pragma clang loop unroll(disable)
	for (__u32 i = 0; i < 32; i++)
		d = (d >> 1) ^ (EKP_CRC32C_POLY & -(d & 1));
	return d;
}

/* A raw CRC register `r` after `n` more zero bytes (n < 65,536): r * x^(8n) modulo P, the
 * constants being x^(8 * 2^k) for k = 0..15. */
static __always_inline __u32 ekp_crc32c_zeros(__u32 r, __u32 n)
{
#define EKP_CRC32C_ZEROS(k, x2n)                                                                              \
	if (n & (1u << (k)))                                                                                 \
		r = ekp_crc32c_mul(x2n, r);
	EKP_CRC32C_ZEROS(0, 0x00800000u)
	EKP_CRC32C_ZEROS(1, 0x00008000u)
	EKP_CRC32C_ZEROS(2, 0x82f63b78u)
	EKP_CRC32C_ZEROS(3, 0x6ea2d55cu)
	EKP_CRC32C_ZEROS(4, 0x18b8ea18u)
	EKP_CRC32C_ZEROS(5, 0x510ac59au)
	EKP_CRC32C_ZEROS(6, 0xb82be955u)
	EKP_CRC32C_ZEROS(7, 0xb8fdb1e7u)
	EKP_CRC32C_ZEROS(8, 0x88e56f72u)
	EKP_CRC32C_ZEROS(9, 0x74c360a4u)
	EKP_CRC32C_ZEROS(10, 0xe4172b16u)
	EKP_CRC32C_ZEROS(11, 0x0d65762au)
	EKP_CRC32C_ZEROS(12, 0x35d73a62u)
	EKP_CRC32C_ZEROS(13, 0x28461564u)
	EKP_CRC32C_ZEROS(14, 0xbf455269u)
	EKP_CRC32C_ZEROS(15, 0xe2ea32dcu)
#undef EKP_CRC32C_ZEROS
	return r;
}

/* What the checksum (as the little-endian word stored) of an SCTP packet `len` bytes long
 * (common header included) changes by when its ports word goes from `old_ports` to `new_ports`
 * (the little-endian words of the four port bytes in wire order). */
static __always_inline __u32 ekp_sctp_csum_delta(__u32 old_ports, __u32 new_ports, __u32 len)
{
	return ekp_crc32c_zeros(ekp_crc32c_word(old_ports ^ new_ports), (len - 4) & 0xffff);
}

#endif /* EKP_SCTP_H */
