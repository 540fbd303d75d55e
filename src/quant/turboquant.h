// The rotated low-bit KV codec (TurboQuant, ../shared/docs/kv-quant.md): a block of n values (n a
// power of two, 32..128: a head's width up to 128, else 128-value pieces of it) is rotated by a
// randomized Walsh-Hadamard transform, y = (1/sqrt(n)) diag(s2) H diag(s1) x with fixed +-1 vectors
// s1, s2, so that every coordinate of y/|y| follows the distribution of one
// coordinate of a random unit vector in n dimensions; each coordinate is then coded by the
// Lloyd-Max codebook of that distribution at 2, 3 or 4 bits, and one f16 scale per block restores the
// magnitude. The default scale is gamma = |x| / <z, c> (z = y/|y|, c the chosen centroids): then
// <x, decoded> = |x|^2 for every block, so inner products with an independent query are unbiased.
// Two others are kept for comparison: the least-squares fit |x| <z, c> / |c|^2 (the smallest error
// per block, but inner products shrink by cos^2 of the coding angle: about 1 - d*MSE, measured 0.886
// at 2 bits) and the llama.cpp forks' "norm correction" |x| / |c| (shrinks them by cos: 0.986 at 3
// bits). (../shared/docs/kv-quant.md calls the least-squares fit unbiased; the measurement in
// tests/test_turboquant.cpp says otherwise.)
//
// Block layouts (bytes per n values): tq4 = f16 scale + n/2 bytes of nibbles; tq3 = f16 scale + n/4
// bytes of 2 low bits + n/8 bytes of high bits; tq2 = f16 scale + n/4 bytes of 2-bit codes. Codes are
// little-endian within a byte (value i of a group in bits [b*i, b*i + b)).
//
// This file is the codec's definition (a plain scalar reference); the tq caches (runtime/kv_cache.h)
// code with the least-squares scale, which gave the lower KL divergence on the fixtures
// (docs/kv-cache.md). The GPU's store writes the same bytes and its attention reads the blocks
// directly (cuda/flash_attention.cu).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace fitmoe::tq {

enum class Scale { Unbiased, LeastSquares, NormCorrected };

// The Lloyd-Max codebook for one coordinate of a random unit vector in n dimensions (density
// proportional to (1 - z^2)^((n - 3) / 2) on [-1, 1]) at `bits` bits: 2^bits centroids in increasing
// order, symmetric about 0; the decision boundaries are the midpoints. Computed once per (n, bits) by
// Lloyd's iteration on the exact density (numerical integration), then cached.
const std::vector<float>& lloyd_max_codebook(int n, int bits);
// The expected squared error per coordinate of that quantizer times n (the "d * MSE" figure).
double lloyd_max_dmse(int n, int bits);

// x := H x / sqrt(n) in place, n a power of two: the orthonormal Walsh-Hadamard transform (Sylvester
// order), computed as the reference's CPU does (the scale first, then the butterflies), so the bits
// agree. Its own inverse. Also the reference's rotation of q8_0 / q4_0 caches (runtime/kv_cache.h).
void walsh_hadamard(float* x, int n);

// The randomized Hadamard transform of one block in place, and its inverse (the fixed sign vectors
// depend only on n).
void rotate(float* x, int n);
void unrotate(float* x, int n);
// The fixed sign vectors s1 (which = 1) and s2 (which = 2) of blocks of n values (+1 / -1).
std::vector<float> rotation_signs(int n, int which);

size_t block_bytes(int n, int bits);

// Codes one block of n values (finite: a NaN or infinity throws fitmoe::Error naming it) into dst
// (block_bytes(n, bits)); `codebook` overrides the Lloyd-Max one (comparison codecs in the tests).
// The sums over the block (|y|^2, <z, c>, |c|^2) run in double in the order a GPU warp computes them
// (value l + 32 j in lane l: a fused multiply-add chain over j per lane, then the xor-butterfly sum
// over the lanes), so that the GPU's store (cuda/flash_attention.cu) writes the same bytes.
void encode_block(const float* x, int n, int bits, uint8_t* dst, Scale scale = Scale::Unbiased,
                  const std::vector<float>* codebook = nullptr);
// The block decoded back to n values (rotated back).
void decode_block(const uint8_t* src, int n, int bits, float* out, const std::vector<float>* codebook = nullptr);
// The block's values in the rotated domain (what attention uses: Q rotated alike needs no inverse).
void decode_block_rotated(const uint8_t* src, int n, int bits, float* out, const std::vector<float>* codebook = nullptr);

}  // namespace fitmoe::tq
