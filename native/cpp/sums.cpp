#include "sums.hpp"

#include <cstring>
#include <type_traits>

namespace gradwire {

// Each kernel is compiled twice, for AVX2 and for the baseline, and the loader picks by the CPU (GCC's target_clones,
// an ifunc): numpy dispatches its loops the same way, and a baseline (SSE2) loop took 1.6x numpy's time on a 256 KiB
// float32 add. The loops' helpers are inlined into each clone.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define GRADWIRE_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define GRADWIRE_KERNEL
#endif

uint32_t half_to_float_bits(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t exponent = h & 0x7c00u;
    if (exponent == 0x7c00u) return sign | 0x7f800000u | (uint32_t(h & 0x03ffu) << 13);  // inf or NaN, payload kept
    if (exponent != 0) return sign + ((uint32_t(h & 0x7fffu) + 0x1c000u) << 13);         // normal: rebias
    uint32_t significand = h & 0x03ffu;
    if (significand == 0) return sign;  // signed zero
    int shift = 0;                      // subnormal: normalise
    significand <<= 1;
    while ((significand & 0x0400u) == 0) {
        significand <<= 1;
        ++shift;
    }
    return sign + (uint32_t(127 - 15 - shift) << 23) + ((significand & 0x03ffu) << 13);
}

uint16_t float_to_half_bits(uint32_t f) {
    const uint16_t sign = uint16_t((f & 0x80000000u) >> 16);
    const uint32_t exponent = f & 0x7f800000u;
    if (exponent >= 0x47800000u) {  // overflow to inf, or inf and NaN
        const uint32_t significand = f & 0x007fffffu;
        if (exponent == 0x7f800000u && significand != 0) {
            uint16_t nan = uint16_t(0x7c00u + (significand >> 13));
            if (nan == 0x7c00u) ++nan;  // a payload only in the low bits must stay a NaN
            return uint16_t(sign + nan);
        }
        return uint16_t(sign + 0x7c00u);
    }
    if (exponent <= 0x38000000u) {                      // a subnormal half, or signed zero
        if (exponent < 0x33000000u) return sign;        // too small even for a subnormal
        const uint32_t e = exponent >> 23;
        uint32_t significand = (0x00800000u + (f & 0x007fffffu)) >> (113 - e);
        // ties to even; the shift may have dropped up to 11 bits, which the original's low bits still show
        if ((significand & 0x00003fffu) != 0x00001000u || (f & 0x000007ffu)) significand += 0x00001000u;
        return uint16_t(sign + uint16_t(significand >> 13));  // a carry into the exponent is the right result
    }
    uint32_t significand = f & 0x007fffffu;
    if ((significand & 0x00003fffu) != 0x00001000u) significand += 0x00001000u;  // ties to even
    // a carry from the significand into the exponent is right, up to overflowing into inf
    return uint16_t(sign + uint16_t(((exponent - 0x38000000u) >> 13) + (significand >> 13)));
}

namespace {

// acc + w with numpy's NaN: where both are NaN, x86's addition returns its first operand (quieted), and numpy adds
// acc first; a compiler may swap the operands of a commutative +, so an accumulator that is NaN is added to itself
// (itself, quieted) instead. Vectorises to a compare and a blend.
template <typename F>
inline F add_ordered(F acc, F w) {
    return acc + (acc != acc ? acc : w);
}

template <typename T>
inline __attribute__((always_inline)) void add_same(void* acc, const void* wire, size_t n) {
    // restrict: the accumulator and a contribution never overlap, which lets the compiler vectorise
    T* __restrict a = static_cast<T*>(acc);
    const T* __restrict w = static_cast<const T*>(wire);
    if constexpr (std::is_floating_point_v<T>) {
        for (size_t i = 0; i < n; ++i) a[i] = add_ordered(a[i], w[i]);
    } else {
        using U = std::make_unsigned_t<T>;  // wrap around, as numpy and torch do, without signed overflow
        for (size_t i = 0; i < n; ++i) a[i] = T(U(a[i]) + U(w[i]));
    }
}

inline __attribute__((always_inline)) void add_bool(void* acc, const void* wire, size_t n) {
    uint8_t* __restrict a = static_cast<uint8_t*>(acc);
    const uint8_t* __restrict w = static_cast<const uint8_t*>(wire);
    for (size_t i = 0; i < n; ++i) a[i] = (a[i] | w[i]) != 0;
}

float from_bits(uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

uint32_t to_bits(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    return bits;
}

// float16 -> float32 without branches, so that the loops vectorise; bit for bit half_to_float_bits (the test widens
// all 65,536 halves). The exponent is rebiased; inf and NaN get the rest of the float's exponent (their payload is
// only shifted: no floating-point operation touches a NaN); zeros and subnormals are renormalised by one exact
// subtraction of 2^-14.
inline float half_to_float(uint16_t h) {
    const uint32_t shifted = uint32_t(h & 0x7fffu) << 13;
    const uint32_t exponent = shifted & 0x0f800000u;  // 0x7c00 << 13
    const uint32_t normal = shifted + ((127u - 15u) << 23);
    const uint32_t special = normal + ((128u - 16u) << 23);
    const uint32_t small = to_bits(from_bits(normal + (1u << 23)) - from_bits(113u << 23));
    const uint32_t bits = exponent == 0x0f800000u ? special : (exponent == 0 ? small : normal);
    return from_bits(bits | (uint32_t(h & 0x8000u) << 16));
}

template <bool Brain>
float widen_one(uint16_t v) {
    return Brain ? from_bits(uint32_t(v) << 16) : half_to_float(v);
}

template <bool Brain>  // bfloat16 (true) or float16, decided outside the loop so that the loop vectorises
inline __attribute__((always_inline)) void add_half(void* acc, const void* wire, size_t n) {
    float* __restrict a = static_cast<float*>(acc);
    const uint16_t* __restrict w = static_cast<const uint16_t*>(wire);
    for (size_t i = 0; i < n; ++i) a[i] = add_ordered(a[i], widen_one<Brain>(w[i]));
}

template <bool Brain>
inline __attribute__((always_inline)) void widen_half(const void* wire, void* acc, size_t n) {
    float* __restrict a = static_cast<float*>(acc);
    const uint16_t* __restrict w = static_cast<const uint16_t*>(wire);
    for (size_t i = 0; i < n; ++i) a[i] = widen_one<Brain>(w[i]);
}

}  // namespace

size_t accumulator_itemsize(uint8_t dtype) {
    switch (dtype) {
        case kFloat16:
        case kBFloat16:
        case kFloat32:
        case kInt32:
            return 4;
        case kFloat64:
        case kInt64:
            return 8;
        case kUInt8:
        case kInt8:
        case kBool:
            return 1;
        case kInt16:
            return 2;
        default:
            return 0;
    }
}

GRADWIRE_KERNEL bool widen(uint8_t dtype, const void* wire, void* acc, size_t n) {
    if (dtype == kFloat16 || dtype == kBFloat16) {
        dtype == kBFloat16 ? widen_half<true>(wire, acc, n) : widen_half<false>(wire, acc, n);
        return true;
    }
    const size_t size = accumulator_itemsize(dtype);
    if (size == 0) return false;
    std::memcpy(acc, wire, n * size);
    return true;
}

GRADWIRE_KERNEL bool add_into(uint8_t dtype, void* acc, const void* wire, size_t n) {
    switch (dtype) {
        case kFloat16:
            add_half<false>(acc, wire, n);
            return true;
        case kBFloat16:
            add_half<true>(acc, wire, n);
            return true;
        case kFloat32:
            add_same<float>(acc, wire, n);
            return true;
        case kFloat64:
            add_same<double>(acc, wire, n);
            return true;
        case kInt32:
            add_same<int32_t>(acc, wire, n);
            return true;
        case kInt64:
            add_same<int64_t>(acc, wire, n);
            return true;
        case kUInt8:
            add_same<uint8_t>(acc, wire, n);
            return true;
        case kInt8:
            add_same<int8_t>(acc, wire, n);
            return true;
        case kInt16:
            add_same<int16_t>(acc, wire, n);
            return true;
        case kBool:
            add_bool(acc, wire, n);
            return true;
        default:
            return false;
    }
}

GRADWIRE_KERNEL bool narrow(uint8_t dtype, const void* acc, void* out, size_t n) {
    if (dtype == kFloat16 || dtype == kBFloat16) {
        const float* a = static_cast<const float*>(acc);
        uint16_t* o = static_cast<uint16_t*>(out);
        if (dtype == kFloat16) {
            for (size_t i = 0; i < n; ++i) o[i] = float_to_half_bits(to_bits(a[i]));
        } else {  // protocol/dtypes.py: (bits + ((bits >> 16) & 1) + 0x7fff) >> 16, in uint32 (it wraps, as numpy's)
            for (size_t i = 0; i < n; ++i) {
                const uint32_t bits = to_bits(a[i]);
                o[i] = uint16_t((bits + ((bits >> 16) & 1u) + 0x7fffu) >> 16);
            }
        }
        return true;
    }
    const size_t size = accumulator_itemsize(dtype);
    if (size == 0) return false;
    std::memcpy(out, acc, n * size);
    return true;
}

}  // namespace gradwire
