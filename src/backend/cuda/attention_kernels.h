// The CUDA tiled attention's kernel choice for 16-bit storage (attention_tiled.cu), for tests and
// benchmarks: the tensor-core tiles (WMMA, bf16 / f16 products with fp32 accumulation, P and dS
// rounded to the storage type before their products, as FlashAttention) or the fp32 tiles on
// widened values (every product in fp32, each output rounded once). fp32 storage always takes the
// fp32 tiles. Both are deterministic; they differ by rounding (docs/notes/cuda.md, "## attention").
#pragma once

namespace headroom::backend::cuda {

enum class TiledAttentionKernel {
  kAuto,         // kTensorCores
  kTensorCores,  // WMMA 16 x 16 x 16 tiles
  kFp32Tiles,    // the fp32 kernels on widened values
};
// Process-wide. The default is kAuto, or what the environment variable HEADROOM_CUDA_ATTENTION
// says (auto, tensor-cores or fp32; anything else throws std::invalid_argument naming it), read
// once. The scratch sizes do not depend on it.
void set_tiled_attention_kernel(TiledAttentionKernel kernel);
// The kernel 16-bit storage runs now (never kAuto).
TiledAttentionKernel tiled_attention_kernel();

}  // namespace headroom::backend::cuda
