// Philox4x32-10 (Salmon et al., SC 2011), the counter-based generator cuRAND
// and PyTorch draw dropout masks from, and the dropout masks built on it.
// A draw is a pure function of (key, counter): the backward pass and a
// recomputed forward op regenerate a mask from each element's index instead
// of storing it. compiler/src/ops/philox.rs is the same function on the host;
// the two agree bit for bit.
//
// Compiles alone with nvcc or NVRTC defaults (and as host C++ through the
// test shim): plain integer arithmetic, no library.
#pragma once

#ifndef FS_PHILOX_CUH
#define FS_PHILOX_CUH

struct fs_philox_words {
    unsigned int w[4];
};

__device__ __forceinline__ unsigned int fs_mulhi32(unsigned int a, unsigned int b) {
    return (unsigned int)(((unsigned long long)a * (unsigned long long)b) >> 32);
}

// Four 32-bit words from counter (c0, c1, c2, c3) under key (k0, k1), after
// ROUNDS rounds (10: Random123's and cuRAND's Philox4x32-10).
template <int ROUNDS>
__device__ __forceinline__ fs_philox_words fs_philox4x32(unsigned int c0, unsigned int c1, unsigned int c2,
                                                          unsigned int c3, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int round = 0; round < ROUNDS; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned int lo0 = 0xD2511F53u * c0, hi0 = fs_mulhi32(0xD2511F53u, c0);
        const unsigned int lo1 = 0xCD9E8D57u * c2, hi1 = fs_mulhi32(0xCD9E8D57u, c2);
        const unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    fs_philox_words r;
    r.w[0] = c0;
    r.w[1] = c1;
    r.w[2] = c2;
    r.w[3] = c3;
    return r;
}

__device__ __forceinline__ fs_philox_words fs_philox4x32_10(unsigned int c0, unsigned int c1, unsigned int c2,
                                                             unsigned int c3, unsigned int k0, unsigned int k1) {
    return fs_philox4x32<10>(c0, c1, c2, c3, k0, k1);
}

// The draws of elements 4 block .. 4 block + 3 of dropout site `site` under
// the step's key: one Philox call, counter (block, site).
__device__ __forceinline__ fs_philox_words fs_dropout_block(const int* key, unsigned int site,
                                                             unsigned long long block) {
    return fs_philox4x32_10((unsigned int)block, (unsigned int)(block >> 32), site, 0u,
                            (unsigned int)key[0], (unsigned int)key[1]);
}

// The draw of element `index`: word index % 4 of its block's.
__device__ __forceinline__ unsigned int fs_dropout_draw(const int* key, unsigned int site,
                                                         unsigned long long index) {
    return fs_dropout_block(key, site, index >> 2).w[index & 3];
}

// Attention dropout (compiler/src/ops/philox.rs's attention_draw): 8-bit
// draws from Philox4x32-10 (FS_ATTENTION_ROUNDS; FlashAttention's take 7),
// one block for the 16
// probabilities of queries i, i + 1, i + 8, i + 9 by keys j, j + 1, j + 8,
// j + 9 (i and j with bits 0 and 3 clear): word (i bit 0) + 2 (i bit 3),
// byte (j bit 0) + 2 (j bit 3). `bh`: batch entry * query heads + query head.
#define FS_ATTENTION_ROUNDS 10

__device__ __forceinline__ fs_philox_words fs_attention_block(const int* key, unsigned int site, long long bh,
                                                               long long i, long long j) {
    const unsigned int row = (unsigned int)(((i >> 4) << 2) | ((i & 7) >> 1));
    const unsigned int col = (unsigned int)(((j >> 4) << 2) | ((j & 7) >> 1));
    return fs_philox4x32<FS_ATTENTION_ROUNDS>(col, row, (unsigned int)bh, site + 1u, (unsigned int)key[0],
                                              (unsigned int)key[1]);
}

// The draw of probability (i, j) alone (the simple kernels).
__device__ __forceinline__ unsigned int fs_attention_draw(const int* key, unsigned int site, long long bh, long long i,
                                                           long long j) {
    const int word = (int)((i & 1) + 2 * ((i >> 3) & 1)), byte = (int)((j & 1) + 2 * ((j >> 3) & 1));
    return (fs_attention_block(key, site, bh, i, j).w[word] >> (8 * byte)) & 0xffu;
}

#endif
