// Byte sizes as people write them: "4GiB", "512MiB", "24GB", "1.5G", "1048576".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"

namespace headroom {

constexpr uint64_t kKiB = 1024ull;
constexpr uint64_t kMiB = 1024ull * kKiB;
constexpr uint64_t kGiB = 1024ull * kMiB;

// Accepts an integer or decimal number followed by an optional unit: B, K/KiB/KB, M/MiB/MB,
// G/GiB/GB, T/TiB/TB (case-insensitive). Binary units (KiB) and the bare letters (K) are powers
// of 1024; KB/MB/GB/TB are powers of 1000, as on disk labels.
Result<uint64_t> parse_bytes(std::string_view text);

// "1.50 GiB", "512.0 MiB", "812 B": three significant figures, binary units.
std::string format_bytes(uint64_t bytes);

}  // namespace headroom
