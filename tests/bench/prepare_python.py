#!/usr/bin/env python3
"""The Python way of preparing SFT samples, for `make bench`: transformers' apply_chat_template with
tokenize=True and return_assistant_tokens_mask=True, once per sample (per conversation, or per assistant
turn over every prefix), on the same conversations, template and tokenizer as kiln. Prints one JSON line."""
import argparse
import json
import resource
import time

from transformers import PreTrainedTokenizerFast


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="conversations.jsonl from kiln ingest")
    p.add_argument("--template", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--mode", choices=["conversation", "per-turn"], required=True)
    args = p.parse_args()
    tok = PreTrainedTokenizerFast(tokenizer_file=args.tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    template = open(args.template).read()
    convs = []
    passed = ("tool_calls", "name", "tool_call_id")  # as kiln's conversations.jsonl holds them
    for line in open(args.data):
        c = json.loads(line)
        msgs = [{"role": m["role"], "content": m["content"], **({"reasoning_content": m["reasoning"]} if m.get("reasoning") else {}),
                 **{k: m[k] for k in passed if k in m}} for m in c["messages"]]
        trained = [m["role"] == "assistant" and c["messages"][i].get("train", True) for i, m in enumerate(msgs)]
        convs.append((msgs, c.get("tools"), trained))
    start = time.perf_counter()
    samples = tokens = supervised = 0
    for msgs, tools, trained in convs:
        if args.mode == "conversation":
            targets = [msgs]
        else:
            targets = [msgs[: i + 1] for i in range(len(msgs)) if trained[i]]
        for t in targets:
            enc = tok.apply_chat_template(t, tools=tools, chat_template=template, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            samples += 1
            tokens += len(enc["input_ids"])
            mask = enc["assistant_masks"]
            if args.mode == "per-turn":
                # Only the sample's own turn is trained (the last run of the mask), as kiln does; the
                # template marks history turns too.
                end = len(mask)
                while end > 0 and not mask[end - 1]:
                    end -= 1
                start_run = end
                while start_run > 0 and mask[start_run - 1]:
                    start_run -= 1
                mask = mask[start_run:end]
            supervised += sum(mask)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"engine": "transformers", "mode": args.mode, "conversations": len(convs), "samples": samples, "tokens": tokens,
                      "supervised_tokens": supervised, "wall_seconds": wall, "conversations_per_s": len(convs) / wall,
                      "tokens_per_s": tokens / wall, "peak_rss_bytes": peak}))


if __name__ == "__main__":
    main()
