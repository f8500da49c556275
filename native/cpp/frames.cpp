#include "frames.hpp"

#include <cstdio>
#include <cstring>

namespace gradwire {
namespace {

template <typename T>
T load(const uint8_t* p) {
    T v;
    std::memcpy(&v, p, sizeof v);  // unaligned and strict-aliasing safe; one mov on x86-64
    return v;
}

template <typename T>
void store(uint8_t* p, T v) {
    std::memcpy(p, &v, sizeof v);
}

bool is_data(uint8_t type) { return type == kPushPull || type == kResult; }
bool is_entries(uint8_t type) { return type == kAcks || type == kReceived || type == kEveryone; }

}  // namespace

size_t itemsize(uint8_t dtype) {
    // protocol/dtypes.py's table: float16 float32 float64 int32 int64 bfloat16 uint8 int8 int16 bool
    static constexpr uint8_t sizes[] = {0, 2, 4, 8, 4, 8, 2, 1, 1, 2, 1};
    return dtype < sizeof sizes ? sizes[dtype] : 0;
}

const char* type_name(uint8_t type) {
    static constexpr const char* names[] = {"",    "HELLO",      "PROOF", "CONTROL", "PUSHPULL", "RESULT",  "ERROR",
                                            "BYE", "ACK",        "SHM_ATTACH", "PROBE", "ACKS",  "RECEIVED", "EVERYONE"};
    return type < sizeof names / sizeof names[0] ? names[type] : "";
}

HeaderError decode_header(const uint8_t* raw, uint64_t max_payload, Header& out) {
    if (load<uint32_t>(raw) != kMagic) return HeaderError::kMagic;
    if (raw[4] != kVersion) return HeaderError::kVersion;
    const uint8_t type = raw[5];
    if (type < kHello || type > kEveryone) return HeaderError::kType;
    out.type = type;
    out.flags = raw[6];
    out.dtype = raw[7];
    out.epoch = load<uint32_t>(raw + 8);
    out.sender = load<uint32_t>(raw + 12);
    out.key = load<uint64_t>(raw + 16);
    out.round = load<uint32_t>(raw + 24);
    out.status = load<uint32_t>(raw + 28);
    out.length = load<uint64_t>(raw + 32);
    if (is_data(type)) {
        const size_t size = itemsize(out.dtype);
        if (size == 0) return HeaderError::kDtype;
        if (out.length > max_payload) return HeaderError::kPayloadTooLong;
        if (out.length % size) return HeaderError::kNotWholeElements;
    } else if (out.length > kMaxControlBytes) {
        return HeaderError::kBodyTooLong;
    } else if (is_entries(type) && out.length % kAckEntrySize) {
        return HeaderError::kNotWholeEntries;
    }
    return HeaderError::kOk;
}

std::string describe(HeaderError error, const uint8_t* raw, uint64_t max_payload) {
    const auto hex8 = [](uint32_t v) {
        char buf[16];
        std::snprintf(buf, sizeof buf, "0x%08x", v);
        return std::string(buf);
    };
    const std::string length = std::to_string(load<uint64_t>(raw + 32));
    const std::string name = type_name(raw[5]);
    switch (error) {
        case HeaderError::kOk:
            return "";
        case HeaderError::kMagic:
            return "bad magic " + hex8(load<uint32_t>(raw)) + " (expected " + hex8(kMagic) + "): not a gradwire peer";
        case HeaderError::kVersion:
            return "protocol version " + std::to_string(raw[4]) + ", this node speaks " + std::to_string(kVersion);
        case HeaderError::kType:
            return "unknown frame type " + std::to_string(raw[5]);
        case HeaderError::kDtype:
            return "unknown dtype code " + std::to_string(raw[7]) + " in a " + name + " frame";
        case HeaderError::kPayloadTooLong:
            return "payload of " + length + " bytes exceeds the maximum of " + std::to_string(max_payload);
        case HeaderError::kNotWholeElements:
            return "payload of " + length + " bytes is not a whole number of dtype=" + std::to_string(raw[7]) +
                   " elements";
        case HeaderError::kBodyTooLong:
            return name + " body of " + length + " bytes exceeds " + std::to_string(kMaxControlBytes);
        case HeaderError::kNotWholeEntries:
            return name + " body of " + length + " bytes is not a whole number of entries";
    }
    return "unknown header error";
}

void encode_header(const Header& h, uint8_t* out) {
    store<uint32_t>(out, kMagic);
    out[4] = kVersion;
    out[5] = h.type;
    out[6] = h.flags;
    out[7] = h.dtype;
    store<uint32_t>(out + 8, h.epoch);
    store<uint32_t>(out + 12, h.sender);
    store<uint64_t>(out + 16, h.key);
    store<uint32_t>(out + 24, h.round);
    store<uint32_t>(out + 28, h.status);
    store<uint64_t>(out + 32, h.length);
}

}  // namespace gradwire
