// A server's sums, byte for byte what protocol/dtypes.py computes with numpy:
// - float16 and bfloat16 accumulate in float32: widened exactly, narrowed once, rounding to nearest even as numpy
//   does (numpy's own float16 conversion, signalling NaNs kept, not the F16C instruction's quieting);
// - float32 and float64 add in themselves (IEEE addition is correctly rounded, so a vectorised loop gives numpy's
//   bytes; this file is never built with -ffast-math);
// - integers wrap around (added as unsigned: no undefined behaviour), bool is a logical or.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gradwire {

// Wire dtype codes (protocol/dtypes.py).
enum DType : uint8_t {
    kFloat16 = 1,
    kFloat32 = 2,
    kFloat64 = 3,
    kInt32 = 4,
    kInt64 = 5,
    kBFloat16 = 6,
    kUInt8 = 7,
    kInt8 = 8,
    kInt16 = 9,
    kBool = 10,
};

// The accumulator's element size for a wire dtype (4 for float16 and bfloat16), or 0 for an unknown code.
size_t accumulator_itemsize(uint8_t dtype);

// acc[0..n) = wire[0..n), widened to the accumulator's type (the round's first contribution). False: unknown dtype.
bool widen(uint8_t dtype, const void* wire, void* acc, size_t n);

// acc[0..n) += wire[0..n) in the accumulator's precision. False: unknown dtype.
bool add_into(uint8_t dtype, void* acc, const void* wire, size_t n);

// out[0..n) = acc[0..n), narrowed to the wire type. False: unknown dtype.
bool narrow(uint8_t dtype, const void* acc, void* out, size_t n);

// numpy's float16 <-> float32 bit conversions (npy_halfbits_to_floatbits, npy_floatbits_to_halfbits).
uint32_t half_to_float_bits(uint16_t h);
uint16_t float_to_half_bits(uint32_t f);

}  // namespace gradwire
