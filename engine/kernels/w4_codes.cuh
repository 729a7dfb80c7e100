// Shared by the engine's CUDA GEMV (w4gemv_cuda.cu) and bench/engine/cuda_chain.cu: the int4 codes
// of compressed-tensors' pack-quantized layout unpacked to exact fp32 products, bf16 conversions,
// and the PDL wait/release (-DPDL=1 from sm_90; without it both are empty).

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

// sum_j (code_j - 8) * x_j over one word, exact products (the fp32 magic-number unpack)
__device__ __forceinline__ float dot_word(u32 w, const float* x, float acc) {
    const u32 M = 0x4B000000u;
    acc = fmaf(__uint_as_float(lop3_or(w, 0xFu, M)) - 8388616.f, x[0], acc);
    acc = fmaf(__uint_as_float(lop3_or(w, 0xF0u, M)) - 8388736.f, x[1], acc);
    acc = fmaf(__uint_as_float(lop3_or(w, 0xF00u, M)) - 8390656.f, x[2], acc);
    acc = fmaf(__uint_as_float(lop3_or(w, 0xF000u, M)) - 8421376.f, x[3], acc);
    acc = fmaf(__uint_as_float(lop3_or(w, 0xF0000u, M)) - 8912896.f, x[4], acc);
    const u32 h = w >> 20;
    acc = fmaf(__uint_as_float(lop3_or(h, 0xFu, M)) - 8388616.f, x[5], acc);
    acc = fmaf(__uint_as_float(lop3_or(h, 0xF0u, M)) - 8388736.f, x[6], acc);
    acc = fmaf(__uint_as_float(lop3_or(h, 0xF00u, M)) - 8390656.f, x[7], acc);
    return acc;
}
