// LL ("low latency") protocol: every 8 bytes carry 4 bytes of payload and a 4-byte flag, so a
// reader knows a word is complete by its flag alone, with no barrier or fence between writer and
// reader (NCCL's LL protocol, src/device/prims_ll.h; mscclpp's LL8 packets). Shared by the CPU twins
// (csrc/cpu, 64-bit atomic words in POSIX shared memory) and the CUDA kernels (csrc/kernels,
// st/ld.volatile.global.v2/v4 on IPC or peer buffers).
//
// Flags and epochs. Every collective call has an epoch number that lives in memory (shared memory
// on CPU, device memory on GPU) and is advanced by the op itself, never passed as an argument, so a
// replayed CUDA graph uses the next epoch. The flag written with a packet is derived from the epoch
// and is never 0 (buffers start zeroed). Packet buffers are double-buffered by epoch parity: a rank
// writes epoch e's packets only after it has read every peer's packets of epoch e-1, so the only
// stale words a reader of slot (e % 2) can meet carry the flag of epoch e-2. Flags therefore need at
// least 3 distinct values; with kFlagSpace values they wrap around every kFlagSpace epochs.
//
// Wrap-around test switch: build with -DSWIFTSPEC_LL_FLAG_BITS=2 to shrink the flag space to
// {1, 2, 3} so flags wrap every 3 calls and the tests exercise it (NCCL does the same with
// TEST_LL_CLEANUP). Production builds use the full 32 bits.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define SWIFTSPEC_HD __host__ __device__ __forceinline__
#else
#define SWIFTSPEC_HD inline
#endif

#ifndef SWIFTSPEC_LL_FLAG_BITS
#define SWIFTSPEC_LL_FLAG_BITS 32
#endif

namespace swiftspec {
namespace ll {

constexpr uint32_t kFlagBits = SWIFTSPEC_LL_FLAG_BITS;
static_assert(kFlagBits >= 2 && kFlagBits <= 32, "LL flags need 2..32 bits (>= 3 nonzero values)");

// Number of distinct nonzero flag values.
constexpr uint64_t kFlagSpace = (kFlagBits == 32) ? 0xFFFFFFFFull : ((1ull << kFlagBits) - 1ull);

// Number of packet buffers per peer (epoch parity).
constexpr int kNumSlots = 2;

// Bytes of payload per 8-byte packet word.
constexpr int kPayloadBytes = 4;

// The flag of epoch `epoch` (epochs count from 0): 1, 2, ..., kFlagSpace, 1, 2, ...
SWIFTSPEC_HD uint32_t flag_of_epoch(uint64_t epoch) {
  return 1u + static_cast<uint32_t>(epoch % kFlagSpace);
}

// The packet buffer used by epoch `epoch`.
SWIFTSPEC_HD int slot_of_epoch(uint64_t epoch) { return static_cast<int>(epoch & 1ull); }

// LL8 word: flag in the high half, payload in the low half.
SWIFTSPEC_HD uint64_t pack8(uint32_t payload, uint32_t flag) {
  return (static_cast<uint64_t>(flag) << 32) | payload;
}
SWIFTSPEC_HD uint32_t flag8(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
SWIFTSPEC_HD uint32_t payload8(uint64_t word) { return static_cast<uint32_t>(word); }

// LL16 packet (NCCL layout): two payload words, each followed by its flag, stored and loaded as
// one 16-byte vector so both halves arrive together.
struct alignas(16) Packet16 {
  uint32_t data0;
  uint32_t flag0;
  uint32_t data1;
  uint32_t flag1;
};

SWIFTSPEC_HD Packet16 pack16(uint32_t d0, uint32_t d1, uint32_t flag) {
  Packet16 p;
  p.data0 = d0;
  p.flag0 = flag;
  p.data1 = d1;
  p.flag1 = flag;
  return p;
}
SWIFTSPEC_HD bool ready16(const Packet16& p, uint32_t flag) {
  return p.flag0 == flag && p.flag1 == flag;
}

// Number of LL8 words needed for `bytes` bytes of payload (the tail word is zero-padded).
SWIFTSPEC_HD int64_t words_for_bytes(int64_t bytes) {
  return (bytes + kPayloadBytes - 1) / kPayloadBytes;
}

}  // namespace ll
}  // namespace swiftspec
