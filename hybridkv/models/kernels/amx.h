// What every AMX tile kernel needs before its first tile instruction: the OS's permission to use the tile state,
// and a tile configuration. Both kernels that use tiles (packed_tiles.cpp, paged_prefill_amx.h) take them here.
//
//   configuration  palette 1; tile t is rows[t] rows x 64 bytes (t in [0, 8)), the rest unused
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

constexpr bool kTiles = true;

// Linux hands out the tile registers' state only to a process that asks (arch_prctl, XTILEDATA); asked once.
inline bool tiles_granted() {
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  static const bool granted = syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  return granted;
}

// Loads palette 1 with tiles [0, 8) of rows[t] rows, 64 bytes each, on the calling thread.
inline void configure_tiles(const uint8_t (&rows)[8]) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {};
  } config;
  std::memcpy(config.rows, rows, sizeof(rows));
  _tile_loadconfig(&config);
}

inline void release_tiles() { _tile_release(); }

#else  // callers check kTiles && tiles_granted() before they configure; these keep their code free of #if

constexpr bool kTiles = false;
inline bool tiles_granted() { return false; }
inline void configure_tiles(const uint8_t (&)[8]) {}
inline void release_tiles() {}

#endif
