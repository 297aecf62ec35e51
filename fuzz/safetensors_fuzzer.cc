// Fuzzes the safetensors reader (header and data) and the GPT-2 weight loader on top of it: any
// bytes give a file whose tensors tile the data section and can be read, or an error naming the
// file; never a crash or a read outside the file.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "model/config.h"
#include "model/gpt2.h"
#include "model/safetensors.h"
#include "model/weights.h"

using namespace headroom;

namespace {

// The seed corpus holds a model.safetensors of this config, so the fuzzer starts next to files
// that load_weights accepts.
const model::Gpt2Config& tiny_config() {
  static const model::Gpt2Config c = [] {
    model::Gpt2Config t;
    t.n_layer = 1;
    t.n_head = 2;
    t.n_embd = 4;
    t.vocab_size = 8;
    t.n_positions = 4;
    return t;
  }();
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static fuzz::MemFile file;
  static const model::ParamTable table = model::gpt2_param_table(tiny_config());
  static std::vector<float> params(size_t(table.total_floats));

  const std::string& path = file.write(data, size);
  {
    Result<model::SafetensorsFile> st = model::SafetensorsFile::open(path);
    if (!st.is_ok()) {
      fuzz::expect_names(st.status(), path);
    } else {
      // Accepted: the header length is in bounds, and the tensors tile the data section exactly.
      uint64_t header_bytes = 0;
      for (int i = 7; i >= 0; i--) header_bytes = (header_bytes << 8) | data[i];
      const uint64_t data_bytes = size - 8 - header_bytes;
      uint64_t total = 0;
      const unsigned char* lowest = nullptr;
      const unsigned char* highest = nullptr;
      for (const model::SafetensorsTensor& t : st->tensors()) {
        if (t.bytes != size_t(t.shape.numel()) * dtype_size(t.dtype)) {
          fuzz::fail("tensor bytes do not match its shape", t.name);
        }
        if (st->find(t.name) != &t) fuzz::fail("find does not return the tensor", t.name);
        const auto* p = static_cast<const unsigned char*>(t.data);
        if (t.bytes > 0) {
          if (!lowest || p < lowest) lowest = p;
          if (!highest || p + t.bytes > highest) highest = p + t.bytes;
        }
        total += t.bytes;
      }
      if (total != data_bytes || (total > 0 && uint64_t(highest - lowest) != data_bytes)) {
        fuzz::fail("accepted tensors do not tile the data section", path);
      }
      // Reads every byte of the mapping's data section.
      if (lowest && std::memcmp(lowest, data + 8 + header_bytes, size_t(data_bytes)) != 0) {
        fuzz::fail("tensor data is not the file's data section", path);
      }
    }
  }
  // The weight loader: names, shapes and dtype conversion on the same file.
  Status loaded = model::load_weights(path, table, params.data());
  fuzz::expect_names(loaded, path);
  return 0;
}
