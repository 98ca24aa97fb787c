#!/usr/bin/env python3
"""Write kernels/src/iq_grids.rs: the lookup tables of ggml's IQ weight types, as data.

The IQ2/IQ3/IQ1 types store indices into fixed grids of 8 (or 4) small values; ggml keeps those
grids in ggml/src/ggml-common.h (MIT License, Copyright (c) 2023-2026 The ggml authors). This
script reads them from the llama.cpp source that scripts/build-llama-cpp.sh unpacks and writes
them out as Rust arrays with that notice. `shared/tests/iq_grids.rs` compares the Rust arrays
with the same source whenever it is present (test.sh unpacks it), so the copy cannot drift.

Usage: python3 scripts/make-iq-grids.py [path/to/ggml-common.h]
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT = os.path.join(ROOT, "target/llama.cpp/src/vendor/llama.cpp/ggml/src/ggml-common.h")
OUT = os.path.join(ROOT, "kernels/src/iq_grids.rs")

# (C name, C type, Rust name, Rust type)
TABLES = [
    ("kvalues_iq4nl", "int8_t", "KVALUES_IQ4NL", "i8"),
    ("ksigns_iq2xs", "uint8_t", "KSIGNS_IQ2XS", "u8"),
    ("iq2xxs_grid", "uint64_t", "IQ2XXS_GRID", "u64"),
    ("iq2xs_grid", "uint64_t", "IQ2XS_GRID", "u64"),
    ("iq2s_grid", "uint64_t", "IQ2S_GRID", "u64"),
    ("iq3xxs_grid", "uint32_t", "IQ3XXS_GRID", "u32"),
    ("iq3s_grid", "uint32_t", "IQ3S_GRID", "u32"),
    ("iq1s_grid", "uint64_t", "IQ1S_GRID", "u64"),
]


def parse(text, name, ctype):
    """The values of `GGML_TABLE_BEGIN(ctype, name, ...) ... GGML_TABLE_END()` as ints."""
    m = re.search(r"GGML_TABLE_BEGIN\(\s*" + ctype + r"\s*,\s*" + name + r"\s*,[^)]*\)(.*?)GGML_TABLE_END\(\)",
                  text, re.S)
    if not m:
        sys.exit(f"make-iq-grids: table {name} not found")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    if "/*" in body or "#" in body:
        sys.exit(f"make-iq-grids: table {name} has a block comment or a preprocessor line")
    return [int(v, 0) for v in re.findall(r"-?0x[0-9a-fA-F]+|-?\d+", body)]


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else DEFAULT
    text = open(src).read()
    out = [
        "//! The lookup tables of ggml's IQ weight types (grids of small values, sign patterns, the",
        "//! non-linear 4-bit values),",
        "//! as data, written by `scripts/make-iq-grids.py` from llama.cpp's `ggml/src/ggml-common.h`",
        "//! (the llama-cpp-python 0.3.36 sdist); `shared/tests/iq_grids.rs` checks them against that",
        "//! source. Do not edit by hand.",
        "//!",
        "//! The tables are from ggml, under its MIT License:",
        "//!",
        "//! Copyright (c) 2023-2026 The ggml authors",
        "//!",
        "//! Permission is hereby granted, free of charge, to any person obtaining a copy of this",
        "//! software and associated documentation files (the \"Software\"), to deal in the Software",
        "//! without restriction, including without limitation the rights to use, copy, modify, merge,",
        "//! publish, distribute, sublicense, and/or sell copies of the Software, and to permit persons",
        "//! to whom the Software is furnished to do so, subject to the following conditions:",
        "//!",
        "//! The above copyright notice and this permission notice shall be included in all copies or",
        "//! substantial portions of the Software.",
        "//!",
        "//! THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED,",
        "//! INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR",
        "//! PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE AUTHORS OR COPYRIGHT HOLDERS BE LIABLE",
        "//! FOR ANY CLAIM, DAMAGES OR OTHER LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR",
        "//! OTHERWISE, ARISING FROM, OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER",
        "//! DEALINGS IN THE SOFTWARE.",
        "",
        "/// (ggml name, values) of every table, for the test against ggml's source.",
        "pub fn all() -> [(&'static str, Vec<i128>); %d] {" % len(TABLES),
        "    [",
    ]
    for cname, _, rname, rtype in TABLES:
        out.append(f'        ("{cname}", {rname}.iter().map(|&v| i128::from(v)).collect()),')
    out += ["    ]", "}", ""]
    for cname, ctype, rname, rtype in TABLES:
        vals = parse(text, cname, ctype)
        width = {"i8": 0, "u8": 2, "u32": 8, "u64": 16}[rtype]
        per = {"i8": 16, "u8": 12, "u32": 6, "u64": 4}[rtype]
        fmt = (lambda v: f"{v},") if rtype == "i8" else (lambda v: f"0x{v:0{width}x},")
        out.append(f"/// ggml's `{cname}`.")
        out.append(f"pub const {rname}: [{rtype}; {len(vals)}] = [")
        for i in range(0, len(vals), per):
            out.append("    " + " ".join(fmt(v) for v in vals[i:i + per]))
        out.append("];")
        out.append("")
    with open(OUT, "w") as f:
        f.write("\n".join(out))
    print(f"wrote {os.path.relpath(OUT, ROOT)} from {src}")


if __name__ == "__main__":
    main()
