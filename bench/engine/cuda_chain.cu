// The CUDA side of bench/engine/cuda_chain_probe.py: two empty links and a generic int4 tile,
// compiled at run time by NVRTC (no nvcc needed), each launch with programmatic dependent launch.
// (The probe's per-shape GEMV is the engine's own, engine/kernels/w4gemv_cuda.cu.)
//
// Why it exists: the one-row decode step is a chain of ~360 dependent kernels whose int4
// products cost ~3.9 us each whatever their bytes (bench/NOTES.md v26-v29). Before a megakernel
// is written in CUDA, this measures the floor of a PDL boundary (an empty kernel), a boundary with
// one dependent round trip through memory, and the megakernel's mechanism (tiles waiting on
// counts instead of kernel boundaries) against one launch per product.
//
// Layout (compressed-tensors pack-quantized, symmetric, group 32): packed int32 [N, K/8], code k
// of a row in word k/8 at bits 4*(k%8), stored unsigned as q+8; scales bf16 [N, K/32]. One 16-byte
// load of a row is 32 codes: exactly one scale group. Activations and outputs are bf16.

#include "w4_codes.cuh"  // engine/kernels: the codes' unpack, bf16, PDL (built with PDL=1)

// The generic tile (K known at run time): GW warps, one row group each, 32 threads across K, GR
// rows per thread, the first GPF chunks' weights requested ahead. Two kernels share it: one
// launch per product (w4_rt_launch, PDL), and one persistent launch for the whole chain
// (w4_rt_flow) whose tiles wait on a count of the product before's finished tiles, each after
// requesting its own weights. Same tiles, same order of sums: the two agree bit for bit.
#define GW 4
#define GR 2
#define GPF 8

struct Product {  // one product of the chain, as the probe's table lays it out (48 bytes)
    const u16* x;
    const uint4* w;
    const u16* s;
    u16* y;
    int n;
    int kc;     // 16-byte chunks per row (K / 32)
    int tiles;  // blocks of GW * GR rows
    int pad;
};

// Thread 0 polls the count until `target` tiles are done (acquire), then the block goes on; a
// wait past the limit raises `err` instead of hanging (a grid not all resident at once).
__device__ __forceinline__ void wait_count(const unsigned* count, unsigned target, unsigned* err) {
    if (threadIdx.x == 0) {
        unsigned seen, polls = 0;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
        } while (seen < target && ++polls < (1u << 18));
        if (seen < target) atomicMax(err, 1u);
    }
    __syncthreads();
}

template <bool FLOW>
__device__ __forceinline__ void tile_rt(const Product& P, int t, const unsigned* prev_count,
                                        unsigned prev_tiles, unsigned* err) {
    const int kt = threadIdx.x & 31;
    const int rg = threadIdx.x >> 5;
    const int row0 = (t * GW + rg) * GR;
    uint4 wr[GPF][GR];
    float sr[GPF][GR];
#pragma unroll
    for (int c = 0; c < GPF; ++c) {
        const int chunk = kt + c * 32;
#pragma unroll
        for (int r = 0; r < GR; ++r) {
            const int row = min(row0 + r, P.n - 1);
            if (chunk < P.kc) {
                wr[c][r] = P.w[(long)row * P.kc + chunk];
                sr[c][r] = __uint_as_float((u32)P.s[(long)row * P.kc + chunk] << 16);
            }
        }
    }
    if (FLOW) {
        if (prev_count != nullptr) wait_count(prev_count, prev_tiles, err);
    } else {
        pdl_wait();
        pdl_release();
    }
    const uint4* x4 = reinterpret_cast<const uint4*>(P.x);
    float acc[GR];
#pragma unroll
    for (int r = 0; r < GR; ++r) acc[r] = 0.f;
    for (int c = 0; kt + c * 32 < P.kc; ++c) {
        const int chunk = kt + c * 32;
        uint4 wc[GR];
        float sc[GR];
#pragma unroll
        for (int r = 0; r < GR; ++r) {
            if (c < GPF) {
#pragma unroll
                for (int i = 0; i < GPF; ++i)  // registers are indexed by constants only
                    if (i == c) { wc[r] = wr[i][r]; sc[r] = sr[i][r]; }
            } else {
                const int row = min(row0 + r, P.n - 1);
                wc[r] = P.w[(long)row * P.kc + chunk];
                sc[r] = __uint_as_float((u32)P.s[(long)row * P.kc + chunk] << 16);
            }
        }
        float part[GR];
#pragma unroll
        for (int r = 0; r < GR; ++r) part[r] = 0.f;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            float xs[8];
            unpack_x8(__ldcg(x4 + chunk * 4 + q), xs);
#pragma unroll
            for (int r = 0; r < GR; ++r) {
                const u32 word = q == 0 ? wc[r].x : q == 1 ? wc[r].y : q == 2 ? wc[r].z : wc[r].w;
                part[r] = dot_word(word, xs, part[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < GR; ++r) acc[r] = fmaf(part[r], sc[r], acc[r]);
    }
#pragma unroll
    for (int r = 0; r < GR; ++r) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], off);
        if (kt == 0 && row0 + r < P.n) P.y[row0 + r] = f32_to_bf16(acc[r]);
    }
}

// One product, one tile per block, PDL.
extern "C" __global__ void __launch_bounds__(GW * 32) w4_rt_launch(const Product* table, int p) {
    const Product P = table[p];
    tile_rt<false>(P, blockIdx.x, nullptr, 0, nullptr);
}

// Every product of the table in one launch: block b takes tiles b, b + grid, ... of each
// product in turn; a tile waits for all tiles of the product before (its input), counts itself
// done after its stores. `done` (one count per product) is zero at the start.
extern "C" __global__ void __launch_bounds__(GW * 32)
w4_rt_flow(const Product* table, int count, unsigned* done, unsigned* err) {
    for (int p = 0; p < count; ++p) {
        const Product P = table[p];
        const unsigned prev_tiles = p > 0 ? (unsigned)table[p - 1].tiles : 0u;
        for (int t = blockIdx.x; t < P.tiles; t += gridDim.x) {
            tile_rt<true>(P, t, p > 0 ? done + p - 1 : nullptr, prev_tiles, err);
            __syncthreads();  // every thread's stores issued
            if (threadIdx.x == 0) {
                __threadfence();
                atomicAdd(done + p, 1u);
            }
        }
    }
}

// The floor of one PDL boundary: a kernel that only waits for the one before and lets the next go.
extern "C" __global__ void null_link() {
    pdl_wait();
    pdl_release();
}

// One boundary with a dependent round trip: y = x + 1 over n bf16 values (each kernel reads
// what the one before wrote).
extern "C" __global__ void copy_link(const u16* __restrict__ x, u16* __restrict__ y, int n) {
    pdl_wait();
    pdl_release();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = f32_to_bf16(__uint_as_float((u32)__ldcg(x + i) << 16) + 1.f);
}
