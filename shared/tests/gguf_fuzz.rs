//! Property test: random mutations of valid and hostile GGUF files (bit flips, byte sets,
//! truncations, insertions, deletions, and length/count fields spliced with extreme values)
//! never make the reader panic; when a mutant is accepted, every invariant the reader promises
//! holds (tensor ranges in bounds, aligned, disjoint; getters total).
//!
//! CI runs this bounded run; `shared/fuzz` has the open-ended cargo-fuzz target.

mod common;

use proptest::prelude::*;
use ternfleet_shared::gguf::{ArrayValue, GgmlType, GgufFile, GgufWriter, Value};

/// A file with every value type, a string array and block-quantised tensors.
fn rich_seed() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", Value::String("llama".into()))
        .unwrap();
    w.add_kv("llama.block_count", Value::U32(2)).unwrap();
    w.add_kv("f", Value::F32(1e-5)).unwrap();
    w.add_kv("i", Value::I64(-5)).unwrap();
    w.add_kv("b", Value::Bool(true)).unwrap();
    w.add_kv(
        "tokenizer.ggml.tokens",
        Value::Array(ArrayValue::String(vec![
            "<s>".into(),
            "a".into(),
            "▁b".into(),
        ])),
    )
    .unwrap();
    w.add_kv("s", Value::Array(ArrayValue::F32(vec![0.5; 3])))
        .unwrap();
    w.set_alignment(64).unwrap();
    w.add_tensor("q", &[32, 2], GgmlType::Q8_0, vec![3u8; 68])
        .unwrap();
    w.add_tensor("k", &[256], GgmlType::Q4_K, vec![4u8; 144])
        .unwrap();
    w.add_tensor("n", &[5], GgmlType::F32, vec![5u8; 20])
        .unwrap();
    w.to_bytes()
}

/// The two valid files first, then the hostile ones.
fn seeds() -> Vec<Vec<u8>> {
    let mut s = vec![common::valid_small(), rich_seed()];
    s.extend(common::hostile_cases().into_iter().map(|c| c.bytes));
    s
}

/// Half the runs mutate a valid file (mutants of those reach the tensor checks), half a
/// hostile one.
fn pick(seeds: &[Vec<u8>], seed: usize) -> Vec<u8> {
    if seed < 500 {
        seeds[seed % 2].clone()
    } else {
        seeds[2 + seed % (seeds.len() - 2)].clone()
    }
}

/// Values that break length, count, offset and dimension fields.
const EXTREME_U64: [u64; 12] = [
    0,
    1,
    7,
    31,
    u64::MAX,
    u64::MAX - 7,
    1 << 63,
    1 << 40,
    (1 << 32) - 1,
    1 << 32,
    65_537,
    (1 << 22) + 1,
];

#[derive(Clone, Debug)]
enum Mutation {
    FlipBit(usize, u8),
    SetByte(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    SpliceU64(usize, u64),
    SpliceU32(usize, u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    // Positions are taken modulo the file length; most fields are in the first few hundred
    // bytes, so bias towards them.
    let pos = prop_oneof![3 => 0usize..256, 1 => any::<usize>()];
    prop_oneof![
        (pos.clone(), 0u8..8).prop_map(|(p, b)| Mutation::FlipBit(p, b)),
        (pos.clone(), any::<u8>()).prop_map(|(p, v)| Mutation::SetByte(p, v)),
        pos.clone().prop_map(Mutation::Truncate),
        (pos.clone(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, v)| Mutation::Insert(p, v)),
        (pos.clone(), 1usize..64).prop_map(|(p, n)| Mutation::Delete(p, n)),
        (pos.clone(), prop::sample::select(&EXTREME_U64[..]))
            .prop_map(|(p, v)| Mutation::SpliceU64(p, v)),
        (
            pos,
            prop_oneof![
                Just(0u32),
                Just(5),
                Just(9),
                Just(13),
                Just(u32::MAX),
                any::<u32>()
            ]
        )
            .prop_map(|(p, v)| Mutation::SpliceU32(p, v)),
    ]
}

fn apply(bytes: &mut Vec<u8>, m: &Mutation) {
    let len = bytes.len();
    if len == 0 {
        if let Mutation::Insert(_, v) = m {
            bytes.extend_from_slice(v);
        }
        return;
    }
    match *m {
        Mutation::FlipBit(p, b) => bytes[p % len] ^= 1 << b,
        Mutation::SetByte(p, v) => bytes[p % len] = v,
        Mutation::Truncate(p) => bytes.truncate(p % len),
        Mutation::Insert(p, ref v) => {
            let p = p % (len + 1);
            bytes.splice(p..p, v.iter().copied());
        }
        Mutation::Delete(p, n) => {
            let p = p % len;
            bytes.drain(p..(p + n).min(len));
        }
        Mutation::SpliceU64(p, v) => splice(bytes, p % len, &v.to_le_bytes()),
        Mutation::SpliceU32(p, v) => splice(bytes, p % len, &v.to_le_bytes()),
    }
}

fn splice(bytes: &mut [u8], p: usize, v: &[u8]) {
    let n = v.len().min(bytes.len() - p);
    bytes[p..p + n].copy_from_slice(&v[..n]);
}

/// Everything the reader promises about an accepted file.
fn check_invariants(f: &GgufFile) {
    let len = f.data().len() as u64;
    assert!(f.alignment().is_power_of_two());
    let mut ranges = Vec::new();
    for t in f.tensors() {
        assert!(t.offset + t.size <= len);
        assert_eq!((t.offset - f.data_offset()) % f.alignment(), 0);
        assert_eq!(f.tensor_data(t).len() as u64, t.size);
        assert_eq!(t.ty.row_size(t.n_elements()), Some(t.size));
        assert_eq!(t.cols() * t.rows(), t.n_elements());
        assert_eq!(f.tensor(&t.name), Some(t));
        ranges.push((t.offset, t.offset + t.size));
    }
    ranges.sort_unstable();
    assert!(ranges.windows(2).all(|w| w[0].1 <= w[1].0));
    for (k, v) in f.metadata() {
        // The very entry (values may be NaN, which `==` would call different).
        assert!(f.get(k).is_some_and(|g| std::ptr::eq(g, v)), "get({k:?})");
        let _ = (f.get_u32(k), f.get_u64(k), f.get_i64(k), f.get_f32(k));
        let _ = (f.get_bool(k), f.get_str(k), f.get_array(k));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_never_panic_the_reader(
        seed in 0usize..1000,
        mutations in prop::collection::vec(mutation(), 1..5),
    ) {
        let seeds = seeds();
        let mut bytes = pick(&seeds, seed);
        for m in &mutations {
            apply(&mut bytes, m);
        }
        // A panic inside fails the property; Ok and Err are both fine.
        if let Ok(f) = GgufFile::from_bytes(bytes) {
            check_invariants(&f);
        }
    }
}

/// The same mutations, counted, so the run reports how many mutants were accepted vs rejected
/// (a fuzz run where everything is rejected at the magic would prove little).
#[test]
fn mutation_run_reaches_deep_into_the_parser() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let seeds = seeds();
    let mut runner = TestRunner::deterministic();
    let strategy = (0usize..1000, prop::collection::vec(mutation(), 1..3));
    let (mut ok, mut err, mut past_header) = (0, 0, 0);
    let n = 2000;
    for _ in 0..n {
        let (seed, muts) = strategy.new_tree(&mut runner).unwrap().current();
        let mut bytes = pick(&seeds, seed);
        for m in &muts {
            apply(&mut bytes, m);
        }
        match GgufFile::from_bytes(bytes) {
            Ok(f) => {
                check_invariants(&f);
                ok += 1;
            }
            Err(e) => {
                err += 1;
                let msg = e.to_string();
                if !msg.contains("magic") && !msg.contains("version") && !msg.contains("too short")
                {
                    past_header += 1;
                }
            }
        }
    }
    println!("fuzz execs: {n}; accepted {ok}, rejected {err} ({past_header} past the header)");
    assert!(ok > 0 && past_header > n / 4);
}
