// Shared by the engine's CUDA GEMV (w4gemv_cuda.cu) and lab/engine/cuda_chain.cu: the int4 codes
// of compressed-tensors' pack-quantized layout unpacked to exact fp32 products, bf16 conversions,
// a chunk's product over R rows, the swizzled staged row, the PDL wait/release (-DPDL=1 from
// sm_90; without it both are empty), and from sm_90 the bulk copies and their barrier.

#pragma once

typedef unsigned int u32;
typedef unsigned short u16;

#if PDL  // sm_90 on: wait for the kernel before (its writes visible), then let the next start
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_release() {
    asm volatile("griddepcontrol.launch_dependents;" :::);
}
#else
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ void pdl_release() {}
#endif

__device__ __forceinline__ u32 lop3_or(u32 a, u32 mask, u32 magic) {  // (a & mask) | magic
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(magic));
    return r;
}

__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float((u32)v << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {  // round to nearest even (finite values)
    u32 u = __float_as_uint(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

__device__ __forceinline__ float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// The 8 activations of one word, as fp32, nibble j's scaled by 16^-j (exact powers of two), so
// nibbles 0..4 can be read in place: (w & (0xF << 4j)) | 2^23 reads 2^23 + c * 16^j.
__device__ __forceinline__ void unpack_x8(uint4 v, float* x) {
    x[0] = __uint_as_float(v.x << 16);
    x[1] = __uint_as_float(v.x & 0xFFFF0000u) * 0.0625f;
    x[2] = __uint_as_float(v.y << 16) * 0.00390625f;
    x[3] = __uint_as_float(v.y & 0xFFFF0000u) * 0.000244140625f;
    x[4] = __uint_as_float(v.z << 16) * 1.52587890625e-05f;
    x[5] = __uint_as_float(v.z & 0xFFFF0000u);  // nibbles 5..7 after one shift by 20
    x[6] = __uint_as_float(v.w << 16) * 0.0625f;
    x[7] = __uint_as_float(v.w & 0xFFFF0000u) * 0.00390625f;
}

// the 8 codes of one word as exact fp32 (code_j - 8) * 16^j (the fp32 magic-number unpack),
// to multiply with unpack_x8's activations
__device__ __forceinline__ void codes8(u32 w, float* c) {
    const u32 M = 0x4B000000u;
    c[0] = __uint_as_float(lop3_or(w, 0xFu, M)) - 8388616.f;
    c[1] = __uint_as_float(lop3_or(w, 0xF0u, M)) - 8388736.f;
    c[2] = __uint_as_float(lop3_or(w, 0xF00u, M)) - 8390656.f;
    c[3] = __uint_as_float(lop3_or(w, 0xF000u, M)) - 8421376.f;
    c[4] = __uint_as_float(lop3_or(w, 0xF0000u, M)) - 8912896.f;
    const u32 h = w >> 20;
    c[5] = __uint_as_float(lop3_or(h, 0xFu, M)) - 8388616.f;
    c[6] = __uint_as_float(lop3_or(h, 0xF0u, M)) - 8388736.f;
    c[7] = __uint_as_float(lop3_or(h, 0xF00u, M)) - 8390656.f;
}

// sum_j (code_j - 8) * x_j over one word, exact products
__device__ __forceinline__ float dot_word(u32 w, const float* x, float acc) {
    float c[8];
    codes8(w, c);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(c[j], x[j], acc);
    return acc;
}

__device__ __forceinline__ int swz(int word) {  // a 16-byte word's slot in a staged row
    return word ^ ((word >> 3) & 3);
}

__device__ __forceinline__ u32 word_of(uint4 v, int q) {  // q known at compile time
    return q == 0 ? v.x : q == 1 ? v.y : q == 2 ? v.z : v.w;
}

// acc[r * M + m] += scale[r] * (the chunk's 32 codes of weight row r . activation row m's 32
// values there), for R weight rows and M activation rows: each weight word's codes unpacked once
// for all M rows. The activations come through L1 (row m's words `row_words` apart) or, for one
// row, from a staged, swizzled copy (STAGED_X).
template <int R, int M, bool STAGED_X>
__device__ __forceinline__ void chunk_dot(const uint4* wv, const float* scale, const uint4* xsrc,
                                          int row_words, int chunk, float* acc) {
    float part[R * M];
#pragma unroll
    for (int i = 0; i < R * M; ++i) part[i] = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // the chunk's 4 words, 8 activations each
        float c[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) codes8(word_of(wv[r], q), c[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xv[8];
            const int word = chunk * 4 + q;
            unpack_x8(STAGED_X ? xsrc[swz(word)] : __ldca(xsrc + m * row_words + word), xv);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int j = 0; j < 8; ++j) part[r * M + m] = fmaf(c[r][j], xv[j], part[r * M + m]);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r * M + m] = fmaf(part[r * M + m], scale[r], acc[r * M + m]);
}

#if __CUDA_ARCH__ >= 900  // transaction barriers and bulk copies (PTX ISA 8.0)
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void bar_init(unsigned long long* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// the one arrival of the barrier's phase, expecting `bytes` of copies to complete it
__device__ __forceinline__ void bar_expect(unsigned long long* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes,
                                          unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1], %2, [%3];"
                 ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}
// whether the barrier's phase of this parity has completed (a bounded wait in hardware)
__device__ __forceinline__ bool bar_done(unsigned long long* bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}
// before a bulk copy overwrites shared memory that threads read (generic then async proxy)
__device__ __forceinline__ void fence_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// until the barrier's phase of this parity completes (0 for its first use, then 1, 0, ...)
__device__ __forceinline__ void bar_wait(unsigned long long* bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nwait_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra wait_%=;\n}" ::"r"(smem_addr(bar)), "r"(parity) : "memory");
}
#endif
