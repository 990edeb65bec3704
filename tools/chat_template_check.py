#!/usr/bin/env python3
"""Captures transformers' apply_chat_template output for a set of conversations, as the reference
tests/test_dataset.c (test_templates_vs_transformers) compares megatrain's hard-coded templates
with. Needs transformers and a tokenizer directory holding tokenizer_config.json with its
chat_template (no network: the GPU machine has none).

    python3 tools/chat_template_check.py TOKENIZER_DIR --family qwen3 [--out FILE.json]
    python3 tools/chat_template_check.py TOKENIZER_DIR --family qwen2 \
        --template tools/chat_templates/qwen2.5.jinja [--out FILE.json]
    python3 tools/chat_template_check.py --jinja-only --family qwen2 \
        --template tools/chat_templates/qwen2.5.jinja [--out FILE.json]

--template replaces the tokenizer's chat_template (Qwen2.5's and Mistral's are not among the
tokenizers tools/setup.sh fetches; tools/chat_templates/ holds the ones the models ship), and
--bos/--eos the special tokens it prints (Mistral: <s> and </s>).
--jinja-only renders without transformers, with jinja2 set up as transformers sets it up
(sandboxed, trim_blocks, lstrip_blocks, raise_exception, tojson); the JSON then says so.
Without --out it prints the renderings. The JSON holds the renderer, the family and, per case,
the messages and the rendered text (tokenize=False, add_generation_prompt=False).
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


def jinja_render(template, messages, bos="", eos=""):
    """transformers' chat-template environment, for machines without transformers."""
    import json as _json
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, indent=None: _json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=False,
                                            bos_token=bos, eos_token=eos)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer_dir", nargs="?")
    ap.add_argument("--family", required=True, help="qwen2, qwen3, llama3 or mistral (recorded in the JSON)")
    ap.add_argument("--template", help="a chat template file used instead of the tokenizer's")
    ap.add_argument("--jinja-only", action="store_true", help="render with jinja2 alone (needs --template)")
    ap.add_argument("--bos", help="bos_token for the template (default: the tokenizer's; '' with --jinja-only)")
    ap.add_argument("--eos", help="eos_token for the template (default: the tokenizer's; '' with --jinja-only)")
    ap.add_argument("--out", help="write the JSON reference here")
    args = ap.parse_args()
    template = open(args.template, encoding="utf-8").read() if args.template else None
    if args.jinja_only:
        if not template:
            sys.exit("chat_template_check: --jinja-only needs --template")
        import jinja2
        render = lambda messages: jinja_render(template, messages, args.bos or "", args.eos or "")
        renderer = f"jinja2 {jinja2.__version__} set up as transformers does (not transformers itself)"
    else:
        if not args.tokenizer_dir:
            sys.exit("chat_template_check: a tokenizer directory is needed (or --jinja-only)")
        try:
            import transformers
            from transformers import AutoTokenizer
        except ImportError as e:
            sys.exit(f"chat_template_check: {e}: needs transformers (or --jinja-only)")
        tok = AutoTokenizer.from_pretrained(args.tokenizer_dir)
        if template:
            tok.chat_template = template
        if args.bos is not None:
            tok.bos_token = args.bos
        if args.eos is not None:
            tok.eos_token = args.eos
        if not getattr(tok, "chat_template", None):
            sys.exit(f"chat_template_check: {args.tokenizer_dir}: the tokenizer has no chat_template")
        render = lambda messages: tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        renderer = f"transformers {transformers.__version__} apply_chat_template"
    out = {"family": args.family, "renderer": renderer, "template": args.template or "the tokenizer's", "cases": []}
    for name, messages in CASES:
        text = render(messages)
        out["cases"].append({"name": name, "messages": messages, "rendered": text})
        print(f"--- {args.family}: {name} ---\n{text!r}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
