#!/usr/bin/env python3
"""Checks the SentencePiece-style tokenizer fixtures (tests/fixtures/tokenizers/spm*) against
Hugging Face's own tokenizers library (the Rust implementation transformers uses), where
tools/tokenizer_fixtures.mjs computed them with transformers.js: the same ids, the same decoding.
Run where `tokenizers` is installed (the GPU machine): python3 tools/spm_fixtures_hf.py"""
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

root = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tokenizers"
bad = 0
for form in ("spm", "spm-metaspace"):
    tok = Tokenizer.from_file(str(root / form / "tokenizer.json"))
    recs = [json.loads(line) for line in (root / form / "fixtures.jsonl").read_text(encoding="utf-8").split("\n") if line]
    ids_bad = dec_bad = 0
    for r in recs:
        ids = tok.encode(r["text"], add_special_tokens=False).ids
        if ids != r["ids"]:
            ids_bad += 1
            if ids_bad <= 3:
                print(f"{form}: ids differ for {r['text']!r}: hf {ids[:12]} fixture {r['ids'][:12]}")
        dec = tok.decode(r["ids"], skip_special_tokens=False)
        if dec != r["decoded"]:
            dec_bad += 1
            if dec_bad <= 3:
                print(f"{form}: decoding differs for {r['text']!r}: hf {dec!r} fixture {r['decoded']!r}")
    print(f"{form}: {len(recs)} strings, ids differ in {ids_bad}, decoding differs in {dec_bad}")
    bad += ids_bad + dec_bad
sys.exit(1 if bad else 0)
