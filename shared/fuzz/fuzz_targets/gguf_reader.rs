//! Feeds arbitrary bytes to the GGUF reader: it must return Ok or Err, never panic, and an
//! accepted file must keep the reader's promises (tensor ranges in bounds and disjoint).
#![no_main]

use libfuzzer_sys::fuzz_target;
use ternfleet_shared::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = GgufFile::from_bytes(data.to_vec()) {
        let len = f.data().len() as u64;
        for t in f.tensors() {
            assert!(t.offset + t.size <= len);
            assert_eq!(f.tensor_data(t).len() as u64, t.size);
        }
        for (k, _) in f.metadata() {
            let _ = (f.get_u64(k), f.get_i64(k), f.get_f32(k), f.get_str(k), f.get_array(k));
        }
    }
});
