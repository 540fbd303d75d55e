// Flash attention on the GPU over every KV cache type (runtime/kv_cache.h): the store that rotates and
// quantizes K and V rows into the cache, and the attention that reads the cache's bytes directly.
//
// Layout (DevKv with flash set, as cpu::KvView with flash): K rows [slot][k_row_bytes] and V rows
// [slot][v_row_bytes], each head's values its own blocks of the type; slot = position, or position %
// n_ctx for a ring (sliding-window layers). Rotations as the CPU's: rot_k / rot_v (the reference's
// Walsh-Hadamard rotation of q8_0 / q4_0 caches) rotate K and V before they are stored, Q alike and the
// output back; tq types rotate each block of tq_block values (randomized Hadamard), Q alike, and the
// output of a tq V is rotated back per block.
//
// Two kernels:
// - decode (batches under 64 queries, and every size on GPUs without tensor cores): one CTA per
//   (split of the keys, kv head's group of query heads, query); the group's queries in shared memory
//   in K's dot format (f16 for an f16 K, q8_0 for q8_0 / q4_0 K, as the reference's one-row kernel
//   takes them), each tile's K and V bytes staged in shared memory and decoded there (no f16 copy of
//   the cache), an online softmax per query head in f32, the splits merged by a second small kernel
//   that also rotates the output back. The number of splits is fixed from the host's bound on the
//   keys (so a captured graph stays valid), each split's range from the device's position.
// - prefill (64 queries or more, compute capability 7.0 and up): FlashAttention-2 on tensor cores
//   (wmma, f16 operands, f32 accumulation); K and V tiles are decoded to f16 by the tile loader, the
//   query heads of one kv head share each tile.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/gpu_ops.h"

namespace fitmoe::gpu {

// Stores n_tokens rows of K (n_head_kv * head_dim values, row stride ld_k) and V (n_head_kv *
// head_dim_v, ld_v) at positions pos[t] (device) into a flash cache (kv.flash): rotated as the cache
// says, then quantized with the CPU's bits (cpu::kv_quantize_row: the same bytes for every type; tq
// blocks too). A non-finite value in a tq block gives the block a NaN scale (the CPU's encoder throws;
// a kernel cannot), so the attention output turns NaN rather than silently wrong.
void flash_kv_store(const DevKv& kv, bool ring, const int32_t* pos, int n_tokens, const float* k, int64_t ld_k,
                    const float* v, int64_t ld_v, int n_head_kv, int head_dim, int head_dim_v, Stream s);

// Causal attention of n_tokens queries at positions pos[t] (device; nondecreasing) over a flash cache.
// keys_max: a host bound on the keys any query sees (its position + 1, or the window), e.g. the cache's
// capacity for a captured decode graph. window > 0: a query at p sees p - window + 1 .. p. Scratch:
// flash_scratch_bytes(n_head, head_dim_v) (the decode kernel's partial results).
void flash_attention(const float* q, int64_t ld_q, const DevKv& kv, bool ring, int window, const int32_t* pos,
                     int n_tokens, int keys_max, int n_head, int n_head_kv, int head_dim, int head_dim_v, float scale,
                     float* out, int64_t ld_out, void* scratch, size_t scratch_bytes, Stream s, int kernel = 0);
// (kernel: a testing knob as moe_matmul's tile: 0 picks, 1 forces the decode kernel for any batch,
// what GPUs without tensor cores run.)
size_t flash_scratch_bytes(int n_head, int head_dim_v);

// The tq codebooks and rotation signs in constant memory of the current device (done by the first
// store or attention call and by the caches' constructors, so that no copy happens while a graph is
// being captured).
void flash_init_tables();

}  // namespace fitmoe::gpu
