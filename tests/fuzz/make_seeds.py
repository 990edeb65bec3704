#!/usr/bin/env python3
"""Writes the text seeds of tests/fuzz/corpus/ (config, tokenizer, tokenizer_text, chat) from the
repository's fixtures; the binary seeds (safetensors, shard, checkpoint, index) come from the
harnesses themselves (FUZZ_MAKE_SEEDS=DIR build-fuzz/fuzz_NAME, through the project's writers).
tools/fuzz.sh --make-seeds runs both. Deterministic: a rerun writes the same files."""
import json
import os
import shutil
import sys

root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
corpus = os.path.join(root, "tests", "fuzz", "corpus")


def put(harness, name, data):
    d = os.path.join(corpus, harness)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode("utf-8"))


def byte_level_vocab():
    """GPT-2's 256 byte stand-ins as ids 0..255, as tests/test_tokenizer_small.c's small_tokenizer."""
    vocab, extra = {}, 0
    for b in range(256):
        printable = 33 <= b <= 126 or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF
        cp = b if printable else 256 + extra
        extra += not printable
        vocab[chr(cp)] = b
    return vocab


def small_byte_level(pre, normalizer=None, added=(), merges=("a b", "ab c", "\u0120 t", "h e")):
    vocab = byte_level_vocab()
    for m in merges:
        vocab.setdefault(m.replace(" ", ""), len(vocab))
    t = {"model": {"type": "BPE", "vocab": vocab, "merges": list(merges)}, "pre_tokenizer": pre,
         "normalizer": normalizer,
         "added_tokens": [{"id": len(vocab) + i, "content": c, "special": True} for i, c in enumerate(added)]}
    return json.dumps(t, ensure_ascii=False)


def small_spm(top):
    vocab = {"<0x%02X>" % b: b for b in range(256)}
    for p in ["\u2581", "a", "b", "\u2581a", "ab", "<s>", "</s>"]:
        vocab[p] = len(vocab)
    t = {"model": {"type": "BPE", "byte_fallback": True, "vocab": vocab, "merges": ["\u2581 a", "a b"]},
         "added_tokens": [{"id": vocab["<s>"], "content": "<s>"}, {"id": vocab["</s>"], "content": "</s>"}]}
    t.update(top)
    return json.dumps(t, ensure_ascii=False)


def split(regex):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}


def main():
    for h in ("config", "tokenizer", "tokenizer_text", "chat"):
        shutil.rmtree(os.path.join(corpus, h), ignore_errors=True)
    # config: the parity fixtures' configs (one per family) and the built-in model's
    for fam in ("llama3", "mistral", "qwen2", "qwen3"):
        with open(os.path.join(root, "tests", "fixtures", "parity", fam, "config.json"), "rb") as f:
            put("config", fam + ".json", f.read())
    with open(os.path.join(root, "models", "configs", "tiny-byte.json"), "rb") as f:
        put("config", "tiny-byte.json", f.read())

    # tokenizer: small files of each supported form, a NUL, then a text
    qwen = json.load(open(os.path.join(root, "tests", "fixtures", "tokenizers", "qwen3", "tokenizer.json")))
    qwen_regex = qwen["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    text = "Hello world, it's 2026!\n\tcaf\u00e9 e\u0301 \u0344 <|im_start|>abcab<x>\xff tail"
    seeds = {
        "gpt2-regex": small_byte_level({"type": "ByteLevel", "add_prefix_space": False}, added=["<|im_start|>", "<x>"]),
        "qwen-split-nfc": small_byte_level(split(qwen_regex), {"type": "NFC"}, added=["<|im_start|>"]),
        "spm-prepend": small_spm({"normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"}, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}}),
        "spm-metaspace": small_spm({"pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581",
                                                      "prepend_scheme": "first", "split": False},
                                    "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first"}}),
    }
    for name, js in seeds.items():
        put("tokenizer", name, js.encode("utf-8") + b"\0" + text.encode("utf-8", "surrogateescape"))
    # "(.)*" on more than 1,365 characters exhausts PCRE2's default JIT stack
    put("tokenizer", "dot-star-jit-stack", small_byte_level(split("(.)*")).encode() + b"\0" + b"ab" * 1200)
    # found by this harness: two added tokens with one id (refused)
    put("tokenizer", "duplicate-added-id", small_byte_level({"type": "ByteLevel"}, added=["<a>", "<b>"]).replace(
        '"id": 261', '"id": 260').encode() + b"\0a<b>c")
    # an added token id far beyond the vocabulary (refused)
    put("tokenizer", "sparse-id", small_byte_level({"type": "ByteLevel"}).replace(
        '"added_tokens": []', '"added_tokens": [{"id": 2147483646, "content": "<big>"}]'))

    # tokenizer_text: a byte for the tokenizer (0 qwen3, 1 spm, 2 spm-metaspace), then a text
    picked = {}
    for line in open(os.path.join(root, "tests", "fixtures", "tokenizers", "qwen3", "fixtures.jsonl"), encoding="utf-8"):
        d = json.loads(line)
        if d["category"] not in picked and len(d["text"].encode()) < 4096:
            picked[d["category"]] = d["text"]
    for i, (cat, t) in enumerate(sorted(picked.items())):
        put("tokenizer_text", cat, bytes([i % 3]) + t.encode("utf-8"))
    nfc = "Look: " + "\u0344" * 40 + " e\u0301 \u1100\u1161\u11a8 \u0f73\u0f73 done"
    for t in range(3):
        put("tokenizer_text", "nfc-lengthens-%d" % t, bytes([t]) + nfc.encode())
        put("tokenizer_text", "invalid-utf8-%d" % t, bytes([t]) + b"ok \xff\xfe \xed\xa0\x80 \xc3( <s>x</s> <|im_end|>\xe2\x96\x81")
    put("tokenizer_text", "long-mixture", b"\0" + (("Ein Satz. " * 30) + ("\u4f60\u597d\u4e16\u754c" * 40) + ("  \t\n" * 20)).encode())

    # chat: a byte for the format (bit 0: sharegpt) and the family (bits 1-2: qwen2, qwen3, llama3,
    # mistral), then a JSONL file
    alpaca = ['{"instruction": "Add 2 and 3.", "input": "", "output": "5"}',
              '{"instruction": "Translate", "input": "caf\\u00e9 \\u0344", "output": "coffee", "system": "Be brief."}',
              '', '{"instruction": "x", "output": null}']
    share = ['{"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Hi"}, '
             '{"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": " 4\\n"}]}',
             '{"messages": [{"role": "user", "content": "Look: \\u0344\\u0344"}, {"role": "assistant", "content": "<|im_end|> odd"}]}']
    for fam in range(4):
        put("chat", "alpaca-%d" % fam, bytes([fam << 1]) + ("\ufeff" + "\n".join(alpaca[:2]) + "\n").encode())
        put("chat", "sharegpt-%d" % fam, bytes([fam << 1 | 1]) + ("\n".join(share) + "\r\n").encode())
    put("chat", "alpaca-bad-line", bytes([2]) + ("\n".join(alpaca) + "\n").encode())
    put("chat", "bom-later-line", bytes([3]) + (share[0] + "\n\ufeff" + share[1]).encode())


if __name__ == "__main__":
    sys.exit(main())
