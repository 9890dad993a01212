// sage2 attention for Hopper (sm_90a) in CUDA C++: INT8 Q.K^T with s32 accumulation, then P.V either in FP8 e4m3
// with two-level fp32 accumulation or in fp16 with fp32 accumulation, on the staging of
// `flash_catalog.kernels.sage2_quant.quantize_qkv` (block_m 64, block_n 128; pv="fp8": V^T keys in this kernel's
// MMA order, `v_mma_order=True`; pv="fp16": V's padded fp16 copy, `v_fp16=True`).
//
// One CTA: 64 * NC query rows of one (batch, head), NC = 3 consumer warpgroups of 64 rows and a producer
// warpgroup (one thread issues the TMA loads of the staged Q tiles and of a ring of K / V^T tiles, completing on
// mbarriers; setmaxnreg gives its registers to the consumers). Where the caller hands Q over as it is (`q_raw`),
// each consumer quantises its own 64 rows into shared memory instead (quantize_q_tile), and the staging has no Q
// pass. A consumer runs, per 128-key block: the INT8 Q.K^T wgmma (s32), the online softmax, the FP8 P.V wgmma into
// a fresh fp32 block, then O = O * alpha + block:
// the FP8 MMA's own accumulator is reduced-precision, so it never carries more than one key block (two-level
// accumulation). Three consumers share the tensor cores, so one's softmax can run under the others' MMAs; two
// consumers with 240 registers each, taking turns at the tensor cores FA3-style, measured slower, and a
// warpgroup overlapping its own softmax with its P.V needs a second accumulator in flight, which spilled.
//
// The exponentials (MUFU) and the packing share the XU pipe, which the three softmaxes would otherwise hit at once,
// leaving the tensor cores idle while they do: a token passed round the consumers on named barriers keeps their
// softmaxes apart. ptxas moves register-only instructions across bar.sync and bar.arrive, so where the token sits
// is ptxas's choice unless pinned. In the FP8 build it waits inside the row maxima and signals after the first
// exponentials; that measured faster than the token over all the exponentials (a lone warp's exponentials are
// latency-bound) and than no token. fp16 pins that shape: a barrier id that depends on values orders them before
// the barrier, and values that start from a shared load after it come after it.
//
// fp16 P.V (PV16): P leaves as fp16 pairs, whose A-register layout is the score layout itself, and V (keys x D,
// D contiguous) is the MN-major B operand; O is rescaled, then the fp16 wgmma accumulates into it in place (fp32).
// fp16 has headroom above P's 448, so a row keeps its max until a block beats it by kLazyMaxLog2; a warp whose rows
// all kept theirs skips O's rescale (64 multiplies a thread on the consumer's critical path).
//
// P leaves the FP8 softmax as e4m3 packed straight from the score registers into the A-operand registers of the
// FP8 wgmma. The score layout (thread holds keys 8a+2t+{0,1}) and the A layout (thread holds k 4t..4t+3 and
// 16+4t..) differ; rather than shuffling bytes, the quantiser stores V^T's keys permuted within every 32 so that
// MMA k-index 16*(a>>1) + 4t + 2*(a&1) + b holds key 8a + 2t + b (sum over k is order-free).
//
// Exposed to Python through ctypes (no torch headers): fc_sage2_sm90() launches on a given stream and
// returns 0, or an error code with fc_sage2_sm90_error() saying what.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <stdint.h>
#include <stdio.h>
#include <climits>
#include <mutex>

namespace {

constexpr int kBlockN = 128;       // keys per block
constexpr float kLog2PScale = 8.807354922057604f;  // log2(448): P is scaled into e4m3's range
constexpr int kMagicInt = 0x4B400000;               // bits of 1.5 * 2^23: int -> float with an add
constexpr float kMagicFloat = 12582912.0f;
// fp16 P.V: a row's running max is raised only when a block's max exceeds it by more than this (log2 units), so P
// stays below 448 * 2^7 = 57344 (fp16's largest finite value is 65504) and O's rescale is rarely needed
constexpr float kLazyMaxLog2 = 7.0f;
// D64 turns the integer scores into floats with I2F instead of the magic-number add: faster there on an H100, not
// at D128's long sequences (BENCHMARKS.md, forty-first session).
template <int D>
constexpr bool kScoresI2F = D == 64;

// ------------------------------------------------------------------------------------------------------------------
// PTX wrappers
// ------------------------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Programmatic dependent launch: grid_wait returns once the grids this one depends on have finished and their
// writes are visible (at once where it was launched without the attribute); grid_launch_dependents lets the next
// such grid on the stream start before this one ends.
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void grid_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void tma_load_3d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                            int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// A bulk copy of `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared memory,
// completing on `bar` (its transaction count raised by the caller's expect_tx).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}

// Registers an asynchronous wgmma writes or reads: the empty asm pins them in place around issue and wait, so the
// compiler neither reads them early nor reuses them while the tensor cores still own them.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(int32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Shared-memory matrix descriptor of a K-major tile whose rows are `row_bytes` (64 or 128) long, swizzled by the
// TMA load with the same width; 8-row groups are 8 * row_bytes apart.
__device__ __forceinline__ uint64_t smem_desc(const void* tile, int row_bytes) {
  const uint32_t addr = smem_u32(tile);
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= uint64_t(1) << 16;                              // leading byte offset: unused by swizzled K-major
  desc |= uint64_t((8 * row_bytes) >> 4) << 32;           // stride byte offset
  desc |= uint64_t(row_bytes == 128 ? 1 : 2) << 62;       // 128B or 64B swizzle
  return desc;
}

// Shared-memory matrix descriptor of an MN-major 16-bit tile (V: keys x D, D contiguous) loaded by TMA in boxes of
// 128 keys x 64 values (128-byte rows, 128B swizzle): 8-key groups are 1024 bytes apart (stride byte offset), the
// next 64 values of D a whole box, 128 * 128 bytes, on (leading byte offset).
__device__ __forceinline__ uint64_t smem_desc_mn16(const void* tile) {
  const uint32_t addr = smem_u32(tile);
  uint64_t desc = (addr & 0x3FFFF) >> 4;
  desc |= uint64_t((kBlockN * 128) >> 4) << 16;
  desc |= uint64_t(1024 >> 4) << 32;
  desc |= uint64_t(1) << 62;
  return desc;
}

// Named barriers 1..3 (0 is __syncthreads): the exponential token; 4..6 are each consumer's own (consumer_sync).
// bar.sync waits for the previous consumer's bar.arrive (128 + 128 threads); a ring of three cannot arrive twice
// before its successor has synced.
__device__ __forceinline__ void bar_sync_256(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id) : "memory"); }
__device__ __forceinline__ void bar_arrive_256(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id) : "memory"); }
// The 128 threads of consumer warpgroup `cw` alone (Q's quantisation, the epilogue's staging of the output).
__device__ __forceinline__ void consumer_sync(int cw) {
  asm volatile("bar.sync %0, 128;" ::"r"(4 + cw) : "memory");
}

// Which named barrier a consumer waits on before its exponentials, which one it signals after, and whether it
// signals (the ring's last turn has no successor); for fp16 P.V, the shared-memory addresses of a 0.0f and an
// INT_MIN that pin the token's place in the schedule (see softmax_block).
struct Turn {
  int mine, next;
  bool pass;
  uint32_t zero_f32, int_min;
};

__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float x;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(x) : "r"(addr) : "memory");
  return x;
}
__device__ __forceinline__ int ld_shared_s32(uint32_t addr) {
  int x;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(x) : "r"(addr) : "memory");
  return x;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two fp32 values to e4m3 (round to nearest even, saturating), `lo` in the low byte.
__device__ __forceinline__ uint32_t pack_e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two fp32 values to an fp16 pair (round to nearest even), `lo` in the low half.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Operand lists of the wgmma wrappers: the accumulator registers d[i..] under constraint C ("=r"/"=f" when the
// MMA overwrites them, "+r"/"+f" when it accumulates), and their names in the instruction text.
#define FC_D8(C, i) C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define FC_D32(C, i) FC_D8(C, i), FC_D8(C, i + 8), FC_D8(C, i + 16), FC_D8(C, i + 24)
#define FC_D32_0(C) FC_D32(C, 0)
#define FC_D64(C) FC_D32(C, 0), FC_D32(C, 32)
#define FC_R32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define FC_R64 FC_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
// scale-d: 0 overwrites D, 1 accumulates into it
#define FC_SCALE_D(ACC) "{\n.reg .pred p;\nsetp.ne.b32 p, " #ACC ", 0;\n"
#define FC_WGMMA_S8_N128(ACC, C)                                                                                   \
  asm volatile(FC_SCALE_D(ACC) "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 {" FC_R64 "}, %64, %65, p;\n}\n" \
               : FC_D64(C)                                                                                        \
               : "l"(desc_a), "l"(desc_b))
#define FC_WGMMA_E4M3(N, ACC, C, REGS, DEST, A0, B)                                                               \
  asm volatile(FC_SCALE_D(ACC) "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 {" REGS "}, {" A0       \
               "}, " B ", p, 1, 1;\n}\n"                                                                          \
               : DEST(C)                                                                                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))
// accumulates (scale-d 1); the final 1 transposes B: V is MN-major
#define FC_WGMMA_F16(N, REGS, DEST, A0, B)                                                                        \
  asm volatile(FC_SCALE_D(1) "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" REGS "}, {" A0 "}, " B    \
               ", p, 1, 1, 1;\n}\n"                                                                               \
               : DEST("+f")                                                                                       \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b))

// D(64 x 128, s32) (+)= A(64 x 32, s8, smem) . B(128 x 32, s8, smem)^T, both K-major; ACC: accumulate into D.
template <bool ACC>
__device__ __forceinline__ void wgmma_s8_m64n128k32(int32_t (&d)[64], uint64_t desc_a, uint64_t desc_b) {
  if constexpr (ACC) {
    FC_WGMMA_S8_N128(1, "+r");
  } else {
    FC_WGMMA_S8_N128(0, "=r");
  }
}

// D(64 x N, f32) (+)= A(64 x 32, e4m3, registers) . B(N x 32, e4m3, smem)^T, B K-major; N = 128 or 64.
template <int N, bool ACC>
__device__ __forceinline__ void wgmma_e4m3_m64k32(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (N == 128 && ACC) {
    FC_WGMMA_E4M3(128, 1, "+f", FC_R64, FC_D64, "%64, %65, %66, %67", "%68");
  } else if constexpr (N == 128) {
    FC_WGMMA_E4M3(128, 0, "=f", FC_R64, FC_D64, "%64, %65, %66, %67", "%68");
  } else if constexpr (ACC) {
    FC_WGMMA_E4M3(64, 1, "+f", FC_R32, FC_D32_0, "%32, %33, %34, %35", "%36");
  } else {
    FC_WGMMA_E4M3(64, 0, "=f", FC_R32, FC_D32_0, "%32, %33, %34, %35", "%36");
  }
}

// D(64 x N, f32) += A(64 x 16, f16, registers) . B(16 x N, f16, smem, MN-major); N = 128 or 64.
template <int N>
__device__ __forceinline__ void wgmma_f16_m64k16(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc_b) {
  if constexpr (N == 128) {
    FC_WGMMA_F16(128, FC_R64, FC_D64, "%64, %65, %66, %67", "%68");
  } else {
    FC_WGMMA_F16(64, FC_R32, FC_D32_0, "%32, %33, %34, %35", "%36");
  }
}

// ------------------------------------------------------------------------------------------------------------------
// The kernel
// ------------------------------------------------------------------------------------------------------------------

struct Params {
  const float* q_scale;  // (B*Hq, n_qb): per 64-row tile, softmax scale * log2(e) folded in
  const float* k_scale;  // (B*Hkv, n_kb): per 128-key tile
  // FP8 P.V: (B*Hkv, D), per channel, amax / 448; or with VBLK (the staging's v_block_scale) (B*Hkv, n_kb), per
  // 128-key block. Null for fp16 P.V.
  const float* v_scale;
  void* out;             // (B, Hq, Sq, D), unit stride along D
  float* lse;            // (B, Hq, Sq) natural log-sum-exp of the scores seen (K less its mean), or null
  long long stride_ob, stride_oh, stride_os;
  int hq, hkv, sq, skv, n_qb, n_kb, out_bf16;
  // Work split: tile t (of n_tiles = n_mb * B * Hq, m-block fastest) runs whole for t < n_full; each later tile runs
  // as n_split CTAs over consecutive ranges of its key blocks, which write their normalised partial output
  // (part_o, fp32, kRows x D per CTA) and log2-domain log-sum-exp (part_lse) for combine_kernel to merge. That
  // shortens the last wave where the tiles do not fill the GPU's SMs evenly. n_split = 1: no split.
  int n_mb, n_tiles, n_full, n_split;
  float* part_o;
  float* part_lse;
  // Q quantised in the kernel (q_raw not null): the caller's fp16/bf16 Q, unit stride along D, strides in elements;
  // each consumer warpgroup turns its 64 rows into INT8 with one scale, as the staging would, and q_scale is unused.
  const void* q_raw;
  long long stride_qb, stride_qh, stride_qs;
  int q_bf16;
  float q_scale_mult;  // softmax scale * log2(e), folded into the tile's scale
  // Launched as a programmatic dependent of the kernel before it on the stream (the staging's K/V pass): its CTAs
  // may start while that one ends, and wait (grid_wait) before reading anything it writes.
  int pdl;
};

template <int D, int NC, int STAGES, bool PV16>
struct SharedStorage {
  alignas(1024) int8_t q[64 * NC * D];
  alignas(1024) int8_t k[STAGES][kBlockN * D];
  // FP8: V^T tiles, D rows of 128 keys; fp16: V tiles, D / 64 boxes of 128 keys x 64 values
  alignas(1024) uint8_t v[STAGES][D * kBlockN * (PV16 ? 2 : 1)];
  uint64_t full[STAGES];
  uint64_t empty[STAGES];
  uint64_t q_full;
  uint64_t vs_full;  // FP8 P.V: V's per-channel scales of the CTA's head, in v_scale below
  alignas(16) float v_scale[D];
  // VBLK: the stage's K scale and V's scale ratio (the previous block's over this one's, 1 for the first), put there
  // by the producer with its loads
  float2 blk_scale[STAGES];
  float q_amax[NC][4];  // Q quantised in the kernel: each consumer warp's max|q|
  float zero_f32;  // 0.0f and INT_MIN, read after the token's barriers (Turn)
  int int_min;
  float v_last;  // VBLK: the last block's V scale, which the epilogue multiplies by (put there with its loads)
};

// Online softmax of one 64 x 128 score block held as the wgmma accumulator (thread: rows r0, r0 + 8; keys
// 8*j + 2t + {0, 1} for j < 16). Scores are exact int32 dot products; `c` = q_scale * k_scale turns them into the
// log2 domain. P leaves scaled by 448 (PV16: up to 448 * 2^kLazyMaxLog2 against a kept max), as e4m3 in the FP8
// wgmma's A-register order or (PV16) as fp16 pairs in the score order, which is the fp16 wgmma's A-register order;
// `l` gets this thread's part of the row sums of the fp32 P (the quad's parts are added at the end); `alpha`
// rescales the rows' earlier sums. The token: wait on `turn.mine` (fp16: before the maxima), signal `turn.next`
// (fp16: after P's first two words); see the top of the file. MASKED: keys >= skv, and keys past the row when
// causal, take no softmax mass. I2F: the scores become floats by I2F rather than by the magic-number add.
template <bool MASKED, bool CAUSAL, bool PV16, bool I2F>
__device__ __forceinline__ void softmax_block(int32_t (&s)[64], float c, float (&m)[2], float (&l)[2],
                                              float (&alpha)[2], uint32_t (&p)[PV16 ? 32 : 16], int col0, int r0,
                                              int skv, Turn turn) {
  const int t = threadIdx.x & 3;
  if constexpr (MASKED) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = col0 + 8 * j + 2 * t + (i & 1);
        const int row = r0 + 8 * (i >> 1);
        const bool valid = col < skv && (!CAUSAL || col <= row);
        if (!valid) s[4 * j + i] = INT_MIN;
      }
    }
  }
  // fp16: the token is taken before the row maxima, which start from a shared load that follows the wait
  if constexpr (PV16) bar_sync_256(turn.mine);
  const int lowest = PV16 ? ld_shared_s32(turn.int_min) : INT_MIN;
  int mx[2] = {lowest, lowest};
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    mx[0] = max(mx[0], max(s[4 * j], s[4 * j + 1]));
    mx[1] = max(mx[1], max(s[4 * j + 2], s[4 * j + 3]));
  }
  float shift[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mx[h] = max(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
    mx[h] = max(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    const float block_max = mx[h] == INT_MIN ? -INFINITY : static_cast<float>(mx[h]) * c;
    float m_new = fmaxf(m[h], block_max);
    if constexpr (PV16) m_new = m_new > m[h] + kLazyMaxLog2 ? m_new : m[h];  // -inf + 7 is -inf: the first block sets it
    const bool none = m_new == -INFINITY;  // no key of this row seen yet (not reachable: key 0 is in block 0)
    alpha[h] = none || (PV16 && m_new == m[h]) ? 1.0f : ex2(m[h] - m_new);
    m[h] = m_new;
    shift[h] = none ? 0.0f : m_new - kLog2PScale;
  }
  // x = score * c - shift in one FFMA on the score as a float (I2F) or on the magic-biased float: the bias's share,
  // kMagicFloat * c, is then folded into the offset, whose rounding (half an ulp of ~1.3e7 * c) shifts a whole row
  // block's P and sum alike
  float offset[2] = {shift[0], shift[1]};
  if constexpr (!I2F) {
    offset[0] = fmaf(kMagicFloat, c, shift[0]);
    offset[1] = fmaf(kMagicFloat, c, shift[1]);
  }
  if constexpr (!PV16) {
    bar_sync_256(turn.mine);
    fence_regs(s);  // nothing of the exponentials is hoisted above the wait
  }
  float sum[2] = {0.0f, 0.0f};
  // P for key j (of 16 groups of 8) and row half h, as two e4m3 bytes or an fp16 pair
  auto pair = [&](int j, int h) -> uint32_t {
    float e[2];
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int32_t v = s[4 * j + 2 * h + b];
      const float sv = I2F ? static_cast<float>(v) : __int_as_float(v + kMagicInt);
      const float x = (MASKED && v == INT_MIN) ? -INFINITY : fmaf(sv, c, -offset[h]);
      e[b] = ex2(x);
    }
    sum[h] += e[0] + e[1];
    return PV16 ? pack_f16x2(e[0], e[1]) : pack_e4m3x2(e[0], e[1]);
  };
  if constexpr (PV16) {
    // the token moves on after P's first two words: the signal's barrier id depends on them (their sign bits are
    // 0), and the other exponentials start from a shared load that follows it
    p[0] = pair(0, 0);
    p[1] = pair(0, 1);
    if (turn.pass) bar_arrive_256(turn.next + static_cast<int>((p[0] | p[1]) >> 31));
    const float zero = ld_shared_f32(turn.zero_f32);
    offset[0] += zero;
    offset[1] += zero;
#pragma unroll
    for (int j = 1; j < 16; ++j) {
      p[2 * j] = pair(j, 0);
      p[2 * j + 1] = pair(j, 1);
    }
  } else {
#pragma unroll
    for (int kc = 0; kc < 4; ++kc) {
      p[4 * kc + 0] = pair(4 * kc + 0, 0) | (pair(4 * kc + 1, 0) << 16);
      p[4 * kc + 1] = pair(4 * kc + 0, 1) | (pair(4 * kc + 1, 1) << 16);
      p[4 * kc + 2] = pair(4 * kc + 2, 0) | (pair(4 * kc + 3, 0) << 16);
      p[4 * kc + 3] = pair(4 * kc + 2, 1) | (pair(4 * kc + 3, 1) << 16);
    }
  }
  if (!PV16 && turn.pass) {
    fence_regs(p);  // every exponential is done before the token moves on
    bar_arrive_256(turn.next);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + sum[h];
}

template <int D>
__device__ __forceinline__ void qk_block(int32_t (&s)[64], uint64_t desc_q, uint64_t desc_k) {
  wgmma_s8_m64n128k32<false>(s, desc_q, desc_k);
#pragma unroll
  for (int kk = 1; kk < D / 32; ++kk) wgmma_s8_m64n128k32<true>(s, desc_q + 2 * kk, desc_k + 2 * kk);
}

// FP8 P.V over one 128-key block into a fresh fp32 accumulator.
template <int D>
__device__ __forceinline__ void pv_block(float (&o)[D / 2], const uint32_t (&p)[16], uint64_t desc_v) {
#pragma unroll
  for (int kc = 0; kc < 4; ++kc) {
    const uint32_t a[4] = {p[4 * kc], p[4 * kc + 1], p[4 * kc + 2], p[4 * kc + 3]};
    if (kc == 0) {
      wgmma_e4m3_m64k32<D, false>(o, a, desc_v);
    } else {
      wgmma_e4m3_m64k32<D, true>(o, a, desc_v + 2 * kc);
    }
  }
}

// fp16 P.V over one 128-key block, accumulated into o: 16 keys per MMA, 16 rows of 128 bytes further on in V.
template <int D>
__device__ __forceinline__ void pv16_block(float (&o)[D / 2], const uint32_t (&p)[32], uint64_t desc_v) {
#pragma unroll
  for (int kc = 0; kc < 8; ++kc) {
    const uint32_t a[4] = {p[4 * kc], p[4 * kc + 1], p[4 * kc + 2], p[4 * kc + 3]};
    wgmma_f16_m64k16<D>(o, a, desc_v + kc * ((16 * 128) >> 4));
  }
}

// Q's 64 rows [row0, row0 + 64) of (b, h) as INT8 in `tile` (64 x D bytes, laid out and swizzled as the TMA load of
// the staged Q lays it: rows of D bytes, 16-byte chunk c of a row at c ^ address bits 7.. (128B swizzle at D128,
// 64B at D64)), with the staging's arithmetic: one scale for the tile, amax / 127 (max|q| at least 1e-30), codes
// round(q * (127 / amax)) half away from zero, rows past sq zero. Called by all 128 threads of consumer warpgroup
// `cw`, which it synchronises on named barrier 4 + cw; returns the tile's scale with q_scale_mult folded in.
template <int D>
__device__ __forceinline__ float quantize_q_tile(const Params& prm, int8_t* tile, float (&warp_amax)[4], int b, int h,
                                                 int row0, int tid, int cw) {
  constexpr int kChunks = D / 8;             // 16-byte chunks (8 values) per row
  constexpr int kPer = 64 * kChunks / 128;   // chunks per thread
  const char* base = static_cast<const char*>(prm.q_raw) +
                     (static_cast<long long>(b) * prm.stride_qb + static_cast<long long>(h) * prm.stride_qh) * 2;
  float x[kPer][8];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = tid + 128 * i;
    const int row = row0 + c / kChunks;
    uint4 raw = make_uint4(0u, 0u, 0u, 0u);
    if (row < prm.sq)
      raw = __ldg(reinterpret_cast<const uint4*>(base + (static_cast<long long>(row) * prm.stride_qs +
                                                         (c % kChunks) * 8) * 2));
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      float2 f;
      if (prm.q_bf16) {
        f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[w]));
      } else {
        f = __half22float2(*reinterpret_cast<const __half2*>(&words[w]));
      }
      x[i][2 * w] = f.x;
      x[i][2 * w + 1] = f.y;
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if (tid % 32 == 0) warp_amax[tid / 32] = amax;
  consumer_sync(cw);
  amax = fmaxf(fmaxf(fmaxf(warp_amax[0], warp_amax[1]), fmaxf(warp_amax[2], warp_amax[3])), 1e-30f);
  const float inv = __fdiv_rn(127.0f, amax);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int c = tid + 128 * i;
    uint32_t packed[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float y = __fmul_rn(x[i][e], inv);
      const int code = __float2int_rz(__fadd_rn(y, y >= 0.0f ? 0.5f : -0.5f));
      packed[e / 4] |= (static_cast<uint32_t>(code) & 0xFFu) << (8 * (e % 4));
    }
    const uint32_t off = static_cast<uint32_t>((c / kChunks) * D + (c % kChunks) * 8);
    const uint32_t swizzled = off ^ (((off >> 7) & (D == 128 ? 7u : 3u)) << 4);
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(smem_u32(tile + swizzled)), "r"(packed[0]),
                 "r"(packed[1]) : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the writes, visible to the wgmma's reads
  consumer_sync(cw);
  return __fmul_rn(__fdiv_rn(amax, 127.0f), prm.q_scale_mult);
}

// VBLK (FP8 P.V): V's scale is one per key block, s_j. O is then carried divided by the last block's scale: O' =
// O' * alpha * s_{j-1} / s_j + block, one multiply per row and block where a per-element multiply by s_j would
// otherwise come, and the epilogue multiplies by the last s_j where it multiplied by V's per-channel scales.
template <int D, int NC, int STAGES, bool CAUSAL, bool PV16, bool VBLK>
__global__ void __launch_bounds__(128 * (NC + 1), 1)
    sage2_sm90_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v, const Params prm) {
  constexpr int kRows = 64 * NC;  // query rows of one CTA
  extern __shared__ uint8_t smem_raw[];
  using Smem = SharedStorage<D, NC, STAGES, PV16>;
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));

  const int cta = static_cast<int>(blockIdx.x);
  const bool split = cta >= prm.n_full;
  const int tile = split ? prm.n_full + (cta - prm.n_full) / prm.n_split : cta;
  const int part = split ? (cta - prm.n_full) % prm.n_split : 0;
  const int mb = tile % prm.n_mb;
  const int m_block = CAUSAL ? prm.n_mb - 1 - mb : mb;  // causal: a head's longest rows first
  const int bh = tile / prm.n_mb;
  const int b = bh / prm.hq;
  const int h = bh % prm.hq;
  const int bhk = b * prm.hkv + h / (prm.hq / prm.hkv);
  const int m_base = m_block * kRows;
  int n_kv = (prm.skv + kBlockN - 1) / kBlockN;
  if constexpr (CAUSAL) n_kv = min(n_kv, (min(m_base + kRows, prm.sq) - 1) / kBlockN + 1);
  // this CTA's key blocks [j0, j0 + n_loc): all of them, or its part's share (the host splits non-causal tiles only)
  const int j0 = split ? part * n_kv / prm.n_split : 0;
  const int n_loc = (split ? (part + 1) * n_kv / prm.n_split : n_kv) - j0;

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    grid_launch_dependents();  // the combine kernel may be placed as SMs free up; it waits for this grid
#pragma unroll
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(&sm.full[i], 1);
      mbar_init(&sm.empty[i], 4 * NC);  // lane 0 of each consumer warp
    }
    mbar_init(&sm.q_full, 1);
    mbar_init(&sm.vs_full, 1);
    if constexpr (PV16) {
      sm.zero_f32 = 0.0f;
      sm.int_min = INT_MIN;
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {  // producer: one thread issues every TMA load
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (threadIdx.x == 0) {
      grid_wait();  // the staging's outputs: nothing it writes is read before this
      if constexpr (!PV16 && !VBLK) {  // the epilogue's scales, in shared memory long before it needs them
        mbar_expect_tx(&sm.vs_full, D * 4);
        bulk_load(sm.v_scale, prm.v_scale + static_cast<long long>(bhk) * D, D * 4, &sm.vs_full);
      }
      if (prm.q_raw == nullptr) {  // staged Q; else the consumers quantise it themselves
        mbar_expect_tx(&sm.q_full, kRows * D);
#pragma unroll
        for (int i = 0; i < NC; ++i) tma_load_3d(sm.q + i * 64 * D, &tm_q, &sm.q_full, 0, m_base + 64 * i, bh);
      }
      float vs_prev = 1.0f;  // VBLK: the previous block's V scale
      for (int jj = 0; jj < n_loc; ++jj) {
        const int j = j0 + jj;
        const int slot = jj % STAGES;
        mbar_wait(&sm.empty[slot], ((jj / STAGES) & 1) ^ 1);
        if constexpr (VBLK) {  // the block's scales travel with it
          const long long at = static_cast<long long>(bhk) * prm.n_kb + j;
          const float vs = prm.v_scale[at];
          sm.blk_scale[slot] = make_float2(prm.k_scale[at], jj == 0 ? 1.0f : __fdividef(vs_prev, vs));
          vs_prev = vs;
          if (jj == n_loc - 1) sm.v_last = vs;
        }
        mbar_expect_tx(&sm.full[slot], (PV16 ? 3 : 2) * kBlockN * D);  // its arrive publishes blk_scale
        tma_load_3d(sm.k[slot], &tm_k, &sm.full[slot], 0, j * kBlockN, bhk);
        if constexpr (PV16) {  // byte columns [128 i, 128 i + 128) of V's 2D-byte rows: 64 values of D each
#pragma unroll
          for (int i = 0; i < D / 64; ++i)
            tma_load_3d(sm.v[slot] + i * kBlockN * 128, &tm_v, &sm.full[slot], 128 * i, j * kBlockN, bhk);
        } else {
          tma_load_3d(sm.v[slot], &tm_v, &sm.full[slot], j * kBlockN, 0, bhk);
        }
      }
    }
    return;
  }
  static_assert(NC == 3, "the register split below is for three consumer warpgroups and a producer");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 160;\n" ::: "memory");

  const int cw = wg - 1;  // this consumer's 64 rows start at m_base + 64 * cw
  const int tid = threadIdx.x % 128;
  const int lane = tid % 32;
  const int r0 = m_base + cw * 64 + (tid / 32) * 16 + lane / 4;
  // Q as the caller passed it is no output of the staging: quantised before the wait, while the staging may still run
  float q_scale = prm.q_raw != nullptr
                      ? quantize_q_tile<D>(prm, sm.q + cw * 64 * D, sm.q_amax[cw], b, h, m_base + cw * 64, tid, cw)
                      : 0.0f;
  grid_wait();  // staged Q's scale is the staging's output
  if (prm.q_raw == nullptr)
    q_scale = prm.q_scale[static_cast<long long>(bh) * prm.n_qb + min(m_block * NC + cw, prm.n_qb - 1)];
  const float* k_scale = prm.k_scale + static_cast<long long>(bhk) * prm.n_kb;
  const uint64_t desc_q = smem_desc(sm.q + cw * 64 * D, D);
  // blocks [0, n_plain) need no mask: every key exists and, when causal, lies at or before this warpgroup's rows
  const int n_plain = CAUSAL ? min(prm.skv / kBlockN, (m_base + cw * 64 + 1) / kBlockN) : prm.skv / kBlockN;

  float o[D / 2];
  float ob[PV16 ? 1 : D / 2];  // one key block's FP8 P.V
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  int32_t s[64];
  uint32_t p[PV16 ? 32 : 16];
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  float alpha[2];

  if (prm.q_raw == nullptr) mbar_wait(&sm.q_full, 0);
  // every consumer runs n_loc blocks, so the token's ring stays whole; the last consumer hands the first its first turn
  if (cw == NC - 1) bar_arrive_256(1);
  // Per key block: Q.K^T, the softmax, then FP8 P.V into a fresh fp32 block and O = O * alpha + block, or O *= alpha
  // and fp16 P.V into O. The other consumers' MMAs fill the tensor cores while this one runs its exponentials
  // (the token keeps the three softmaxes apart).
  for (int jj = 0; jj < n_loc; ++jj) {
    const int j = j0 + jj;
    const int slot = jj % STAGES;
    mbar_wait(&sm.full[slot], (jj / STAGES) & 1);
    // VBLK: the block's K scale, a shared load issued before the MMA it waits under (a plain C++ read compiles to a
    // generic load issued after the MMA's wait, on every block's path into the softmax)
    const float k_blk = VBLK ? ld_shared_f32(smem_u32(&sm.blk_scale[slot].x)) : 0.0f;
    wgmma_fence();
    qk_block<D>(s, desc_q, smem_desc(sm.k[slot], D));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
    const float c = q_scale * (VBLK ? k_blk : k_scale[j]);
    const Turn turn{1 + cw, 1 + (cw + 1) % NC, !(cw == NC - 1 && jj == n_loc - 1), smem_u32(&sm.zero_f32),
                    smem_u32(&sm.int_min)};
    if (j < n_plain) {
      softmax_block<false, CAUSAL, PV16, kScoresI2F<D>>(s, c, m, l, alpha, p, j * kBlockN, r0, prm.skv, turn);
    } else {
      softmax_block<true, CAUSAL, PV16, kScoresI2F<D>>(s, c, m, l, alpha, p, j * kBlockN, r0, prm.skv, turn);
    }
    fence_regs(p);
    if constexpr (PV16) {
      if (!__all_sync(0xffffffffu, alpha[0] == 1.0f && alpha[1] == 1.0f)) {  // warp-uniform
#pragma unroll
        for (int i = 0; i < D / 2; ++i) o[i] *= alpha[(i >> 1) & 1];
      }
      wgmma_fence();
      pv16_block<D>(o, p, smem_desc_mn16(sm.v[slot]));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      if (lane == 0) mbar_arrive(&sm.empty[slot]);
    } else {
      // VBLK: O' from the previous block's V scale to this one's, read before the stage's release and issued
      // before the P.V MMA so that its wait hides the load (not held through the softmax: registers are short there)
      const float ratio = VBLK ? ld_shared_f32(smem_u32(&sm.blk_scale[slot].y)) : 1.0f;
      wgmma_fence();
      pv_block<D>(ob, p, smem_desc(sm.v[slot], 128));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(ob);
      if constexpr (VBLK) {
        alpha[0] *= ratio;
        alpha[1] *= ratio;
      }
      if (lane == 0) mbar_arrive(&sm.empty[slot]);
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o[i] = fmaf(o[i], alpha[(i >> 1) & 1], ob[i]);
    }
  }

  // epilogue: the row sums are per thread so far (alpha is uniform across the quad that shares a row)
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 1);
    l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], 2);
  }
  // VBLK: O' back in V's units (put there before the last block)
  const float v_last = VBLK ? ld_shared_f32(smem_u32(&sm.v_last)) : 1.0f;
  const float inv_l[2] = {v_last / l[0], v_last / l[1]};
  // V's scales from shared memory (vs_full completed long ago): a global load between the output's stores would
  // wait for the store before it, and each such wait is a CTA's time with nothing else running on its SM
  const int t = lane & 3;
  if constexpr (!PV16 && !VBLK) mbar_wait(&sm.vs_full, 0);
  // this thread's scales of channels 8 j + 2 t + {0, 1}, read where used (a shared load's short wait; no registers
  // held across the epilogue)
  const auto scale_of = [&](int j) {
    float2 vs = make_float2(1.0f, 1.0f);
    if constexpr (!PV16 && !VBLK)
      asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(vs.x), "=f"(vs.y)
                   : "r"(smem_u32(sm.v_scale + 8 * j + 2 * t)));
    return vs;
  };
  if (split) {  // this part's rows, normalised, and their log2-domain log-sum-exp (P's 448 included)
    const long long unit = cta - prm.n_full;  // (tile - n_full) * n_split + part
    float* part_o = prm.part_o + unit * kRows * D;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = r0 + 8 * hh;
      if (row >= prm.sq) continue;
      const int local = row - m_base;
      if (t == 0) prm.part_lse[unit * kRows + local] = m[hh] + log2f(l[hh]);
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        const int d = 8 * j + 2 * t;
        const float2 vs = scale_of(j);
        *reinterpret_cast<float2*>(part_o + local * D + d) =
            make_float2(o[4 * j + 2 * hh] * vs.x * inv_l[hh], o[4 * j + 2 * hh + 1] * vs.y * inv_l[hh]);
      }
    }
    return;
  }
  if (prm.lse != nullptr && t == 0) {  // m is log2-domain, l carries P's 448: back to a natural log
    float* lse_bh = prm.lse + static_cast<long long>(bh) * prm.sq;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int row = r0 + 8 * hh;
      if (row < prm.sq) lse_bh[row] = (m[hh] + log2f(l[hh]) - kLog2PScale) * 0.6931471805599453f;
    }
  }
  // The output leaves through this consumer's Q tile (64 x D bytes, unused since its last Q.K^T) 32 rows at a time:
  // each thread puts its values in, swizzled (16-byte chunk c of a row at c ^ (row % 8): no bank conflicts), then
  // the warpgroup writes whole rows in 16-byte pieces (a warp's store covers two rows: every sector whole). Stored
  // straight from the score layout, a warp's 4-byte stores would each touch 8 rows in half sectors.
  uint8_t* const stage = reinterpret_cast<uint8_t*>(sm.q + cw * 64 * D);
  constexpr int kChunks = D / 8;  // 16-byte chunks (8 values) per output row
  const int prow = (tid / 32) * 8 + lane / 4;  // the thread's row in a pass: its warp's 8, its quad's one
  char* out_bh = static_cast<char*>(prm.out) +
                 (static_cast<long long>(b) * prm.stride_ob + static_cast<long long>(h) * prm.stride_oh) * 2;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {  // pass hh: the consumer's rows 16 w + r + 8 hh (warp w < 4, r < 8)
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const float2 vs = scale_of(j);
      const float x0 = o[4 * j + 2 * hh] * vs.x * inv_l[hh];
      const float x1 = o[4 * j + 2 * hh + 1] * vs.y * inv_l[hh];
      uint32_t packed;
      if (prm.out_bf16) {
        __nv_bfloat162 y = __floats2bfloat162_rn(x0, x1);
        packed = *reinterpret_cast<uint32_t*>(&y);
      } else {
        __half2 y = __floats2half2_rn(x0, x1);
        packed = *reinterpret_cast<uint32_t*>(&y);
      }
      const uint32_t at = prow * 2 * D + ((j ^ (prow & 7)) * 16) + 4 * t;
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(stage + at)), "r"(packed));
    }
    consumer_sync(cw);
#pragma unroll
    for (int i = 0; i < 32 * kChunks / 128; ++i) {
      const int c = tid + 128 * i;
      const int srow = c / kChunks, chunk = c % kChunks;
      const int row = m_base + cw * 64 + (srow / 8) * 16 + srow % 8 + 8 * hh;
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(smem_u32(stage + srow * 2 * D + ((chunk ^ (srow & 7)) * 16))));
      if (row < prm.sq)
        *reinterpret_cast<uint4*>(out_bh + static_cast<long long>(row) * prm.stride_os * 2 + chunk * 16) = v;
    }
    if (hh == 0) consumer_sync(cw);  // pass 1 overwrites the stage
  }
}

// The split tiles' parts merged, one warp per query row: each part's output weighted by 2^(its lse - the max),
// written as the unsplit kernel writes it (output, and the natural log-sum-exp where asked).
template <int D, int NC>
__global__ void __launch_bounds__(128) combine_kernel(const Params prm) {
  constexpr int kRows = 64 * NC;
  constexpr int kPer = D / 32;  // channels per lane
  const long long warp = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  grid_wait();  // the attention kernel's parts
  if (warp >= static_cast<long long>(prm.n_tiles - prm.n_full) * kRows) return;
  const int ti = static_cast<int>(warp / kRows);
  const int local = static_cast<int>(warp % kRows);
  const int tile = prm.n_full + ti;
  const int row = (tile % prm.n_mb) * kRows + local;
  if (row >= prm.sq) return;
  const int bh = tile / prm.n_mb;
  const long long unit0 = static_cast<long long>(ti) * prm.n_split;
  float top = -INFINITY;
  for (int p = 0; p < prm.n_split; ++p) top = fmaxf(top, prm.part_lse[(unit0 + p) * kRows + local]);
  float acc[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) acc[e] = 0.0f;
  float total = 0.0f;
  for (int p = 0; p < prm.n_split; ++p) {
    const float w = exp2f(prm.part_lse[(unit0 + p) * kRows + local] - top);
    total += w;
    const float* src = prm.part_o + ((unit0 + p) * kRows + local) * D + lane * kPer;
#pragma unroll
    for (int e = 0; e < kPer; ++e) acc[e] = fmaf(w, src[e], acc[e]);
  }
  const float inv = 1.0f / total;
  char* out_row = static_cast<char*>(prm.out) +
                  (static_cast<long long>(bh / prm.hq) * prm.stride_ob + static_cast<long long>(bh % prm.hq) *
                   prm.stride_oh + static_cast<long long>(row) * prm.stride_os) * 2;
#pragma unroll
  for (int e = 0; e < kPer; e += 2) {
    uint32_t packed;
    if (prm.out_bf16) {
      __nv_bfloat162 y = __floats2bfloat162_rn(acc[e] * inv, acc[e + 1] * inv);
      packed = *reinterpret_cast<uint32_t*>(&y);
    } else {
      __half2 y = __floats2half2_rn(acc[e] * inv, acc[e + 1] * inv);
      packed = *reinterpret_cast<uint32_t*>(&y);
    }
    *reinterpret_cast<uint32_t*>(out_row + (lane * kPer + e) * 2) = packed;
  }
  if (prm.lse != nullptr && lane == 0)
    prm.lse[static_cast<long long>(bh) * prm.sq + row] = (top + log2f(total) - kLog2PScale) * 0.6931471805599453f;
}

// ------------------------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------------------------

thread_local char g_error[512] = "";

int fail(int code, const char* what) {
  snprintf(g_error, sizeof(g_error), "%s", what);
  return code;
}

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) ==
            cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  return fn;
}

// A 3-D byte tensor (dim0 contiguous) read in boxes of box0 x box1 x 1, swizzled to the box's row width.
bool make_map(CUtensorMap* map, const void* base, uint64_t dim0, uint64_t dim1, uint64_t dim2, uint32_t box0,
              uint32_t box1) {
  const cuuint64_t dims[3] = {dim0, dim1, dim2};
  const cuuint64_t strides[2] = {dim0, dim0 * dim1};
  const cuuint32_t box[3] = {box0, box1, 1};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUtensorMapSwizzle swizzle = box0 == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
  return encode_fn()(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(base), dims, strides, box, elem,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int D, int NC, int STAGES, bool CAUSAL, bool PV16, bool VBLK>
int launch(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& prm, int batch,
           int sq_pad, cudaStream_t stream) {
  auto kernel = sage2_sm90_kernel<D, NC, STAGES, CAUSAL, PV16, VBLK>;
  const int smem = static_cast<int>(sizeof(SharedStorage<D, NC, STAGES, PV16>)) + 1024;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return fail(3, cudaGetErrorString(err));
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(prm.n_full + (prm.n_tiles - prm.n_full) * prm.n_split));
  cfg.blockDim = dim3(128 * (NC + 1));
  cfg.dynamicSmemBytes = static_cast<size_t>(smem);
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = prm.pdl ? 1 : 0;
  err = cudaLaunchKernelEx(&cfg, kernel, tq, tk, tv, prm);
  if (err != cudaSuccess) return fail(4, cudaGetErrorString(err));
  if (prm.n_full < prm.n_tiles) {
    const long long threads = static_cast<long long>(prm.n_tiles - prm.n_full) * 64 * NC * 32;
    cfg.gridDim = dim3(static_cast<unsigned>((threads + 127) / 128));
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = 0;
    err = cudaLaunchKernelEx(&cfg, combine_kernel<D, NC>, prm);
    if (err != cudaSuccess) return fail(4, cudaGetErrorString(err));
  }
  return 0;
}

template <int D, int NC, int STAGES, bool PV16, bool VBLK>
int launch_causal(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& prm,
                  int batch, int sq_pad, int causal, cudaStream_t stream) {
  return causal ? launch<D, NC, STAGES, true, PV16, VBLK>(tq, tk, tv, prm, batch, sq_pad, stream)
                : launch<D, NC, STAGES, false, PV16, VBLK>(tq, tk, tv, prm, batch, sq_pad, stream);
}

template <int D, int NC, int STAGES>
int launch_pv(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& prm, int batch,
              int sq_pad, int causal, int pv_fp16, int v_block_scale, cudaStream_t stream) {
  if (pv_fp16) return launch_causal<D, NC, STAGES, true, false>(tq, tk, tv, prm, batch, sq_pad, causal, stream);
  return v_block_scale ? launch_causal<D, NC, STAGES, false, true>(tq, tk, tv, prm, batch, sq_pad, causal, stream)
                       : launch_causal<D, NC, STAGES, false, false>(tq, tk, tv, prm, batch, sq_pad, causal, stream);
}

}  // namespace

extern "C" {

const char* fc_sage2_sm90_error() { return g_error; }

// Attention on quantize_qkv staging (block_m=64, block_n=128): q8 (B, Hq, sq_pad, D) int8, k8 (B, Hkv, skv_pad, D)
// int8, and v: with pv_fp16 = 0 (pv="fp8", v_mma_order=True) V^T (B, Hkv, D, skv_pad) e4m3 with v_scale
// (B, Hkv, D), with pv_fp16 = 1 (pv="fp16", v_fp16=True) V (B, Hkv, skv_pad, D) fp16 and no v_scale (null); all
// contiguous; out (B, Hq, sq, D) fp16 or bf16 with unit stride along D; lse, where not null, (B, Hq, sq) float32
// gets each row's natural log-sum-exp of the scaled scores against K less its token mean (the caller adds
// scale * q . mean(K) back). n_full, n_split: the work split (see Params; n_full = the tile count and n_split = 1
// for none; non-causal only), part_o ((tiles - n_full) * n_split, 192, D) and part_lse ((tiles - n_full) * n_split,
// 192) float32 its scratch, null without a split; tiles = ceil(sq_pad / 192) * batch * hq.
// q_raw, where not null, is the caller's Q itself ((B, Hq, sq, D) fp16 (q_bf16 = 0) or bf16 (1) with element
// strides stride_qb, stride_qh, stride_qs and unit stride along D, 16-byte aligned rows): the kernel quantises it as
// the staging would, with q_scale_mult (softmax scale * log2(e)) folded into the scales; q8 and q_scale are then
// unused (null). These come last so that callers of builds without them keep their argument order. pdl != 0:
// launch as a programmatic dependent of the stream's previous kernel, which must write nothing of Q as passed
// (q_raw is read before the wait); the staging's K/V pass does not. v_block_scale != 0 (FP8 P.V): v_scale is
// (B, Hkv, skv_pad / 128), V's scale per key block (quantize_qkv(..., v_block_scale=True)).
// Returns 0, or a nonzero code with fc_sage2_sm90_error() saying why.
int fc_sage2_sm90(const void* q8, const void* k8, const void* v, const float* q_scale, const float* k_scale,
                  const float* v_scale, void* out, float* lse, int out_bf16, int batch, int hq, int hkv, int sq,
                  int sq_pad, int skv, int skv_pad, int head_dim, long long stride_ob, long long stride_oh,
                  long long stride_os, int causal, int pv_fp16, int n_full, int n_split, float* part_o,
                  float* part_lse, void* stream, const void* q_raw, long long stride_qb, long long stride_qh,
                  long long stride_qs, int q_bf16, float q_scale_mult, int pdl, int v_block_scale) {
  if (head_dim != 64 && head_dim != 128) return fail(1, "head_dim must be 64 or 128");
  if (hkv <= 0 || hq % hkv != 0) return fail(1, "query heads must be a multiple of key/value heads");
  if (sq <= 0 || skv <= 0 || sq_pad % 64 != 0 || skv_pad % kBlockN != 0 || sq_pad < sq || skv_pad < skv)
    return fail(1, "sequence lengths or their padding are invalid (sq_pad: multiple of 64, skv_pad: of 128)");
  if (batch * hq > 65535) return fail(1, "batch x heads exceeds 65535");
  if ((v_scale == nullptr) != (pv_fp16 != 0)) return fail(1, "v_scale is for FP8 P.V only: pass it exactly then");
  if (v_block_scale && pv_fp16) return fail(1, "v_block_scale is for FP8 P.V only");
  constexpr int kConsumers = 3;  // two measured 10-20% slower on the H200, also taking turns FA3-style
  const int n_mb = (sq_pad + 64 * kConsumers - 1) / (64 * kConsumers);
  const long long n_tiles = static_cast<long long>(n_mb) * batch * hq;
  const long long n_kv = (skv + kBlockN - 1) / kBlockN;
  const bool splits = n_full < n_tiles;
  if (n_full < 0 || n_full > n_tiles || n_split < 1 || (splits && (n_split < 2 || n_split > n_kv || causal ||
      part_o == nullptr || part_lse == nullptr)) || n_full + (n_tiles - n_full) * n_split > INT_MAX)
    return fail(1, "the work split is invalid (0 <= n_full <= tiles; for the rest 2 <= n_split <= key blocks, "
                   "non-causal, with part_o and part_lse)");
  if (q_raw != nullptr && ((reinterpret_cast<uintptr_t>(q_raw) | uintptr_t(stride_qb * 2) |
                            uintptr_t(stride_qh * 2) | uintptr_t(stride_qs * 2)) % 16 != 0))
    return fail(1, "q_raw: its pointer and its strides in bytes must be multiples of 16");
  if (q_raw == nullptr && (q8 == nullptr || q_scale == nullptr)) return fail(1, "pass q8 and q_scale, or q_raw");
  if ((reinterpret_cast<uintptr_t>(out) | uintptr_t(stride_ob * 2) | uintptr_t(stride_oh * 2) |
       uintptr_t(stride_os * 2)) % 16 != 0)
    return fail(1, "out: its pointer and its strides in bytes must be multiples of 16");
  if (encode_fn() == nullptr) return fail(2, "the driver offers no cuTensorMapEncodeTiled (CUDA 12+ driver needed)");
  CUtensorMap tq{}, tk, tv;  // tq: unused where the kernel quantises Q itself
  const uint64_t d = static_cast<uint64_t>(head_dim);
  if ((q_raw == nullptr && !make_map(&tq, q8, d, sq_pad, uint64_t(batch) * hq, head_dim, 64)) ||
      !make_map(&tk, k8, d, skv_pad, uint64_t(batch) * hkv, head_dim, kBlockN) ||
      !(pv_fp16 ? make_map(&tv, v, 2 * d, skv_pad, uint64_t(batch) * hkv, 128, kBlockN)
                : make_map(&tv, v, skv_pad, d, uint64_t(batch) * hkv, kBlockN, head_dim)))
    return fail(2, "cuTensorMapEncodeTiled refused a staging tensor (alignment or size)");
  const Params prm{q_scale, k_scale, v_scale, out, lse, stride_ob, stride_oh, stride_os,
                   hq, hkv, sq, skv, sq_pad / 64, skv_pad / kBlockN, out_bf16, n_mb,
                   static_cast<int>(n_tiles), n_full, splits ? n_split : 1, part_o, part_lse,
                   q_raw, stride_qb, stride_qh, stride_qs, q_bf16, q_scale_mult, pdl != 0};
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (head_dim == 128)
    return launch_pv<128, kConsumers, 4>(tq, tk, tv, prm, batch, sq_pad, causal, pv_fp16, v_block_scale, st);
  return launch_pv<64, kConsumers, 6>(tq, tk, tv, prm, batch, sq_pad, causal, pv_fp16, v_block_scale, st);
}

}  // extern "C"
