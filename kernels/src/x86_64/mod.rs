//! x86-64 kernels. Each submodule exposes a token type whose constructor checks the CPU
//! features at run time; only a token can hand out that module's kernel table, so the
//! `#[target_feature]` functions are reachable only after the check (see `crate::dispatch`).

pub(crate) mod avx2;
pub(crate) mod avx512;
pub(crate) mod avx512q;
mod gemv_k4;
mod iq2;
mod iq4;
pub(crate) mod kq_lanes;
mod kq_lanes2;
mod lanes8;
mod legacy_min;
mod nl_lanes;
mod nl_lanes2;
mod q2k;
mod q3k;
mod quant_avx2;
mod tern_avx2;
pub(crate) mod tern_avx512;
pub(crate) mod tf1_lut;

/// The activation bytes a token block keeps in cache while the row tiles stream past it
/// ([`Gemm::token_block`](crate::matmul::Gemm::token_block)), unless a driver says otherwise.
pub(crate) const TOKEN_BLOCK_BYTES: usize = 256 * 1024;

/// Cover `g.nrows` × `g.ntok` with tiles of R rows × T tokens: the tokens a block leaves over
/// (fewer than T) in narrower tiles of at most 3, so each row's blocks are loaded and unpacked
/// once per pass for all of them; the last rows in 1-row tiles. Tokens go in blocks of about
/// 256 KiB of activations, or `@ BYTES` of them. Expanded inside a `#[target_feature]` function
/// of the module whose tiles it calls.
macro_rules! drive {
    (@ $budget:expr, $g:expr, $out:expr, $tile:ident, $R:literal, $T:literal $(, $extra:ident)*) => {{
        let g: &$crate::matmul::Gemm<'_> = $g;
        let out: &mut [f32] = $out;
        // Token block: keep the activations of one block in cache while every row tile of
        // this call streams past them; rows of a tile stay in cache across the token tiles.
        let tb = g.token_block($budget, $T);
        let mut t0 = 0;
        while t0 < g.ntok {
            let t1 = (t0 + tb).min(g.ntok);
            let mut r = 0;
            while r < g.nrows {
                let one = g.nrows - r < $R;
                let mut t = t0;
                while t1 - t >= $T {
                    // SAFETY: r + R <= nrows (or r + 1 when `one`), t + T <= ntok by the loop
                    // bounds; the caller has the features.
                    unsafe {
                        if one {
                            $tile::<1, $T $(, $extra)*>(g, r, t, out)
                        } else {
                            $tile::<$R, $T $(, $extra)*>(g, r, t, out)
                        }
                    };
                    t += $T;
                }
                while t < t1 {
                    let w = (t1 - t).min(3);
                    // SAFETY: as above, with w <= t1 - t tokens.
                    unsafe {
                        match (w, one) {
                            (1, false) => $tile::<$R, 1 $(, $extra)*>(g, r, t, out),
                            (1, true) => $tile::<1, 1 $(, $extra)*>(g, r, t, out),
                            (2, false) => $tile::<$R, 2 $(, $extra)*>(g, r, t, out),
                            (2, true) => $tile::<1, 2 $(, $extra)*>(g, r, t, out),
                            (_, false) => $tile::<$R, 3 $(, $extra)*>(g, r, t, out),
                            (_, true) => $tile::<1, 3 $(, $extra)*>(g, r, t, out),
                        }
                    }
                    t += w;
                }
                r += if one { 1 } else { $R };
            }
            t0 = t1;
        }
    }};
    ($g:expr, $out:expr, $tile:ident, $R:literal, $T:literal $(, $extra:ident)*) => {
        drive!(@ $crate::x86_64::TOKEN_BLOCK_BYTES, $g, $out, $tile, $R, $T $(, $extra)*)
    };
}
pub(crate) use drive;

/// An ISA table's entries for the IQ grid types: `mm_iq*` functions calling `iq2::$run`
/// (`run_grid` for AVX2, `run_grid_avx512`), one per kind.
macro_rules! grid_entries {
    ($run:ident) => {
        $crate::x86_64::grid_entries!(@ $run,
            mm_iq2_xxs: IQ2_XXS,
            mm_iq3_xxs: IQ3_XXS,
            mm_iq2_xs: IQ2_XS,
            mm_iq2_s: IQ2_S,
            mm_iq3_s: IQ3_S,
            mm_iq1_s: IQ1_S,
            mm_iq1_m: IQ1_M);
    };
    (@ $run:ident, $($name:ident: $kind:ident),*) => {$(
        fn $name(g: &Gemm<'_>, out: &mut [f32]) {
            // SAFETY: reachable only through the table built from this module's token, which
            // proves the features `iq2::$run` needs; `g` was validated by `Gemm::new`.
            unsafe { super::iq2::$run::<{ super::$kind }>(g, out) }
        }
    )*};
}
pub(crate) use grid_entries;

/// Whether this is an AMD CPU (CPUID vendor "AuthenticAMD"), for the few choices the two
/// vendors' cores want made differently (`avx2::float_act`, `avx2::signed_one_row`, the IQ
/// grid types' GEMVs in `iq2`: [`fast_gathers`], and IQ1_S, which gathers on AMD Zen 4 too;
/// [`stream_prefetch`]; and through [`is_amd_zen5_or_later`] the choices Zen 5 makes apart
/// from Zen 4).
pub(crate) fn is_amd() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(|| {
        // CPUID leaf 0 exists on every x86-64 CPU.
        let v = core::arch::x86_64::__cpuid(0);
        // The vendor string "AuthenticAMD" in EBX, EDX, ECX.
        (v.ebx, v.edx, v.ecx) == (0x6874_7541, 0x6974_6E65, 0x444D_4163)
    })
}

/// Whether this is an AMD CPU of family 0x1A or later (Zen 5 on), CPUID leaf 1's base family
/// plus its extended family: where the streaming GEMVs prefetch 4 KB ahead
/// ([`stream_prefetch`]), the IQ grid types' prefill GEMM takes bands of 512 tokens
/// (`kq_lanes::band_groups`), the GEMVs of IQ1_S, IQ1_M, IQ2_XXS, IQ3_XXS, IQ3_S and IQ4_XS run
/// one row at a time with IQ1_S's, IQ1_M's and IQ3_S's grid rows by loads (`iq2`, `iq4`), and
/// q3_K takes its 512-bit tile (`q3k::tile_zmm`); sessions 30 and 40. Also (session 45) the
/// f16 GEMM converts its activations as loaded instead of widening them, and the f16 and bf16
/// GEMMs take token blocks of 4 MiB (`avx512::run_float`). Measured on KVM EPYCs
/// (family 26 model 2); Zen 5 parts with 256-bit AVX-512 datapaths (Ryzen, mobile) take the
/// same, unmeasured.
pub(crate) fn is_amd_zen5_or_later() -> bool {
    static ZEN5: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ZEN5.get_or_init(|| {
        if !is_amd() {
            return false;
        }
        // CPUID leaf 1 exists on every x86-64 CPU; EAX bits 8..12 the base family, 20..28 the
        // extended family (added when the base family is 0xF, as on every AMD CPU since K8).
        let eax = core::arch::x86_64::__cpuid(1).eax;
        let base = (eax >> 8) & 0xF;
        let family = if base == 0xF {
            base + ((eax >> 20) & 0xFF)
        } else {
            base
        };
        family >= 0x1A
    })
}

/// Whether `vpgather*` is worth a table lookup here: an Intel CPU with AVX512-FP16, i.e.
/// Sapphire Rapids or later. Skylake-SP through Ice Lake and Tiger Lake run gathers under the
/// Gather Data Sampling ("Downfall") microcode mitigation, several times slower; on an AMD
/// Zen 4 (session 28) the gather tiles were slower than the sub-block tile for every grid
/// type but IQ1_S, which `iq2` lets gather on AMD Zen 4 (Zen 5 fetches IQ1_S's, IQ1_M's and
/// IQ3_S's grid rows by loads: [`is_amd_zen5_or_later`]). The IQ grid types' AVX-512 GEMVs
/// gather their grid rows where this holds (`iq2::run_grid_avx512`; measured on an Emerald
/// Rapids Xeon, session 26).
pub(crate) fn fast_gathers() -> bool {
    static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FAST.get_or_init(|| !is_amd() && is_x86_feature_detected!("avx512fp16"))
}

/// AVX512-VBMI and GFNI, what the ternary table decoder (`tern_avx512`) and the IQ grid types'
/// mask tile (`iq2::sign_masks`) need besides the AVX-512 table's features.
pub(crate) fn has_vbmi_gfni() -> bool {
    is_x86_feature_detected!("avx512vbmi") && is_x86_feature_detected!("gfni")
}

/// Tests: `len` bytes of the xorshift64 stream from `seed` (bits 24..32 of each state), the
/// kernel tests' random weights.
#[cfg(test)]
pub(crate) fn xorshift_bytes(seed: u64, len: usize) -> Vec<u8> {
    xorshift(seed, len, |x| (x >> 24) as u8)
}

/// Tests: `len` floats in -1..1 of the xorshift64 stream from `seed`, the kernel tests' random
/// activations.
#[cfg(test)]
pub(crate) fn xorshift_f32(seed: u64, len: usize) -> Vec<f32> {
    xorshift(seed, len, |x| (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
}

#[cfg(test)]
fn xorshift<T>(seed: u64, len: usize, f: impl Fn(u64) -> T) -> Vec<T> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            f(x)
        })
        .collect()
}

/// Tests: runs `f` with the choice held in `key` (a kernel's by-vendor default when `None`)
/// forced to `v` on this thread, restored afterwards.
#[cfg(test)]
pub(crate) fn with_forced<T: Copy + 'static, R>(
    key: &'static std::thread::LocalKey<std::cell::Cell<Option<T>>>,
    v: T,
    f: impl FnOnce() -> R,
) -> R {
    let before = key.with(|c| c.replace(Some(v)));
    let r = f();
    key.with(|c| c.set(before));
    r
}

/// Bytes ahead of the read position that the GEMVs reading their weights as one sequential stream
/// (q4_K / q5_K's `gemv_k4`, q6_K's one-row path, q8_0 / q5_0's `gemv_legacy` on AMD, the AVX2 q8_0
/// one-row `tile_legacy` and q8_0 / q5_0 one-row `tile_signed`) prefetch: 2048 on Intel and on AMD
/// CPUs without AVX-512 (measured on Zen 3), 4096 on AMD Zen 5 and later, none on Zen 4.
/// (`gemv_legacy` and the AVX2 one-row `tile_legacy` took it in session 31, measured on Intel only;
/// AMD without AVX-512 and the one-row `tile_signed` in session 34, on Zen 3: Gemma's 262144 × 640
/// q8_0 LM head, AVX2 one row at a time, 11.1-13.2 ms with none, 9.1-10.6 with 2048 ahead, 9.5-10.7
/// with 4096, 9.9-11.9 with 6144 at two threads; 20-22 ms with none and 14.7-16.2 with 2048 or 4096
/// at one.) On an Intel Xeon (session 27, KVM) the hardware prefetchers left those GEMVs at ~8 GB/s
/// on the small expert matrices of MoE decode (768 × 2048, 0.9-1.3 MB each, cold): the 16-layer
/// Qwen3-30B-A3B-shaped model decoded at 17.9 t/s without and 22.4-24.6 with 1.5-2 KB ahead (2
/// threads; 16.4-16.9 against 20.4-20.9 in a slower hour of the host; 10.0-10.6 against 13.6-14.1
/// at one thread; 4-6 KB ahead slower than 2). On an AMD EPYC (Zen 4) prefetching 8 rows ahead (94
/// KB) slowed q6_K's one-row GEMV from DRAM by a third, and this distance (2-4 KB) on the same
/// decode in session 28 came out between -2 % and +10 % over three sittings, inside that host's
/// noise, so Zen 4 keeps the hardware's. On an AMD EPYC Zen 5 (session 30, alternated runs of the
/// 24-layer model, 2 threads) 0 / 2048 / 4096 / 6144 / 8192 / 12288 bytes ahead decoded at medians
/// of 34.9-35.8 / 38.8 / 39.9-41.5 / 40.1 / 39.8 / 38.9 t/s; 4096 ahead also 24.4-24.8 -> 27.9-28.3
/// t/s at one thread and Gemma 3 270M's dense decode 141.5-147.3 -> 151.3-153.5 t/s.
pub(crate) fn stream_prefetch() -> usize {
    static PF: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PF.get_or_init(|| {
        if is_amd_zen5_or_later() {
            4096
        } else if is_amd() && is_x86_feature_detected!("avx512f") {
            0
        } else {
            2048
        }
    })
}

/// The bytes of `v`.
pub(crate) fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any alignment suits u8; same memory, same lifetime.
    unsafe { core::slice::from_raw_parts(v.as_ptr().cast(), core::mem::size_of_val(v)) }
}

/// Plain data: every bit pattern of its size is a valid value (SIMD vectors, floats, integers,
/// and arrays / structs of them), so a scratch buffer may hand out stale bytes as one.
///
/// # Safety
/// Implement only for such types, with an alignment of at most 64.
pub(crate) unsafe trait Pod: Copy {}

// SAFETY: vectors of integers or floats: every bit pattern is a value.
unsafe impl Pod for core::arch::x86_64::__m512i {}
// SAFETY: as above.
unsafe impl Pod for core::arch::x86_64::__m512 {}
// SAFETY: as above.
unsafe impl Pod for core::arch::x86_64::__m256 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}
// SAFETY: arrays of plain data are plain data.
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

use crate::matmul::Line;

/// [`crate::widen_transpose_f16`] in whole `B × B` blocks, each widened and transposed by
/// `block` (in registers), the ragged edges as the scalar reference.
///
/// # Safety
/// `block` may run on this CPU, reading `B` rows of `B` f16 at its source (the given stride)
/// and writing `B` rows of `B` f32 at its destination, nothing else.
pub(crate) unsafe fn widen_transpose_blocks<const B: usize>(
    src: &[half::f16],
    src_stride: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    dst_stride: usize,
    block: unsafe fn(*const half::f16, usize, *mut f32, usize),
) {
    // Checked again here (the public entry checks too): the blocks read and write through raw
    // pointers.
    if !crate::widen_transpose_fits(src.len(), src_stride, rows, cols, dst.len(), dst_stride) {
        return;
    }
    let (rb, cb) = (rows / B * B, cols / B * B);
    for r0 in (0..rb).step_by(B) {
        for c0 in (0..cb).step_by(B) {
            // SAFETY: `block` may run (the contract); a whole B × B block inside the sizes
            // checked above, at both ends.
            unsafe {
                block(
                    src.as_ptr().add(r0 * src_stride + c0),
                    src_stride,
                    dst.as_mut_ptr().add(c0 * dst_stride + r0),
                    dst_stride,
                )
            };
        }
    }
    for r in 0..rows {
        let c_from = if r < rb { cb } else { 0 };
        for c in c_from..cols {
            dst[c * dst_stride + r] = src[r * src_stride + c].to_f32();
        }
    }
}

/// Per-thread scratch buffers kept above this size are freed after the call instead: they are
/// prefill-sized, where one allocation is nothing next to the matmul.
const SCRATCH_KEEP: usize = 4 << 20;

std::thread_local! {
    /// Two buffers per thread (prepared activations, unpacked weights, accumulators, transposed
    /// activation scales: each use takes one slot for its call), reused across calls so
    /// a matmul allocates (and page-faults) only when it needs more room than any before it.
    static SCRATCH: [std::cell::RefCell<Vec<Line>>; 2] =
        const { [std::cell::RefCell::new(Vec::new()), std::cell::RefCell::new(Vec::new())] };
}

/// Runs `f` on `len` values of `T` from this thread's scratch buffer `slot` (0 or 1). The values
/// are unspecified (whatever an earlier call left): `f` must write before it reads.
pub(crate) fn with_scratch<T: Pod, R>(slot: usize, len: usize, f: impl FnOnce(&mut [T]) -> R) -> R {
    fn view<T: Pod>(v: &mut Vec<Line>, len: usize) -> &mut [T] {
        assert!(core::mem::align_of::<T>() <= 64);
        let bytes = len
            .checked_mul(core::mem::size_of::<T>())
            .expect("scratch size overflows usize");
        if v.len() * 64 < bytes {
            v.resize(bytes.div_ceil(64), Line([0; 64]));
        }
        // SAFETY: `v` holds at least `len` values' worth of initialized bytes, 64-byte aligned;
        // `T` is `Pod`, so any bytes are a valid `T`; the slice borrows `v` mutably.
        unsafe { core::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<T>(), len) }
    }
    if len.saturating_mul(core::mem::size_of::<T>()) > SCRATCH_KEEP {
        return f(view(&mut Vec::new(), len));
    }
    SCRATCH.with(|s| match s[slot].try_borrow_mut() {
        Ok(mut v) => f(view(&mut v, len)),
        // Only if a kernel ever nested two uses of one slot: a fresh buffer is still right.
        Err(_) => f(view(&mut Vec::new(), len)),
    })
}

// Kinds of weight block, as const-generic parameters of the tile functions.
pub(crate) const Q8_0: u8 = 0;
pub(crate) const Q4_0: u8 = 1;
pub(crate) const Q5_0: u8 = 2;
pub(crate) const Q4_K: u8 = 3;
pub(crate) const Q5_K: u8 = 4;
pub(crate) const Q6_K: u8 = 5;
pub(crate) const F32: u8 = 6;
pub(crate) const F16: u8 = 7;
pub(crate) const BF16: u8 = 8;
pub(crate) const TQ1_0: u8 = 9;
pub(crate) const TQ2_0: u8 = 10;
pub(crate) const TF2: u8 = 11;
pub(crate) const TF1: u8 = 12;
pub(crate) const Q4_1: u8 = 13;
pub(crate) const Q5_1: u8 = 14;
pub(crate) const Q3_K: u8 = 15;
pub(crate) const IQ4_XS: u8 = 16;
pub(crate) const IQ4_NL: u8 = 17;
pub(crate) const Q2_K: u8 = 18;
pub(crate) const IQ2_XXS: u8 = 19;
pub(crate) const IQ3_XXS: u8 = 20;
pub(crate) const IQ2_XS: u8 = 21;
pub(crate) const IQ2_S: u8 = 22;
pub(crate) const IQ3_S: u8 = 23;
pub(crate) const IQ1_S: u8 = 24;
pub(crate) const IQ1_M: u8 = 25;

/// Bytes per block of a legacy (32-value) kind.
pub(crate) const fn legacy_block_bytes(kind: u8) -> usize {
    match kind {
        Q8_0 => 34,
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_1 => 24,
        _ => 22,
    }
}

/// The unsigned code of a legacy kind is `value + OFFSET` (q4_1 / q5_1: the code itself,
/// their offset is the block's min, summed apart).
pub(crate) const fn legacy_offset(kind: u8) -> i32 {
    match kind {
        Q8_0 => 128,
        Q4_0 => 8,
        Q4_1 | Q5_1 => 0,
        _ => 16,
    }
}

/// Whether a legacy kind has a min (q4_1 / q5_1, against q8_1 activations).
pub(crate) const fn legacy_has_min(kind: u8) -> bool {
    matches!(kind, Q4_1 | Q5_1)
}

/// (bytes per activation block, offset of its codes): q8_1 for kinds with a min, else q8_0.
pub(crate) const fn legacy_act(kind: u8) -> (usize, usize) {
    if legacy_has_min(kind) {
        (36, 4)
    } else {
        (34, 2)
    }
}

/// (offset of the low nibbles, offset of the high-bit word or 0) of a 4/5-bit legacy kind.
pub(crate) const fn legacy_nibbles(kind: u8) -> (usize, usize) {
    match kind {
        Q4_0 => (2, 0),
        Q4_1 => (4, 0),
        Q5_1 => (8, 4),
        _ => (6, 2),
    }
}

/// Bytes per super-block of a k-quant kind.
pub(crate) const fn k_block_bytes(kind: u8) -> usize {
    match kind {
        Q2_K => 84,
        IQ2_XXS => 66,
        IQ3_XXS => 98,
        IQ2_XS => 74,
        IQ2_S => 82,
        IQ3_S => 110,
        IQ1_S => 50,
        IQ1_M => 56,
        Q3_K => 110,
        IQ4_XS => 136,
        Q4_K => 144,
        Q5_K => 176,
        _ => 210,
    }
}

/// The q4_K/q5_K 6-bit scales and mins of one super-block, unpacked as
/// `ggml_vec_dot_q4_K_q8_K_generic` does with its `utmp` words: (8 scales, 8 mins) as bytes.
#[inline(always)]
pub(crate) fn k4_scales_mins(s: &[u8; 12]) -> (u64, u64) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let u0 = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    let u1 = u32::from_le_bytes([s[4], s[5], s[6], s[7]]);
    let u2 = u32::from_le_bytes([s[8], s[9], s[10], s[11]]);
    let t3 = ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4);
    let t2 = u1 & KMASK1;
    let t1 = (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4);
    let t0 = u0 & KMASK1;
    (
        (t0 as u64) | ((t1 as u64) << 32),
        (t2 as u64) | ((t3 as u64) << 32),
    )
}
