// File input and output of the emulation mains: arrays in raw .bin files, and float32 -> bf16
// bit patterns.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cuda_shim.h"

namespace emu {

// n items of T (float32 by default) from a raw .bin file; exits with a message if short.
template <typename T = float>
inline std::vector<T> read(const std::string& path, size_t n) {
  std::vector<T> x(n);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(x.data(), sizeof(T), n, f) != n) {
    std::fprintf(stderr, "cannot read %zu items from %s\n", n, path.c_str());
    std::exit(2);
  }
  std::fclose(f);
  return x;
}

inline void write(const std::string& path, const std::vector<float>& x) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(x.data(), sizeof(float), x.size(), f);
  std::fclose(f);
}

inline std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = float_to_bf16(x[i]);
  return y;
}

}  // namespace emu
