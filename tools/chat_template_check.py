#!/usr/bin/env python3
"""Prints transformers' apply_chat_template output for the conversation of tests/test_dataset.c
(test_templates), with and without a system message, and the assistant token mask where the
template supports it, to compare with docs/data.md. Usage:
    python3 tools/chat_template_check.py MODEL_DIR_OR_ID [--json FILE]
--json FILE: messages from a file (a JSON list of {"role", "content"}) instead."""
import argparse
import json

from transformers import AutoTokenizer

CONVERSATION = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": " 4\n"},
]


def show(tok, messages, label):
    text = tok.apply_chat_template(messages, tokenize=False)
    print(f"--- {label}: rendered (repr) ---")
    print(repr(text))
    try:
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = out["input_ids"], out["assistant_masks"]
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        print(f"--- {label}: assistant-masked text (repr) ---")
        print(repr(trained))
    except Exception as e:  # templates without {% generation %} blocks cannot give a mask
        print(f"--- {label}: no assistant mask ({type(e).__name__}: {e}) ---")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--json")
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.model)
    if a.json:
        with open(a.json) as f:
            show(tok, json.load(f), "given")
        return
    show(tok, CONVERSATION, "no system")
    show(tok, [{"role": "system", "content": "Be brief."}] + CONVERSATION, "system 'Be brief.'")


if __name__ == "__main__":
    main()
