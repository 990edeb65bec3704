#!/usr/bin/env python3
"""Captures transformers' apply_chat_template output for a set of conversations, as the reference
tests/test_dataset.c (test_templates_vs_transformers) compares megatrain's hard-coded templates
with. Needs transformers and a tokenizer directory holding tokenizer_config.json with its
chat_template (no network: the GPU machine has none).

    python3 tools/chat_template_check.py TOKENIZER_DIR --family qwen3 [--out FILE.json]

Without --out it prints the renderings. The JSON holds the transformers version, the family and,
per case, the messages and the rendered text (tokenize=False, add_generation_prompt=False).
"""
import argparse
import json
import sys

CASES = [
    ("two turns", [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": " 4\n"},
    ]),
    ("system", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]),
    ("whitespace and unicode", [
        {"role": "system", "content": "  Réponds en français.\n"},
        {"role": "user", "content": "\n  Qu'est-ce que 東京?  \n"},
        {"role": "assistant", "content": "  Une ville 🙂\n\n"},
        {"role": "user", "content": "Et\tensuite ?"},
        {"role": "assistant", "content": "Rien."},
    ]),
    ("one turn", [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"},
    ]),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer_dir")
    ap.add_argument("--family", required=True, help="qwen2, qwen3, llama3 or mistral (recorded in the JSON)")
    ap.add_argument("--out", help="write the JSON reference here")
    args = ap.parse_args()
    try:
        import transformers
        from transformers import AutoTokenizer
    except ImportError as e:
        sys.exit(f"chat_template_check: {e}: needs transformers")
    tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    if not getattr(tok, "chat_template", None):
        sys.exit(f"chat_template_check: {args.tokenizer_dir}: the tokenizer has no chat_template")
    out = {"family": args.family, "transformers": transformers.__version__, "cases": []}
    for name, messages in CASES:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        out["cases"].append({"name": name, "messages": messages, "rendered": text})
        print(f"--- {args.family}: {name} ---\n{text!r}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
