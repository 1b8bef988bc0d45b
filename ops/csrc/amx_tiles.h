// What the AMX kernels share: the tile configuration's layout and the permission check.
#pragma once

#include <cstdint>

// Whether Linux lets this process use the tiles (amx_linear.cpp; asked once).
bool amx_available();

namespace infer_recipes {

// The tile configuration (palette 1): bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// GCC's tile intrinsics are asm statements that name no memory: the compiler may move plain loads and
// stores of a buffer across a tile load or store of it. A barrier between them keeps their order.
inline void memory_barrier() { __asm__ __volatile__("" ::: "memory"); }

}  // namespace infer_recipes
