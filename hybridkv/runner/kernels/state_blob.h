// A request's state blob as it lies in the block pool (`state_step.cpp`): P segments of bytes, each at its own
// address, and a walk over a region's rows that looks a segment up once, not once per row.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// The blob of one request: P segments, blob offset -> address.
struct Blob {
  const int64_t* starts;  // [P + 1], ascending; starts[0] = 0
  const int64_t* addr;    // [P]
  int64_t segments;

  // The address of bytes [offset, offset + n) when they lie in one segment, else null.
  uint8_t* span(int64_t offset, int64_t n) const {
    const int64_t s = std::upper_bound(starts, starts + segments + 1, offset) - starts - 1;
    if (offset + n > starts[s + 1]) return nullptr;
    return reinterpret_cast<uint8_t*>(addr[s]) + (offset - starts[s]);
  }

  // Bytes [offset, offset + n) of the blob into `buf` (kGather) or from it.
  template <bool kGather>
  void copy(int64_t offset, int64_t n, uint8_t* buf) const {
    int64_t s = std::upper_bound(starts, starts + segments + 1, offset) - starts - 1;
    while (n > 0) {
      const int64_t piece = std::min(n, starts[s + 1] - offset);
      uint8_t* at = reinterpret_cast<uint8_t*>(addr[s]) + (offset - starts[s]);
      if (kGather) {
        std::memcpy(buf, at, piece);
      } else {
        std::memcpy(at, buf, piece);
      }
      buf += piece;
      offset += piece;
      n -= piece;
      ++s;
    }
  }
};

// Rows of `row_bytes` from blob byte `offset` on, in order: one segment lookup per segment, not per row.
struct RowWalk {
  const Blob& blob;
  int64_t offset, row_bytes, end;  // rows up to blob byte `end`
  uint8_t* at = nullptr;
  int64_t left = 0;  // bytes of the current segment from `at` on

  // The next row's address where it lies in one segment, else null (it straddles a segment end, or is past `end`).
  uint8_t* next() {
    if (offset + row_bytes > end) return nullptr;
    if (left < row_bytes) {
      const int64_t s = std::upper_bound(blob.starts, blob.starts + blob.segments + 1, offset) - blob.starts - 1;
      at = reinterpret_cast<uint8_t*>(blob.addr[s]) + (offset - blob.starts[s]);
      left = blob.starts[s + 1] - offset;
    }
    offset += row_bytes;
    if (left < row_bytes) {
      left = 0;
      return nullptr;
    }
    uint8_t* row = at;
    at += row_bytes;
    left -= row_bytes;
    return row;
  }
};

}  // namespace
