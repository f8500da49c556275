// The frame header, as protocol/frames.py defines it: the same layout, the same validation, the same messages.
//
// Layout (40 bytes, little-endian):
//   magic u32 | version u8 | type u8 | flags u8 | dtype u8 | epoch u32 | sender u32
//   | key u64 | round u32 | status u32 | length u64
//
// A header is validated completely before any buffer is sized from it (decode_header): the Python decoder is the
// reference, and tests feed both the same bytes (tests/native/test_frames.py).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace gradwire {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire is little-endian; a big-endian host must swap");

constexpr uint32_t kMagic = 0x31575247;  // b"GRW1" little-endian
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderSize = 40;
constexpr uint64_t kMaxControlBytes = uint64_t(1) << 20;
constexpr uint64_t kAckEntrySize = 12;  // (key u64, round u32)

enum FrameType : uint8_t {
    kHello = 1,
    kProof = 2,
    kControl = 3,
    kPushPull = 4,
    kResult = 5,
    kError = 6,
    kBye = 7,
    kAck = 8,
    kShmAttach = 9,
    kProbe = 10,
    kAcks = 11,
    kReceived = 12,
    kEveryone = 13,
};

// Flag bits (protocol/frames.py says what each means). kShmPayload: the payload of a PUSHPULL or RESULT lies in a
// shared-memory slot, not on the stream (its header's length is the slot's bytes).
constexpr uint8_t kSeed = 0x02, kReplica = 0x04, kReplay = 0x08, kHeld = 0x10, kAveraged = 0x20, kShmPayload = 0x01;

struct Header {
    uint8_t type = 0;
    uint8_t flags = 0;
    uint8_t dtype = 0;
    uint32_t epoch = 0;
    uint32_t sender = 0;
    uint64_t key = 0;
    uint32_t round = 0;
    uint32_t status = 0;
    uint64_t length = 0;
};

// The bytes of a frame's payload that follow its header on the stream.
inline uint64_t wire_length(const Header& h) {
    return (h.flags & kShmPayload) && (h.type == kPushPull || h.type == kResult) ? 0 : h.length;
}

// What was wrong with a header; kOk where nothing was.
enum class HeaderError { kOk, kMagic, kVersion, kType, kDtype, kPayloadTooLong, kNotWholeElements, kBodyTooLong,
                         kNotWholeEntries };

// The bytes of one element of a wire dtype code (protocol/dtypes.py), or 0 for an unknown code.
size_t itemsize(uint8_t dtype);

// The name protocol/frames.py's FrameType gives a type code ("" for an unknown one).
const char* type_name(uint8_t type);

// Decode and validate 40 bytes into `out`. Never reads past raw[39]; allocates nothing.
HeaderError decode_header(const uint8_t* raw, uint64_t max_payload, Header& out);

// The message protocol/frames.py's decode_header raises for the same bytes (allocates: the error path only).
std::string describe(HeaderError error, const uint8_t* raw, uint64_t max_payload);

// Pack a header into 40 bytes (magic and version included).
void encode_header(const Header& h, uint8_t* out);

}  // namespace gradwire
