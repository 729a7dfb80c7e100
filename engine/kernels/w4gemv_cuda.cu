// The int4 GEMV in CUDA C++ for 1-8 rows (engine/kernels/w4gemv_cuda.py compiles it with NVRTC and
// launches it). It computes what engine/kernels/w4gemv_kernel.py's Triton kernel computes for each
// bf16 row: y = x @ dequant(W)^T, with the same epilogues (GLU over interleaved gate|up rows,
// gelu(y) * aux) and the same residual+norm prologue, rounding where the reference rounds.
//
// Why a second GEMV: the one-row decode step is a chain of ~210 dependent products whose cost is
// mostly each kernel's fixed part, not its bytes (bench/NOTES.md v26-v32). Here the tiles are
// fixed at compile time per K, so a thread requests EVERY weight it will use before its
// `griddepcontrol.wait`, while the kernel before it still runs; the Triton kernel requests only
// its first K step's.
//
// Layout (compressed-tensors pack-quantized, symmetric, group 32): packed int32 [N, K/8], code k
// of a row in word k/8 at bits 4*(k%8), stored unsigned as q+8; scales bf16 [N, K/32]. One 16-byte
// load of a row is 32 codes: exactly one scale group (a "chunk"). Activations and outputs bf16.
//
// Compile-time constants (-D): MR (activation rows: x [MR, K] and y [MR, N] row-major, the
// weights read once for all of them; the prologue and the staged row take one), KC (chunks per
// row, K/32), KT (threads across K, a power of two <= 32: a row's partial sums meet in one warp
// by shuffles), RPT (rows per thread: activations unpacked once for RPT rows), WARPS (per
// block), PF (chunks a thread requests before the wait),
// EPI (0 plain, 1 GLU, 2 gelu * aux), PRO (the residual+norm prologue), PRO_SCALAR, PRO_NEXT,
// XS (1: the row staged in shared memory once per block; 0: read through L1 by each thread; the
// prologue always stages it), BULK (1, sm_90 on: the block's rows of weights and scales, which
// are contiguous, copied into shared memory by the tensor memory accelerator before the wait:
// every weight byte in flight without holding registers, and a small rolled K loop), PDL (1
// from sm_90: griddepcontrol).
//
// The staged row is swizzled: 16-byte word q of chunk c sits at slot 4c + (q ^ ((c >> 1) & 3)), so
// the 8 threads of a quarter warp, reading word q of 8 consecutive chunks, hit 8 distinct bank
// quads (unswizzled, chunks 64 bytes apart would share them 4 ways).

#include "w4_codes.cuh"

#define THREADS (WARPS * 32)
#define RG (THREADS / KT)                  // row groups per block
#define CPT ((KC + KT - 1) / KT)           // chunks per thread (the last ones may be past KC)
#define K (KC * 32)
#define RB (RG * RPT)                      // rows per block
#define STAGED (PRO || XS)                 // one activation row only (MR == 1)

__device__ __forceinline__ float gelu_tanh(float x) {  // as engine/kernels/fused.py's
    float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    z = fminf(fmaxf(z, -20.f), 20.f);
    const float t = 1.f - 2.f / (__expf(2.f * z) + 1.f);
    return 0.5f * x * (1.f + t);
}

// The sum of v over the block (every thread gets it); `red` holds one float per warp.
__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    __syncthreads();  // `red` may still be read from a sum before
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) s += red[i];
    return s;
}

#if PRO
#define PER ((K + THREADS - 1) / THREADS)  // prologue elements per thread

// h' = round(h + round(y * inv_rms(y) * w_post)) [* scalar, rounded] (block 0 stores it), then
// the GEMV's input x = round(h' * inv_rms(h') * w_next) (or h' itself), into shared memory.
__device__ __forceinline__ void prologue(const u16* __restrict__ py, const u16* __restrict__ ph,
                                         const u16* __restrict__ pwp, const u16* __restrict__ psc,
                                         const u16* __restrict__ pwn, u16* __restrict__ ph_out,
                                         float eps, u16* xs, float* red) {
    float yv[PER], hv[PER];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int k = threadIdx.x + i * THREADS;
        yv[i] = k < K ? bf16_to_f32(__ldcg(py + k)) : 0.f;
        hv[i] = k < K ? bf16_to_f32(__ldcg(ph + k)) : 0.f;
        ss += yv[i] * yv[i];
    }
    const float inv1 = 1.f / sqrtf(block_sum(ss, red) / (float)K + eps);
    const float sc = PRO_SCALAR ? bf16_to_f32(psc[0]) : 1.f;
    float ss2 = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int k = threadIdx.x + i * THREADS;
        if (k < K) {
            float h = round_bf16(hv[i] + round_bf16(yv[i] * inv1 * bf16_to_f32(pwp[k])));
            if (PRO_SCALAR) h = round_bf16(h * sc);
            hv[i] = h;
            if (blockIdx.x == 0) ph_out[k] = f32_to_bf16(h);
        } else {
            hv[i] = 0.f;
        }
        ss2 += hv[i] * hv[i];
    }
    const float inv2 = PRO_NEXT ? 1.f / sqrtf(block_sum(ss2, red) / (float)K + eps) : 1.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int k = threadIdx.x + i * THREADS;
        if (k < K) xs[swz(k >> 3) * 8 + (k & 7)] =
                       PRO_NEXT ? f32_to_bf16(hv[i] * inv2 * bf16_to_f32(pwn[k]))
                                : f32_to_bf16(hv[i]);
    }
    __syncthreads();
}
#endif

// Block: RG row groups x KT threads across K; a thread owns RPT rows (consecutive, so a GLU
// thread holds whole gate|up pairs) and the chunks kt, kt + KT, ... of each. Unused pointers
// may be null: the variant's constants decide which are read.
extern "C" __global__ void __launch_bounds__(THREADS)
w4_gemv(const u16* __restrict__ x, const uint4* __restrict__ w, const u16* __restrict__ s,
        u16* __restrict__ y, int n, const u16* __restrict__ aux, const u16* __restrict__ py,
        const u16* __restrict__ ph, const u16* __restrict__ pwp, const u16* __restrict__ psc,
        const u16* __restrict__ pwn, u16* __restrict__ ph_out, float eps) {
    const int kt = threadIdx.x % KT;
    const int rg = threadIdx.x / KT;
    const int row0 = (blockIdx.x * RG + rg) * RPT;
#if BULK
    // dynamic shared memory: the block's RB rows of words [RB][KC] (16 bytes a chunk), then
    // their scales [RB][KC]; one barrier counts the bytes of both copies in
    extern __shared__ __align__(128) uint4 wsm[];
    __shared__ __align__(8) unsigned long long bar;
    const int rb0 = blockIdx.x * RB;
    u16* ssm = reinterpret_cast<u16*>(wsm + RB * KC);
    if (threadIdx.x == 0) bar_init(&bar);
    __syncthreads();
    if (threadIdx.x == 0) {
        const u32 rows = (u32)min(RB, n - rb0);
        bar_expect(&bar, rows * KC * 18u);
        bulk_copy(wsm, w + (long)rb0 * KC, rows * KC * 16u, &bar);
        bulk_copy(ssm, s + (long)rb0 * KC, rows * KC * 2u, &bar);
    }
#else
    uint4 wr[CPT][RPT];
    float sr[CPT][RPT];
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
        const int chunk = kt + c * KT;
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            const int row = min(row0 + r, n - 1);  // rows past N read row N-1, store nothing
            if (c < PF && chunk < KC) {
                wr[c][r] = __ldcs(w + (long)row * KC + chunk);
                sr[c][r] = bf16_to_f32(s[(long)row * KC + chunk]);
            }
        }
    }
#endif
    pdl_wait();
    pdl_release();
#if STAGED
    __shared__ uint4 xs[KC * 4];
#endif
#if PRO
    __shared__ float red[WARPS];
    prologue(py, ph, pwp, psc, pwn, ph_out, eps, reinterpret_cast<u16*>(xs), red);
#elif XS
    for (int i = threadIdx.x; i < KC * 4; i += THREADS)
        xs[swz(i)] = __ldcg(reinterpret_cast<const uint4*>(x) + i);
    __syncthreads();
#endif
#if STAGED
    const uint4* xsrc = xs;
#else
    const uint4* xsrc = reinterpret_cast<const uint4*>(x);
#endif
    float acc[RPT * MR];  // acc[r * MR + m]: weight row r against activation row m
#pragma unroll
    for (int i = 0; i < RPT * MR; ++i) acc[i] = 0.f;
#if BULK
    bar_wait(&bar, 0);
    const int lr0 = rg * RPT;  // the thread's first row within the block
#pragma unroll 2
    for (int chunk = kt; chunk < KC; chunk += KT) {
        uint4 wv[RPT];
        float scale[RPT];
#pragma unroll
        for (int r = 0; r < RPT; ++r) {  // rows past N hold stale words: never stored
            wv[r] = wsm[(lr0 + r) * KC + chunk];
            scale[r] = bf16_to_f32(ssm[(lr0 + r) * KC + chunk]);
        }
        chunk_dot<RPT, MR, STAGED>(wv, scale, xsrc, KC * 4, chunk, acc);
    }
#else
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
        const int chunk = kt + c * KT;
        if (chunk < KC) {
            if (c >= PF) {
#pragma unroll
                for (int r = 0; r < RPT; ++r) {
                    const int row = min(row0 + r, n - 1);
                    wr[c][r] = __ldcs(w + (long)row * KC + chunk);
                    sr[c][r] = bf16_to_f32(s[(long)row * KC + chunk]);
                }
            }
            chunk_dot<RPT, MR, STAGED>(wr[c], sr[c], xsrc, KC * 4, chunk, acc);
        }
    }
#endif
#pragma unroll
    for (int i = 0; i < RPT * MR; ++i) {
#pragma unroll
        for (int off = KT / 2; off > 0; off >>= 1)
            acc[i] += __shfl_xor_sync(0xFFFFFFFFu, acc[i], off, KT);
    }
    if (kt != 0) return;
#pragma unroll
    for (int m = 0; m < MR; ++m) {  // activation row m: output row m (N, or N / 2 wide)
#if EPI == 1
#pragma unroll
        for (int r = 0; r < RPT; r += 2) {  // rows row0 + r (gate), row0 + r + 1 (up): one output
            if (row0 + r + 1 < n) {
                const float g = round_bf16(acc[r * MR + m]);
                const float u = round_bf16(acc[(r + 1) * MR + m]);
                y[(long)m * (n / 2) + (row0 + r) / 2] = f32_to_bf16(round_bf16(gelu_tanh(g)) * u);
            }
        }
#else
#pragma unroll
        for (int r = 0; r < RPT; ++r) {
            if (row0 + r < n) {
                const long at = (long)m * n + row0 + r;
#if EPI == 2
                const float g = round_bf16(gelu_tanh(round_bf16(acc[r * MR + m])));
                y[at] = f32_to_bf16(g * bf16_to_f32(aux[at]));
#else
                y[at] = f32_to_bf16(acc[r * MR + m]);
#endif
            }
        }
#endif
    }
}
