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

#if __CUDA_ARCH__ >= 900
// ---------------------------------------------------------------------------------------------
// The megakernel's mechanism with bulk-copied tiles (sm_90): one persistent launch for the whole
// chain, the weights of each block's next tiles streaming into a ring of shared-memory stages
// while it waits on the count of the product before. A tile is up to FR rows of one product;
// global tile g (tiles numbered across products in order) belongs to block g % grid. Per tile:
// FW warps, 32 lanes across K, FR / FW rows a warp, the engine GEMV's sums in its order (the
// register tiling Tiling(32, FR / FW, FW) computes the same bits). Dynamic shared memory: FS
// stages of FLOW_STAGE bytes (words, then scales), then the product's row, staged once a product.
#define FW 8
#define FRPT 2
#define FR (FW * FRPT)
#ifndef FS  // stages and their bytes: the probe builds a few rings (-DFS=.. -DFLOW_STAGE=..)
#define FS 3
#endif
#ifndef FLOW_STAGE
#define FLOW_STAGE (56 * 1024)
#endif
#define FLOW_X (12288 * 2)  // the widest row staged (K <= 12,288)

struct FlowProduct : Product {  // the probe's flow table (64 bytes); `tiles` of `rows` rows
    int rows;   // rows a tile: FR, or fewer where FR rows overflow a stage
    int first;  // the global number of its first tile
    int pad2[2];
};

struct Cursor {  // a block's walk over its tiles, in global order
    int p, t;
};

__device__ __forceinline__ Cursor first_tile(const FlowProduct* table, int count, int p) {
    for (; p < count; ++p) {  // this block's first tile in product p, or the next product's
        const int t = ((int)blockIdx.x - table[p].first % (int)gridDim.x + (int)gridDim.x)
                      % (int)gridDim.x;
        if (t < table[p].tiles) return {p, t};
    }
    return {count, 0};
}

__device__ __forceinline__ Cursor next_tile(const FlowProduct* table, int count, Cursor c) {
    c.t += gridDim.x;
    return c.t < table[c.p].tiles ? c : first_tile(table, count, c.p + 1);
}

// thread 0: the tile's words and scales into stage `st`, its barrier expecting their bytes
__device__ __forceinline__ void issue_tile(const FlowProduct& P, int t, unsigned char* st,
                                           unsigned long long* bar) {
    const int row0 = t * P.rows;
    const u32 rows = (u32)min(P.rows, P.n - row0);
    const u32 wbytes = rows * (u32)P.kc * 16u;
    bar_expect(bar, wbytes + rows * (u32)P.kc * 2u);
    bulk_copy(st, P.w + (long)row0 * P.kc, wbytes, bar);
    bulk_copy(st + wbytes, P.s + (long)row0 * P.kc, rows * (u32)P.kc * 2u, bar);
}

extern "C" __global__ void __launch_bounds__(FW * 32)
w4_bulk_flow(const FlowProduct* table, int count, unsigned* done, unsigned* err) {
    extern __shared__ __align__(128) unsigned char fsm[];
    __shared__ __align__(8) unsigned long long bars[FS];
    __shared__ int stuck;
    uint4* xs = reinterpret_cast<uint4*>(fsm + FS * FLOW_STAGE);
    if (threadIdx.x == 0)
        for (int i = 0; i < FS; ++i) bar_init(&bars[i]);
    __syncthreads();
    Cursor ahead = first_tile(table, count, 0);  // the next tile to copy in (thread 0's)
    if (threadIdx.x == 0)
        for (int i = 0; i < FS && ahead.p < count; ++i) {
            issue_tile(table[ahead.p], ahead.t, fsm + i * FLOW_STAGE, &bars[i]);
            ahead = next_tile(table, count, ahead);
        }
    const int lane = threadIdx.x & 31;
    const int lr0 = (threadIdx.x >> 5) * FRPT;  // the warp's first row in the tile
    int staged = -1;                             // the product whose row xs holds
    int j = 0;                                   // tiles of this block done
    for (Cursor c = first_tile(table, count, 0); c.p < count; c = next_tile(table, count, c), ++j) {
        const FlowProduct P = table[c.p];
        if (staged != c.p) {  // a new product: its input complete, then staged once
            if (c.p > 0) wait_count(done + c.p - 1, (unsigned)table[c.p - 1].tiles, err);
            for (int i = threadIdx.x; i < P.kc * 4; i += FW * 32)
                xs[swz(i)] = __ldcg(reinterpret_cast<const uint4*>(P.x) + i);
            __syncthreads();
            staged = c.p;
        }
        const int st = j % FS;
        const u32 parity = (u32)(j / FS) & 1u;
        if (threadIdx.x == 0) {  // a copy that never lands: say so, and every thread leaves
            unsigned polls = 0;
            while (!bar_done(&bars[st], parity) && ++polls < (1u << 20)) {
            }
            stuck = polls >= (1u << 20);
            if (stuck) atomicMax(err, 2u);
        }
        __syncthreads();
        if (stuck) return;
        bar_wait(&bars[st], parity);  // done: each thread observes the phase (the copy's bytes)
        const uint4* wsm = reinterpret_cast<const uint4*>(fsm + st * FLOW_STAGE);
        const int rows = min(P.rows, P.n - c.t * P.rows);
        const u16* ssm = reinterpret_cast<const u16*>(wsm + rows * P.kc);
        float acc[FRPT] = {};
        if (lr0 < rows) {
            for (int chunk = lane; chunk < P.kc; chunk += 32) {
                uint4 wv[FRPT];
                float scale[FRPT];
#pragma unroll
                for (int r = 0; r < FRPT; ++r) {  // a row past the tile reads row 0: not stored
                    const int lr = lr0 + r < rows ? lr0 + r : 0;
                    wv[r] = wsm[lr * P.kc + chunk];
                    scale[r] = bf16_to_f32(ssm[lr * P.kc + chunk]);
                }
                chunk_dot<FRPT, 1, true>(wv, scale, xs, 0, chunk, acc);
            }
        }
#pragma unroll
        for (int r = 0; r < FRPT; ++r) {
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], off);
            if (lane == 0 && lr0 + r < rows) P.y[c.t * P.rows + lr0 + r] = f32_to_bf16(acc[r]);
        }
        __syncthreads();  // the stage read by all, the tile's stores issued
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(done + c.p, 1u);
            if (ahead.p < count) {  // the stage just freed takes the tile FS ahead
                fence_async_shared();
                issue_tile(table[ahead.p], ahead.t, fsm + st * FLOW_STAGE, &bars[st]);
                ahead = next_tile(table, count, ahead);
            }
        }
    }
}
#endif
